"""``szo hw-report MODEL_OR_RUN`` and ``szo hw lava-check RUN_DIR``: their arguments and handlers (the
commands themselves: the table in ``szo.cli``; also ``python -m szo.hw.cli``)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from szo.hw.fixed import ARITHMETICS, BitWidths
from szo.hw.lava.bridge import RUNNER_TIMEOUT_S, check_summary, write_check
from szo.hw.lava.check import lava_check
from szo.hw.neuron import RESETS
from szo.hw.reports.hw_report import DATA_CHOICES, LOIHI2, hw_report, to_markdown, write_report
from szo.options import IntegerLearnerOptions

__all__ = ["add_hw_report_arguments", "add_hw_arguments", "run_hw_report", "run_lava_check",
           "main"]


def add_hw_report_arguments(p: argparse.ArgumentParser) -> None:
    """``szo hw-report``'s arguments and handler, added to its parser."""
    p.description = __doc__
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


def run_hw_report(args: argparse.Namespace) -> int:
    chip = replace(LOIHI2, core_memory_kb=args.core_kb, cores=args.cores, energy_per_synop_pj=args.energy_pj)
    learner = IntegerLearnerOptions(basis_bits=args.basis_bits, coord_bits=args.coord_bits, ref_bits=args.ref_bits)
    rep = hw_report(args.target, data=args.data, batch=args.batch, k=args.k, learner=learner, input_size=args.input_size,
                    widths=BitWidths(weight_bits=args.weight_bits), chip=chip, seed=args.seed,
                    arithmetic=args.arithmetic, reset=args.reset, neurobench=not args.no_neurobench)
    if args.out is None:
        sys.stdout.write(to_markdown(rep))
    else:
        md, js = write_report(rep, args.out)
        print(f"wrote {md} and {js}")
    return 0


def add_hw_arguments(p: argparse.ArgumentParser) -> None:
    """``szo hw``'s subcommands (``lava-check``) and their handlers, added to its parser."""
    sub = p.add_subparsers(dest="hw_command", metavar="HW_COMMAND", required=True)
    c = sub.add_parser("lava-check", help="run N test samples through Intel Lava (.venv-lava, make lava) and through "
                                          "szo's 'loihi' simulator; compare every spike, readout value and label",
                       description="Exports the run's network to Lava (conv as the Dense of its Toeplitz matrix, "
                                   "sum pooling folded into the next synapse, hard-reset LIF), runs the samples back "
                                   "to back in Lava's own runtime (Loihi2SimCfg, fixed_pt: PyDenseModelBitAcc, "
                                   "PyLifResetModelBitAcc), aligns Lava's one-step Dense delays and compares. Writes "
                                   "RUN_DIR/lava_check.json (shown by szo hw-report). Exit status 1 where anything "
                                   "differs.")
    c.add_argument("target", metavar="RUN_DIR", help="run directory (or a registered model name: random init)")
    c.add_argument("--samples", type=int, default=100, help="test samples (default 100)")
    c.add_argument("--data", choices=DATA_CHOICES, default="test",
                   help="test: the run's own test set (default); digits; random")
    c.add_argument("--reset", choices=("zero",), default=None,
                   help="deploy every LIF with the hard reset of a standard Lava LIF (default: the run's hw.reset)")
    c.add_argument("--seed", type=int, default=0, help="which test samples (a seeded random subset)")
    c.add_argument("--keep", type=Path, default=None, help="keep the request / result exchange bundles in this directory")
    c.add_argument("--lava-python", default=None,
                   help="interpreter with lava-nc (default $SZO_LAVA_PYTHON, else .venv-lava/bin/python)")
    c.add_argument("--timeout-s", type=float, default=RUNNER_TIMEOUT_S,
                   help=f"seconds the Lava runner may take; past them it and Lava's processes are killed "
                        f"(default {RUNNER_TIMEOUT_S:g})")
    c.set_defaults(func=run_lava_check)


def run_lava_check(args: argparse.Namespace) -> int:
    rep = lava_check(args.target, args.samples, data=args.data, reset=args.reset, seed=args.seed,
                     python=args.lava_python, keep=args.keep, timeout_s=args.timeout_s)
    print("\n".join(check_summary(rep)))
    if Path(args.target).is_dir():
        print(f"wrote {write_check(rep, args.target)}")
    return 0 if rep["bit_exact"] and rep["labels_agree"] == rep["samples"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="szo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_hw_report_arguments(sub.add_parser("hw-report"))
    add_hw_arguments(sub.add_parser("hw"))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
