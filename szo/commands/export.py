"""``szo export TARGET --to nir OUT.nir``, ``szo export RUN_DIR --to lava OUT_DIR`` and ``szo import IN.nir``
(their arguments and handlers; the commands: the table in ``szo.cli``).

``szo export`` writes the NIR graph of a run directory's model (or of a registered model,
random init); ``--fixed`` exports the fixed-point network of ``szo.hw`` instead (dequantised
weights, integer mantissas / exponents in node metadata). ``--to lava`` writes the ``loihi``
fixed-point network as a szo-lava exchange bundle (``szo.hw.lava.runner``: the integer weights
and exponents of one Lava ``Dense`` per synapse, du / dv / vth and bias mantissa / exponent of
one ``LIF`` per neuron layer), which ``szo.hw.lava.runner.build_network``
turns into Lava processes; ``szo hw lava-check`` runs it against szo's simulator. ``szo import`` reads a ``.nir``
file into a :class:`szo.export.NIRNetwork` (SpikingJelly layers, the zoo's forward
interface), prints what it holds and, with ``--data``, its test accuracy; ``--compare
RUN_DIR`` also runs the run's own model on the same batches and prints the largest logit
difference and the prediction agreement; ``--dt`` gives a graph without one (a discrete-time
graph such as sinabs') the step its time constants and rates are read with.
"""
from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import torch
import yaml

from szo.build import load_run_model
from szo.data import get_dataset, make_loader
from szo.demos.dvs_stream import load_source_model
from szo.export import from_nir, to_nir, write_nir
from szo.hw.convert import to_fixed
from szo.hw.lava.check import export_run
from szo.hw.reports.hw_report import input_batch, load_target
from szo.io import atomic_write_bytes

__all__ = ["add_export_arguments", "add_import_arguments", "run_export", "run_import"]

TARGETS: tuple[str, ...] = ("nir", "lava")


def add_export_arguments(e: argparse.ArgumentParser) -> None:
    """``szo export``'s arguments and handler, added to its parser."""
    e.description, e.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    e.add_argument("target", metavar="RUN_DIR_OR_MODEL",
                   help="run directory (config.yaml + model.safetensors or checkpoints/last.pt) or registered model name")
    e.add_argument("--to", choices=TARGETS, default="nir",
                   help="exchange format (default nir; lava: the fixed-point network for Intel Lava)")
    e.add_argument("out", metavar="OUT", type=Path, help="OUT.nir, or with --to lava the bundle directory")
    e.add_argument("--input-size", type=int, default=None,
                   help="H = W of one frame (default: the run's data set; 8 for spike_convnet, else 32)")
    e.add_argument("--dt", type=float, default=None,
                   help="--to nir: seconds per time step in NIR time constants (default 1e-4); a Lava bundle counts "
                        "steps, so --to lava refuses it")
    e.add_argument("--fixed", action="store_true",
                   help="export the fixed-point network (szo.hw) instead of the float one (--to lava always does)")
    e.add_argument("--weight-bits", type=int, default=None,
                   help="weight mantissa bits of the fixed-point network: with --fixed (default 8), or --to lava "
                        "(2 to 8; default the run's hw.weight_bits, else 8)")
    e.add_argument("--reset", choices=("zero",), default=None,
                   help="with --to lava: deploy every LIF with the hard reset of a standard Lava LIF "
                        "(default: the run's hw.reset)")
    e.set_defaults(func=run_export)


