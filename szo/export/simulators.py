"""Run an exported NIR graph in someone else's simulator (snnTorch), for round-trip checks.

snnTorch's own importer (``snntorch.import_nir.import_from_nir``: nirtorch's graph executor
around ``torch.nn`` layers and ``snn.Leaky``) builds the network; szo changes only what NIR
cannot carry (the soft reset, see ``szo.export.nir_export``): every ``snn.Leaky`` whose
NIR node says ``metadata["reset"] == "subtract"`` is rebuilt with the same ``beta`` and
``threshold`` and ``reset_mechanism="subtract"``. snnTorch then computes
``mem[t] = beta * mem[t-1] + x[t]``, ``spk = H(mem - thr)``, ``mem -= spk * thr``, which is
eq. (1)-(2). It is not bit-identical to SpikingJelly's ``v - v / tau + x`` (``beta * v``
rounds differently from ``v - v / tau`` in float32), so spikes may flip when a membrane
lands within float rounding of the threshold; docs/deploy.md gives the measured agreement.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, NamedTuple

import numpy as np
import torch

from szo.export.nir_common import meta_str

__all__ = ["SnnTorchRun", "run_snntorch", "snntorch_from_nir", "spike_agreement"]


class _NoLateResetLeaky:
    """Mixin: ``mem_reset`` returns 0, so ``Leaky(subtract, reset_delay=False)`` computes
    ``mem = beta * mem + x; spk = H(mem - thr); mem -= spk * thr`` = eq. (1)-(2) (a diagnostic
    patch of snnTorch 1.0's neuron, see :func:`run_snntorch`)."""

    def mem_reset(self, mem: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(mem)


def snntorch_from_nir(graph: Any, *, patch_late_reset: bool = False) -> torch.nn.Module:
    """snnTorch's import of ``graph`` (a ``nir.NIRGraph``), with subtractive resets restored.

    ``patch_late_reset=True`` (a diagnostic, not snnTorch's behaviour) also drops the
    carried-over reset term of snnTorch 1.0's ``Leaky`` (snntorch issue #364), leaving exactly
    eq. (1)-(2): what remains between szo and snnTorch is then float rounding alone."""
    import snntorch as snn
    from snntorch.import_nir import import_from_nir


    with contextlib.redirect_stdout(io.StringIO()):  # the importer prints progress lines
        net = import_from_nir(graph)
    for name, node in graph.nodes.items():
        meta = getattr(node, "metadata", None) or {}
        if type(node).__name__ != "LIF" or meta_str(meta, "reset", "value") != "subtract":
            continue
        key = name.replace(".", "_")
        old = getattr(net, key)
        if not isinstance(old, snn.Leaky):
            raise ValueError(f"snnTorch imported NIR node {name!r} as {type(old).__name__}, not snn.Leaky")
        cls = type("Eq1Leaky", (_NoLateResetLeaky, snn.Leaky), {}) if patch_late_reset else snn.Leaky
        new = cls(beta=old.beta.detach().clone(), threshold=float(old.threshold), reset_mechanism="subtract",
                  init_hidden=True, reset_delay=False)
        setattr(net, key, new)
    return net


class SnnTorchRun(NamedTuple):
    logits: torch.Tensor
    """``[T, N, classes]``"""
    late_reset: torch.Tensor
    """``[N]`` bool: a neuron's membrane was still >= threshold after its subtractive reset,
    where snnTorch 1.0's ``Leaky(reset_delay=False)`` departs from eq. (1)-(2) (below)."""


@torch.no_grad()
def run_snntorch(net: torch.nn.Module, x_seq: torch.Tensor) -> SnnTorchRun:
    """Run an imported snnTorch network on ``x_seq`` ``[T, N, C, H, W]``.

    snnTorch runs one time step per call. Its ``Flatten`` import keeps torch's ``start_dim``
    where NIR's excludes the batch (``start_dim=0`` flattens the batch too), so samples are
    run one at a time (batch 1), every ``Leaky`` starting from 0.

    ``late_reset``: snnTorch 1.0's ``Leaky(reset_mechanism="subtract", reset_delay=False)``
    computes its next-step reset term from the membrane *after* the reset: when that is still
    >= threshold (a current above ~2 thresholds), the next step subtracts the threshold once
    more and suppresses that step's spike (snntorch issue #364, refactor PR #426, both open).
    eq. (1)-(2) do not, so a sample where this happened can differ from szo's forward.
    """
    import snntorch as snn

    leaks = [m for m in net.modules() if isinstance(m, snn.Leaky)]
    flag = {"hit": False}

    def hook(m, _inp, _out):
        if bool(torch.as_tensor(m.reset).any()):
            flag["hit"] = True

    handles = [m.register_forward_hook(hook) for m in leaks]
    out, late = [], []
    try:
        for i in range(x_seq.shape[1]):
            for m in leaks:
                m.mem = torch.zeros(0)
            flag["hit"] = False
            steps = []
            for t in range(x_seq.shape[0]):
                y = net(x_seq[t, i:i + 1])
                y = y[0] if isinstance(y, tuple) else y
                steps.append(y.reshape(1, -1))
            out.append(torch.stack(steps))
            late.append(flag["hit"])
    finally:
        for h in handles:
            h.remove()
    return SnnTorchRun(torch.cat(out, dim=1), torch.tensor(late))


def spike_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of equal entries of two spike tensors."""
    return float(np.mean((a == b).cpu().numpy()))
