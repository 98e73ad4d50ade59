"""``szo demo digits [--out DIR] [--device D] [--no-full-space] [--seed S] [--scale absolute] [--workers N]``: the digits quickstart
(``szo.pipeline.run_demo_digits``: BPTT -> subspace -> BP-Subspace / SZO-CGE / SZO-RGE + table)."""
from __future__ import annotations

import argparse

from szo.pipeline import run_demo_digits

__all__ = ["run_digits"]


def run_digits(args: argparse.Namespace) -> int:
    run_demo_digits(args.out, device=args.device, full_space=not args.no_full_space, seed=args.seed,
                    scale=args.scale, workers=args.workers)
    return 0
