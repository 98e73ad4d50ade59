"""``szo hw lava-check`` / ``szo export --to lava``: a trained fixed-point network run in Intel Lava.

:func:`lava_check` runs N test samples through Lava's own runtime (the network bundle of
:func:`szo.hw.lava.bridge.export_network`, the samples back to back, in the ``.venv-lava``
interpreter) and through szo's ``loihi`` simulator of the same network (``to_fixed(model,
arithmetic="loihi", record=True)``), then compares every spike of every neuron layer, every
value the readout Dense sends and every predicted label. Lava's Dense delivers one step late,
so layer j's output of sample i, step k is Lava's step ``i T + k + j`` (``network_delays``); the
arrays are aligned before they are compared. :func:`export_run` writes the network bundle alone.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from szo.hw.convert import to_fixed
from szo.hw.fixed import A_IN_SHIFT, BitWidths
from szo.hw.lava import runner as lava_runner
from szo.hw.lava.bridge import (
    RUNNER_TIMEOUT_S,
    check_int32_bound,
    export_network,
    require_python,
    run_lava,
    weights_file,
)
from szo.hw.lava.runner import network_delays, write_bundle
from szo.hw.reports.hw_report import input_batch, load_target
from szo.io import sha256_file
from szo.models import SpikingModel

__all__ = ["export_run", "lava_check"]


def _model_and_net(target: str | SpikingModel, reset: str | None, weight_bits: int | None = None):
    model, label, cfg = load_target(target)
    model.eval()
    hw = (cfg or {}).get("hw") or {}
    reset = reset if reset is not None else hw.get("reset")
    bits = weight_bits or hw.get("weight_bits") or 8
    net = to_fixed(model, widths=BitWidths(weight_bits=int(bits)), arithmetic="loihi", reset=reset, record=True)
    return model, label, cfg, net


def _static_shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape[-3:])


def export_run(target: str | SpikingModel, out: str | os.PathLike, *, reset: str | None = None, input_size: int | None = None,
               weight_bits: int | None = None) -> tuple[Path, dict[str, Any]]:
    """``szo export --to lava``: the network bundle (no inputs) of a run directory or registered model;
    ``weight_bits``: the weight mantissas' width (default the run's ``hw.weight_bits``, else 8; Lava's
    Dense holds at most 8)."""
    if weight_bits is not None and (isinstance(weight_bits, bool) or not isinstance(weight_bits, int)
                                    or not 2 <= weight_bits <= 8):
        raise ValueError(f"weight_bits {weight_bits!r}: Lava's Dense holds 2- to 8-bit weights; valid: 2 to 8")
    model, label, cfg, net = _model_and_net(target, reset, weight_bits)
    x, _ = input_batch(model, "random", 1, input_size, 0, cfg)
    meta, arrays, _ = export_network(net, _static_shape(x))
    check_int32_bound(meta, arrays, 1 << 15)
    meta["source"]["target"] = label
    return write_bundle(out, "network", meta, arrays), meta


def _align(raw: np.ndarray, delay: int, samples: int, T: int) -> np.ndarray:
    """Raw per-step Lava array -> ``[samples, T, n]`` (sample i, step k at index i T + k + delay)."""
    return raw[delay: delay + samples * T].reshape(samples, T, -1)


def _first_diff(a: np.ndarray, b: np.ndarray) -> list[int] | None:
    idx = np.argwhere(a != b)
    return None if idx.size == 0 else [int(v) for v in idx[0]]


@torch.no_grad()
def lava_check(target: str | SpikingModel, samples: int = 100, *, data: str = "test", reset: str | None = None, seed: int = 0,
               python: str | os.PathLike | None = None, keep: str | os.PathLike | None = None,
               timeout_s: float = RUNNER_TIMEOUT_S) -> dict[str, Any]:
    """Run ``samples`` test samples through Lava and through szo's ``loihi`` simulator of the same network;
    compare every spike of every neuron layer, every readout value (Dense ``a_out``) and every
    predicted label. ``keep``: write the request / result bundles there (else a temporary directory);
    ``timeout_s``: how long the Lava runner may take (``run_lava``). More samples than the data set
    holds is refused before anything runs."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    exe = require_python(python)
    model, label, cfg, net = _model_and_net(target, reset)
    x, y = input_batch(model, data, samples, None, seed, cfg)
    have = int(x.shape[1] if x.dim() == 5 else x.shape[0])
    if have < samples:
        raise ValueError(f"--samples {samples}: the {data} set of {label} holds {have} samples; valid: 1 to {have}")
    x_seq = x if x.dim() == 5 else x.unsqueeze(0).expand(net.T, *x.shape)
    if x_seq.shape[0] != net.T:
        raise ValueError(f"input has {x_seq.shape[0]} time steps, the network runs T = {net.T}")
    meta, arrays, names = export_network(net, _static_shape(x))
    x_int = net.quantize_input(x_seq)  # [T, N, C, H, W]: what szo's forward sees
    inputs = x_int.flatten(2).transpose(0, 1).contiguous().numpy()
    check_int32_bound(meta, arrays, int(np.abs(inputs).max()) if inputs.size else 0)
    arrays["inputs"] = inputs.astype(np.int32)
    meta["source"]["target"] = label
    net.reset_counters()
    t0 = time.perf_counter()
    net(x_seq)  # szo's simulator, recording every layer
    szo_s = time.perf_counter() - t0
    readout_path = names[meta["layers"][-1]["name"]]
    rec = {n: net.last_record[p].flatten(2).transpose(0, 1).numpy() for n, p in names.items() if p in net.last_record}
    szo_sum = net.last_readout_sum  # not None: export_network checked that the network ends in a readout synapse
    szo_pred = szo_sum.argmax(-1).numpy()
    with tempfile.TemporaryDirectory(prefix="szo-lava-") as tmp:
        root = Path(keep) if keep is not None else Path(tmp)
        write_bundle(root / "request", "network", meta, arrays)
        t0 = time.perf_counter()
        res = run_lava(root / "request", root / "result", python=exe, timeout_s=timeout_s)
        lava_s = time.perf_counter() - t0
    delays = network_delays(meta)
    T = int(meta["T"])
    layers: dict[str, Any] = {}
    for layer in meta["layers"][1::2]:
        name = layer["name"]
        ours, theirs = rec[name].astype(np.int64), _align(res.arrays[f"spikes.{name}"], delays[name], samples, T)
        layers[names[name]] = {"elements": int(ours.size), "equal": int((ours == theirs).sum()),
                               "spikes_szo": int(ours.sum()), "spikes_lava": int(theirs.sum()),
                               "first_diff": _first_diff(ours, theirs), "delay_steps": delays[name]}
    a_out = _align(res.arrays["a_out"], delays["a_out"], samples, T).astype(np.int64)
    ours = rec[meta["layers"][-1]["name"]].astype(np.int64)  # szo: a_out << 6, the synaptic current without bias
    readout = {"elements": int(ours.size), "equal": int((ours == a_out << A_IN_SHIFT).sum()),
               "first_diff": _first_diff(ours, a_out << A_IN_SHIFT), "delay_steps": delays["a_out"]}
    current = (a_out << A_IN_SHIFT) + arrays["readout_bias"]  # the host adds the readout bias, as szo does
    lava_sum = np.clip(current.sum(1), -(1 << 31), (1 << 31) - 1)  # szo's 32-bit saturating readout accumulator
    lava_pred = lava_sum.argmax(-1)
    labels = y.numpy() if y is not None else None
    exact = all(v["equal"] == v["elements"] for v in layers.values()) and readout["equal"] == readout["elements"]
    return {
        "target": label, "samples": samples, "data": data, "seed": seed, "T": T,
        "reset": "zero", "lava_nc": res.meta.get("lava_nc"), "python": res.meta.get("python"),
        "exchange_version": lava_runner.VERSION, "lava_steps": int(res.arrays["a_out"].shape[0]),
        "layers": layers, "readout": {readout_path: readout},
        "labels_agree": int((lava_pred == szo_pred).sum()),
        "readout_sums_equal": bool(np.array_equal(lava_sum, szo_sum.numpy())),
        "accuracy_szo": None if labels is None else float((szo_pred == labels).mean()),
        "accuracy_lava": None if labels is None else float((lava_pred == labels).mean()),
        "bit_exact": bool(exact and np.array_equal(lava_sum, szo_sum.numpy())),
        "seconds": {"lava_runner": round(lava_s, 2), "lava_network": res.meta.get("seconds"), "szo": round(szo_s, 3)},
        "lava_weight_exps": {names[l_["name"]]: l_["weight_exp"] for l_ in meta["layers"] if l_["kind"] == "dense"},
        "saturations": net.saturation_counts(),
        "weights_sha256": _weights_digest(target),
    }


def _weights_digest(target: Any) -> str | None:
    w = weights_file(target) if isinstance(target, (str, Path)) and Path(str(target)).is_dir() else None
    return sha256_file(w) if w is not None else None
