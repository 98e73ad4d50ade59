"""``szo demo dvs-stream``: argparse wiring for ``szo.demos.dvs_stream.run_demo``.

``register_demo(demo_subparsers)`` adds the subcommand to the main CLI's ``demo`` group;
``python -m szo.demos.cli dvs-stream ...`` runs it standalone.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

__all__ = ["register_demo", "add_dvs_stream_arguments", "main"]


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
            out[k] = tuple(float(x) for x in v.split(":")) if k == "offset" else float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad number in shift {part!r}") from None
    return out


def add_dvs_stream_arguments(p: argparse.ArgumentParser) -> None:
    """The dvs-stream options (shared by the main CLI and the standalone entry point)."""
    from szo.demos.dvs_stream import ADAPT_METHODS, DEFAULT_SHIFT, LABELS_LR, StreamSettings

    d = StreamSettings()
    p.add_argument("--source", default="synthetic",
                   help="'synthetic' (random gestures, domain shift half way) or a .npy structured event "
                        "array with fields x, y, t (microseconds), p (default: synthetic)")
    p.add_argument("--labels-file", default=None,
                   help="for a FILE source: .npy structured array with fields start_us, end_us, label")
    p.add_argument("--sensor-size", type=int, nargs=3, metavar=("W", "H", "P"), default=None,
                   help="sensor of a FILE source (default: the model's input, 32 32 2); W, H must be an "
                        "integer multiple of the model's input size (events are downsampled)")
    p.add_argument("--adapt", choices=ADAPT_METHODS, default=d.adapt,
                   help=f"on-line adaptation (default {d.adapt}); an adapting run is compared with 'none'")
    p.add_argument("--loss", choices=("auto", "entropy", "labels"), default="auto",
                   help="SZO loss: 'entropy' (unlabeled, Tent), 'labels' (TET against the stream's labels), "
                        "'auto' (default): labels for the synthetic source (entropy minimisation collapses "
                        "under its noise shift), entropy for a FILE source unless --labels-file is given")
    p.add_argument("--labels", action="store_true", help="same as --loss labels")
    p.add_argument("--window-ms", type=float, default=d.window_ms, help=f"window length (default {d.window_ms:g})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"SZO learning rate (default {LABELS_LR:g} with labels, {d.lr:g} with entropy)")
    p.add_argument("--mu", type=float, default=d.mu, help=f"SZO perturbation scale (default {d.mu:g})")
    p.add_argument("--momentum", type=float, default=d.momentum, help=f"SZO momentum (default {d.momentum:g})")
    p.add_argument("--q", type=int, default=d.q, help=f"RGE directions per step (default {d.q})")
    p.add_argument("--buffer", type=int, default=d.buffer,
                   help=f"SZO loss over the last N windows, each from its own saved state (default {d.buffer})")
    p.add_argument("--model", default=None, metavar="RUN_DIR|OUT.nir",
                   help="source-model directory from an earlier run (OUT/source), or a .nir file exported from "
                        "one with szo export (runs with --adapt none); default: train one (cached under OUT/source)")
    p.add_argument("--out", default="runs/dvs-stream", help="output directory (default runs/dvs-stream)")
    p.add_argument("--seed", type=int, default=d.seed, help="stream / RGE seed (default 0)")
    p.add_argument("--gestures", type=int, default=30, help="synthetic stream length in gestures (default 30)")
    p.add_argument("--shift", type=_shift_arg, default=None,
                   help="synthetic domain shift from half way, e.g. noise_rate_hz=30 or speed=2 or "
                        f"offset=4:0 (default {','.join(f'{k}={v:g}' for k, v in DEFAULT_SHIFT.items())}; "
                        "'none' for no shift)")
    p.add_argument("--no-compare", action="store_true", help="do not also replay the stream without adaptation")
    p.add_argument("--print-every", type=int, default=20, help="a status line every N windows (1: every window)")


def _run(args: argparse.Namespace) -> int:
    from szo.demos.dvs_stream import LABELS_LR, StreamSettings, run_demo

    loss = "labels" if args.labels else args.loss
    if loss == "auto":
        loss = "labels" if args.source == "synthetic" or args.labels_file else "entropy"
    stream = StreamSettings(window_ms=args.window_ms, adapt=args.adapt, use_labels=loss == "labels",
                            lr=args.lr if args.lr is not None else (LABELS_LR if loss == "labels" else StreamSettings().lr),
                            mu=args.mu, momentum=args.momentum, q=args.q, buffer=args.buffer,
                            seed=args.seed)
    summary = run_demo(args.out, source=args.source, labels_file=args.labels_file, model_dir=args.model,
                       stream=stream, n_gestures=args.gestures, shift=args.shift,
                       sensor_size=tuple(args.sensor_size) if args.sensor_size else None,
                       compare=not args.no_compare, print_every=max(0, args.print_every))
    print(json.dumps(summary["runs"], indent=1))
    return 0


def register_demo(demo_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dvs-stream`` to the ``szo demo`` subparsers; the handler is ``args.func(args) -> int``."""
    p = demo_subparsers.add_parser(
        "dvs-stream", help="classify an event stream window by window, adapting on-line with SZO",
        description="Replay an event stream in fixed windows with a persistent network state, classify "
                    "each window on-line and optionally adapt with SZO; writes summary.json, windows.json "
                    "and timeline.png.")
    add_dvs_stream_arguments(p)
    p.set_defaults(func=_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m szo.demos.cli dvs-stream ...``."""
    parser = argparse.ArgumentParser(prog="szo demo")
    sub = parser.add_subparsers(dest="demo", required=True)
    register_demo(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        parser.exit(2, f"szo demo {args.demo}: error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
