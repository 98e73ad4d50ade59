"""``szo report RUN_DIR [RUN_DIR ...] [--out DIR]``: paper-style tables and plots (``szo.report``)."""
from __future__ import annotations

import argparse
import sys

from szo.report import collect_runs, like_runs, render, write_report

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Print the tables of the runs under ``args.run_dirs``; with ``--out``, write them there too."""
    runs = collect_runs(args.run_dirs)
    for note in like_runs(runs)[1]:
        print(f"warning: {note}", file=sys.stderr)
    print(render(runs))
    if args.out:
        paths = write_report(runs, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
