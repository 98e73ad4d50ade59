"""What NIR's IF cannot say about sinabs' IAF, measured: sinabs' own N-MNIST CNN (its NIR export,
tests/export/data/sinabs_cnn.nir) run by sinabs and by ``szo import --dt 1`` on one real N-MNIST
recording (/work/shared/data/nmnist, or --recording), binned into T frames of event counts.

    OMP_NUM_THREADS=1 python bench/sinabs_iaf.py [--T 30] [--recording sample_nmnist.bin]

sinabs' ``IAFSqueeze`` emits as many spikes per step as the membrane holds thresholds
(``MultiSpike``), subtracts them (``MembraneSubtract``) and, as sinabs' NIR import builds it, keeps
the membrane above ``-v_threshold``; NIR's ``IF`` (what szo runs) emits at most one spike per step,
resets to ``v_reset`` and has no lower bound. Prints per IF layer the spike counts of: sinabs'
original network (no lower bound), sinabs' import of its NIR file, and szo's import; and the most
spikes one neuron emitted in one step. Needs sinabs (not in szo's extras: sinabs 3.1.3 pins
nir <= 1.0.4, szo needs nir >= 1.0.8; ``pip install --no-deps sinabs samna pbr`` beside it works).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys
import warnings
from pathlib import Path

import torch
from common import machine_info, set_threads  # noqa: F401  (puts the checkout on sys.path)

from szo.export import from_nir, read_nir

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "tests" / "export" / "data" / "sinabs_cnn.nir"


def _frames(path: Path, T: int) -> torch.Tensor:
    import numpy as np
    import tonic

    ev = tonic.io.read_mnist_file(str(path), dtype=np.dtype([("x", int), ("y", int), ("t", int), ("p", int)]))
    frames = tonic.transforms.ToFrame(sensor_size=(34, 34, 2), n_time_bins=T)(ev)  # [T, 2, 34, 34] counts
    return torch.from_numpy(frames.astype("float32")).unsqueeze(1)  # [T, 1, 2, 34, 34]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=30)
    ap.add_argument("--recording", type=Path, default=ROOT.parent.parent / "shared" / "data" / "nmnist" /
                    "sample_nmnist.bin")
    args = ap.parse_args()
    if importlib.util.find_spec("sinabs") is None:
        sys.exit("bench/sinabs_iaf.py needs sinabs: pip install --no-deps sinabs samna pbr")
    import sinabs.layers as sl
    from sinabs.nir import from_nir as sinabs_from_nir

    sys.path.insert(0, str(GRAPH.parent))
    from make_sinabs_cnn import sinabs_cnn

    set_threads(1)
    x = _frames(args.recording, args.T)
    graph = read_nir(GRAPH)

    def record(net, kinds):
        rec = []
        hooks = [m.register_forward_hook(lambda m, i, o: rec.append(o)) for m in net.modules() if isinstance(m, kinds)]
        return rec, hooks

    original = sinabs_cnn().eval()  # the network sinabs exported: IAFSqueeze without a lower bound
    rec_o, _ = record(original, (sl.IAFSqueeze,))
    original(x.flatten(0, 1))  # sinabs' Squeeze layers take [T * N, ...] (batch_size=1)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        imported = sinabs_from_nir(graph, batch_size=1)
    rec_i, _ = record(imported, (sl.IAFSqueeze,))
    imported(x.flatten(0, 1))
    szo = from_nir(GRAPH, dt=1.0).eval()
    from spikingjelly.activation_based import neuron

    rec_s, _ = record(szo, (neuron.IFNode,))
    szo(x)
    print(f"sinabs_cnn.nir on {args.recording.name} ({int(x.sum())} events in T = {args.T} frames); "
          f"{machine_info().get('cpu', '')}")
    print("| IF layer | sinabs original (no floor) | sinabs import of the .nir (floor -thr) | szo import --dt 1 | "
          "most spikes of one neuron in one step (sinabs import) |")
    print("|---|---|---|---|---|")
    for k, (a, b, c) in enumerate(zip(rec_o, rec_i, rec_s)):
        print(f"| {k + 1} | {int(a.sum())} | {int(b.sum())} | {int(c.sum())} | {int(b.max())} |")


if __name__ == "__main__":
    main()
