"""``szo demo dvs-stream``: argparse wiring for ``szo.demos.dvs_stream.run_demo``.

Every flag below is one setting of ``szo.demos.settings.StreamConfig`` (its default and its
check live there); a flag not given keeps the default, or with ``--resume`` the run's own
config.yaml. ``szo.cli.DEMOS`` adds the subcommand to the main CLI's ``demo`` group;
``python -m szo.demos.cli dvs-stream ...`` runs it standalone.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from szo.data.dvs import FITS, supported_formats
from szo.demos.dvs_stream import run_demo
from szo.demos.settings import ADAPT_METHODS, DEFAULT_SHIFT, StreamConfig, resumed_settings

__all__ = ["add_arguments", "add_dvs_stream_arguments", "main"]

# setting -> (type, help); the rest of the flags are added one by one below
_FLAGS = {
    "source": (str, "'synthetic' (random gestures, a domain shift half way) or an event file: " + supported_formats()),
    "labels_file": (str, "for a FILE source: .npy structured array with fields start_us, end_us, label"),
    "gestures": (int, "synthetic stream length in gestures"),
    "window_ms": (float, "window length in ms (a multiple of the model's frame length)"),
    "lr": (float, "SZO learning rate (default 0.2 with the labels loss, 0.005 with entropy)"),
    "mu": (float, "SZO perturbation scale"),
    "momentum": (float, "SZO momentum"),
    "q": (int, "RGE directions per step"),
    "buffer": (int, "SZO loss over the last N windows, each from its own saved state"),
    "seed": (int, "stream / RGE seed"),
    "model": (str, "RUN_DIR of a finished synthetic-gesture recipe run (e.g. OUT/source of an earlier demo) or a "
                   ".nir file exported from one (runs with --adapt none); default: train the recipe in OUT/source"),
    "recipe": (str, "the source model's recipe (a synthetic-gesture BPTT recipe or YAML file)"),
}


def _shift_arg(text: str) -> dict[str, Any]:
    """``key=value[,key=value]`` (offset as ``dx:dy``) -> the synthetic source's shift dict."""
    out: dict[str, Any] = {}
    if text.strip().lower() == "none":
        return out
    for part in text.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"shift must be key=value[,key=value], got {text!r}")
        k, v = (s.strip() for s in part.split("=", 1))
        try:
            out[k] = [float(x) for x in v.split(":")] if k == "offset" else float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad number in shift {part!r}") from None
    return out


def add_dvs_stream_arguments(p: argparse.ArgumentParser) -> None:
    """The dvs-stream options (shared by the main CLI and the standalone entry point)."""
    d = StreamConfig()
    for key, (typ, text) in _FLAGS.items():
        default = "" if getattr(d, key) is None else f" (default {getattr(d, key)})"
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None, help=text + default)
    p.add_argument("--sensor-size", dest="sensor_size", type=int, nargs=3, metavar=("W", "H", "P"), default=None,
                   help="sensor of a FILE source (default: what the file states, else the model's input, 32 32 2); "
                        "an event outside it is refused")
    p.add_argument("--fit", choices=FITS, default=None,
                   help="map a FILE source's sensor onto the model's input with tonic's transforms: 'crop' (the "
                        "centre), 'downsample' (scale each axis), 'crop+downsample' (crop to the model's aspect "
                        "ratio, then scale); without it a sensor of another size is refused")
    p.add_argument("--adapt", choices=ADAPT_METHODS, default=None,
                   help=f"on-line adaptation (default {d.adapt}); an adapting run is compared with 'none'")
    p.add_argument("--loss", choices=("auto", "entropy", "labels"), default=None,
                   help="SZO loss: 'entropy' (unlabeled, Tent), 'labels' (TET against the stream's labels), "
                        "'auto' (default): labels for the synthetic source (entropy minimisation collapses "
                        "under its noise shift), entropy for a FILE source unless --labels-file is given")
    p.add_argument("--labels", dest="loss", action="store_const", const="labels", help="same as --loss labels")
    p.add_argument("--shift", type=_shift_arg, default=None,
                   help="synthetic domain shift from half way, e.g. noise_rate_hz=30 or speed=2 or offset=4:0 "
                        f"(default {','.join(f'{k}={v:g}' for k, v in DEFAULT_SHIFT.items())}; 'none' for no shift)")
    p.add_argument("--no-compare", dest="compare", action="store_const", const=False, default=None,
                   help="do not also replay the stream without adaptation")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a value of the source model's recipe (repeatable), e.g. --set bptt.epochs=3")
    p.add_argument("--out", default="runs/dvs-stream", help="run directory (default runs/dvs-stream)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (killed or finished) with its own config.yaml: the source "
                        "model's BPTT from its last checkpoint, then the replays (a changed setting is refused)")
    p.add_argument("--print-every", type=int, default=20, help="a status line every N windows (1: every window)")


def _run(args: argparse.Namespace) -> int:
    given = {k: v for k in (*_FLAGS, "sensor_size", "fit", "adapt", "loss", "shift", "compare", "overrides")
             if (v := getattr(args, k)) is not None}
    cfg = resumed_settings(args.out, given) if args.resume else StreamConfig(**given)
    summary = run_demo(args.out, cfg, resume=args.resume, print_every=max(0, args.print_every))
    print(json.dumps(summary["runs"], indent=1))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``szo demo dvs-stream``'s arguments and handler, added to its parser."""
    p.description = ("Replay an event stream in fixed windows with a persistent network state, classify "
                     "each window on-line and optionally adapt with SZO; writes config.yaml, summary.json, "
                     "windows.json and timeline.png.")
    add_dvs_stream_arguments(p)
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m szo.demos.cli dvs-stream ...``."""
    parser = argparse.ArgumentParser(prog="szo demo")
    sub = parser.add_subparsers(dest="demo", required=True)
    add_arguments(sub.add_parser("dvs-stream"))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        parser.exit(2, f"szo demo {args.demo}: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