def add_import_arguments(i: argparse.ArgumentParser) -> None:
    """``szo import``'s arguments and handler, added to its parser."""
    i.description, i.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    i.add_argument("source", metavar="IN.nir", type=Path)
    i.add_argument("--data", default=None, help="evaluate on this data set's test split (e.g. digits)")
    i.add_argument("--batch", type=int, default=128)
    i.add_argument("--T", type=int, default=None, help="time steps for static inputs (default: the graph's metadata)")
    i.add_argument("--dt", type=float, default=None, metavar="SECONDS",
                   help="seconds per time step the graph's time constants are read with (default: the graph's "
                        "metadata 'dt', else 1e-4); a discrete-time graph (sinabs: IF with r = 1, no dt) needs --dt 1")
    i.add_argument("--compare", type=Path, default=None, metavar="RUN_DIR",
                   help="with --data: also run this run directory's model and report the logit difference")
    i.add_argument("--spikes", type=Path, default=None, metavar="IN.npy",
                   help="run the graph on these input spike trains ([T, N, *input] .npy, no pickle) and print the "
                        "output spike counts")
    i.add_argument("--save-spikes", type=Path, default=None, metavar="OUT.npy",
                   help="with --spikes: write the output spikes [T, N, *output] (float32 .npy)")
    i.set_defaults(func=run_import)


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag given applies to the chosen export, or is refused in one line (never silently dropped)."""
    if args.to == "lava":
        if args.dt is not None:
            raise ValueError("--dt sets NIR's time constants (--to nir); a Lava bundle counts time steps (T) and "
                             "has no step length: leave --dt out with --to lava")
        return
    if args.reset is not None:
        raise ValueError("--reset deploys the LIFs of a Lava bundle (--to lava); --to nir exports each LIF's own reset")
    if args.weight_bits is not None and not args.fixed:
        raise ValueError(f"--weight-bits {args.weight_bits} quantises the fixed-point network: add --fixed (or use "
                         "--to lava), or leave it out for the float network")


def run_export(args: argparse.Namespace) -> int:
    _check_flags(args)
    if args.to == "lava":
        return _export_lava(args)
    stream_meta = _stream_metadata(Path(args.target))
    if stream_meta is not None:  # a dvs-stream source model: keep its frame length for the demo
        model, label = stream_meta.pop("model"), str(args.target)
        w, h, p = stream_meta["sensor_size"]
        shape = (int(p), int(h), int(w))
    else:
        model, label, cfg = load_target(args.target)
        shape = tuple(input_batch(model, "random", 1, args.input_size, 0, cfg)[0].shape[-3:])
    model.eval()
    if args.fixed:
        model = to_fixed(model, weight_bits=8 if args.weight_bits is None else args.weight_bits)
    graph = to_nir(model, shape, dt=args.dt, metadata=stream_meta)
    digest = write_nir(graph, args.out)
    kinds: dict[str, int] = {}
    for node in graph.nodes.values():
        kinds[type(node).__name__] = kinds.get(type(node).__name__, 0) + 1
    print(f"wrote {args.out} ({'fixed-point' if args.fixed else 'float'} {label}, input {list(shape)}, "
          f"T={model.T}, {len(graph.nodes)} nodes: "
          + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) + f"; sha256 {digest[:12]})")
    return 0


def _export_lava(args: argparse.Namespace) -> int:
    path, meta = export_run(args.target, args.out, reset=args.reset, input_size=args.input_size,
                            weight_bits=args.weight_bits)
    parts = [f"{ly['name']}: Dense {ly['n_out']}x{ly['n_in']} exp {ly['weight_exp']}" if ly["kind"] == "dense"
             else f"{ly['name']}: LIF du {ly['du']} dv {ly['dv']} vth {ly['vth']}" for ly in meta["layers"]]
    print(f"wrote {path} (Lava network of {meta['source']['target']}, {meta['source']['weight_bits']}-bit weights, "
          f"input {meta['in_shape']}, T={meta['T']}: " + "; ".join(parts) + ")")
    return 0


def _stream_metadata(target: Path) -> dict | None:
    """``{"model", "bin_us", "sensor_size", "duration_us"}`` of a synthetic-gesture BPTT recipe run (the source
    model of ``szo demo dvs-stream``); None for anything else."""
    if not target.is_dir():
        return None
    is_gesture_run = False
    if (target / "config.yaml").is_file():
        raw = yaml.safe_load((target / "config.yaml").read_text(encoding="utf-8")) or {}
        is_gesture_run = (raw.get("data") or {}).get("name") == "synthetic-gesture" and raw.get("kind") == "bp"
    if not is_gesture_run:
        return None
    src = load_source_model(target)
    return {"model": src.model, "bin_us": int(src.bin_us), "sensor_size": list(src.sensor_size),
            "duration_us": int(src.duration_us)}


@torch.no_grad()
def run_import(args: argparse.Namespace) -> int:
    net = from_nir(args.source, T=args.T, dt=args.dt).eval()
    meta = net.nir_metadata
    kinds: dict[str, int] = {}
    for kind in net.nir_nodes.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    back = net.graph_module.plan.back_edges
    print(f"{args.source}: {net.model_name}, {f'T={net.graph_T}' if net.graph_T else 'T from the input'}, "
          f"{net.num_classes} classes, input "
          f"{list(net.input_shape)}, dt={net.dt:g} s, {net.num_params()} parameters (BN folded)"
          f"{', fixed-point weights' if int(meta.get('fixed_point', 0)) else ''}; "
          + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
          + (f"; recurrent: {', '.join(f'{s} -> {d}' for s, d in back)}" if back else ""))
    if args.spikes is not None:
        return _run_spikes(net, args.spikes, args.save_spikes)
    if args.save_spikes is not None:
        raise ValueError("--save-spikes needs --spikes (the input spike trains)")
    if args.data is None:
        if args.compare is not None:
            raise ValueError("--compare needs --data (the batches to compare on)")
        return 0
    ref = None
    if args.compare is not None:
        ref = load_run_model(args.compare)[0].eval()
    loader = make_loader(get_dataset(args.data, "test"), args.batch, shuffle=False)
    correct = agree = seen = 0
    max_diff = 0.0
    for x, y in loader:
        out = net(x)
        pred = out.mean(0).argmax(-1)
        correct += int((pred == y).sum())
        seen += int(y.numel())
        if ref is not None:
            r = ref(x)
            max_diff = max(max_diff, float((r - out).abs().max()))
            agree += int((r.mean(0).argmax(-1) == pred).sum())
    print(f"test accuracy on {args.data}: {100 * correct / seen:.2f}% ({correct}/{seen})")
    if ref is not None:
        print(f"vs {args.compare}: max |logit difference| {max_diff:.3g}, predictions agree on "
              f"{100 * agree / seen:.2f}% of samples")
    return 0


def _run_spikes(net, source: Path, save: Path | None) -> int:
    """``szo import --spikes``: the graph on a ``[T, N, *input]`` array; counts printed, spikes saved."""
    try:
        arr = np.load(source, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--spikes {source}: not a .npy array readable without pickle ({exc})") from None
    if arr.dtype.kind not in "biuf" or arr.ndim < 3 or tuple(arr.shape[2:]) != net.input_shape:
        raise ValueError(f"--spikes {source}: need a numeric [T, N, {', '.join(map(str, net.input_shape))}] array for "
                         f"this graph, got {arr.dtype} {list(arr.shape)}")
    out = net(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))
    counts = out.sum((0, 1)).reshape(-1)
    print(f"ran {arr.shape[0]} steps x {arr.shape[1]} samples: {int(out.sum())} output spikes; per output: "
          f"{[int(c) for c in counts]}")
    if save is not None:
        buf = io.BytesIO()
        np.save(buf, out.numpy().astype(np.float32), allow_pickle=False)
        atomic_write_bytes(save, buf.getvalue())
        print(f"wrote {save} ({list(out.shape)} float32)")
    return 0
