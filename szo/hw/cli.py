"""``szo hw-report MODEL_OR_RUN``: CLI wiring (``register(subparsers)``; also ``python -m szo.hw.cli``)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from szo.hw.fixed import ARITHMETICS, Precision
from szo.hw.neuron import RESETS
from szo.hw.report import DATA_CHOICES, LOIHI2, hw_report, to_markdown, write_report
from szo.optim.options import IntegerLearnerOptions

__all__ = ["register", "run_hw_report", "main"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``hw-report`` sub-command to a ``szo`` CLI parser."""
    p = subparsers.add_parser("hw-report", help="on-chip memory / synaptic ops / energy of SZO on a Loihi-class chip",
                              description=__doc__)
    p.add_argument("target", metavar="MODEL_OR_RUN",
                   help="registered model name (random init) or run directory (config.yaml + model.safetensors "
                        "or checkpoints/last.pt)")
    p.add_argument("--data", choices=DATA_CHOICES, default="random",
                   help="batch used to measure spike rates: uniform random images (of the run's data shape), "
                        "the digits test set, or the run's own test set")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=40, help="subspace dimension (SZO-CGE step = 2k forwards)")
    p.add_argument("--arithmetic", choices=ARITHMETICS, default="szo",
                   help="integer arithmetic of the measured forward: szo (saturating) or loihi (bit-exact with "
                        "Lava's bit-accurate Dense/LIF: wrapping current, floor shifts); the report compares both")
    p.add_argument("--reset", choices=RESETS, default=None,
                   help="override every LIF's reset (default: its own; 'zero' is the standard Loihi 2 LIF)")
    p.add_argument("--weight-bits", type=int, default=8)
    p.add_argument("--basis-bits", type=int, default=8)
    p.add_argument("--coord-bits", type=int, default=32)
    p.add_argument("--ref-bits", type=int, default=16, help="bits of the stored theta_ref")
    p.add_argument("--input-size", type=int, default=None,
                   help="H = W of the random input (default: the run's data set, else 8 for spike_convnet, 32)")
    p.add_argument("--core-kb", type=float, default=LOIHI2.core_memory_kb, help="memory per core (KB)")
    p.add_argument("--cores", type=int, default=LOIHI2.cores)
    p.add_argument("--energy-pj", type=float, default=LOIHI2.energy_per_synop_pj, help="energy per synaptic op")
    p.add_argument("--out", type=Path, default=None, help="directory for hw_report.md / .json (default: print)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-neurobench", action="store_true",
                   help="skip NeuroBench's own metrics (SynOps, sparsity, footprint; needs the deploy extra)")
    p.set_defaults(func=run_hw_report)
    return p


def run_hw_report(args: argparse.Namespace) -> int:
    chip = replace(LOIHI2, core_memory_kb=args.core_kb, cores=args.cores, energy_per_synop_pj=args.energy_pj)
    learner = IntegerLearnerOptions(basis_bits=args.basis_bits, coord_bits=args.coord_bits, ref_bits=args.ref_bits)
    rep = hw_report(args.target, data=args.data, batch=args.batch, k=args.k, learner=learner, input_size=args.input_size,
                    precision=Precision(weight_bits=args.weight_bits), chip=chip, seed=args.seed,
                    arithmetic=args.arithmetic, reset=args.reset, neurobench=not args.no_neurobench)
    if args.out is None:
        sys.stdout.write(to_markdown(rep))
    else:
        md, js = write_report(rep, args.out)
        print(f"wrote {md} and {js}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="szo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
