"""Seed-004's analytic training-memory model (Zhao et al. 2025, Table 3) evaluated for our models.

Table 3 assumes ``L`` identical layers with ``d_w`` weights and ``d_a`` output nodes per sample,
batch ``N``, ``Q`` probes per layer:

==================  ===================  ===================
method              peak (vanilla)       peak (efficient)
==================  ===================  ===================
inference only      N (2 d_a + d_w)      --
weight perturb.     L d_w                L Q
node perturb.       N L d_a + L d_w      N L Q + d_w
back-propagation    N L d_a + L d_w      --
==================  ===================  ===================

For real models the layers differ, so :func:`training_memory` sums where the table multiplies by
``L`` (``L d_w -> sum_i d_w_i``, ``L d_a -> sum_i d_a_i``) and takes the largest layer where it
names one layer (``d_a -> max_i d_a_i``, ``d_w -> max_i d_w_i``). For an SNN in SpikingJelly's
``[T, N, ...]`` layout ``d_a`` counts a layer's nodes over all T time steps (what BPTT keeps), so
back-propagation's ``N sum d_a`` grows with T while the efficient perturbation rows do not.
Values are element counts; bytes are ``elements * bytes_per_value``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from szo.zo import trainable_layers

__all__ = ["LayerDims", "layer_dims", "training_memory", "TABLE3_ROWS"]

TABLE3_ROWS: tuple[str, ...] = ("inference", "weight_perturbation", "weight_perturbation_efficient",
                                "node_perturbation", "node_perturbation_efficient", "backprop")


@dataclass(frozen=True)
class LayerDims:
    """One trainable layer: ``d_w`` parameters, ``d_a`` output nodes per sample (times T for an SNN)."""

    name: str
    d_w: int
    d_a: int


@torch.no_grad()
def layer_dims(model: nn.Module, example: torch.Tensor, layers: Sequence[str] | None = None) -> list[LayerDims]:
    """``d_w`` and ``d_a`` of each linear / convolution layer, from one forward of ``example`` (one sample
    or a batch: ``d_a`` is per sample; SNN outputs ``[T, N, ...]`` count all T steps)."""
    found = trainable_layers(model, layers)
    shapes: dict[str, torch.Size] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: shapes.__setitem__(n, out.shape))
             for n, m in found.items()]
    was_training = model.training
    model.eval()
    try:
        model(example)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    out = []
    for n, m in found.items():
        s = shapes[n]
        batch = s[1] if len(s) > 2 else s[0]  # [T, N, ...] or [N, F]
        out.append(LayerDims(n, sum(p.numel() for p in m.parameters(recurse=False)), s.numel() // batch))
    return out


def training_memory(dims: Sequence[LayerDims], *, n: int, q: int, bytes_per_value: float = 1.0) -> dict[str, float]:
    """Seed-004 Table 3 peak memory (bytes) of each row of :data:`TABLE3_ROWS` for these layers."""
    if not dims:
        raise ValueError("need at least one layer")
    for name, v in (("n", n), ("q", q)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not bytes_per_value > 0:
        raise ValueError(f"bytes_per_value must be > 0, got {bytes_per_value}")
    L = len(dims)
    sum_w, sum_a = sum(d.d_w for d in dims), sum(d.d_a for d in dims)
    max_w, max_a = max(d.d_w for d in dims), max(d.d_a for d in dims)
    elements = {
        "inference": n * (2 * max_a + max_w),
        "weight_perturbation": sum_w,
        "weight_perturbation_efficient": L * q,
        "node_perturbation": n * sum_a + sum_w,
        "node_perturbation_efficient": n * L * q + max_w,
        "backprop": n * sum_a + sum_w,
    }
    return {k: v * bytes_per_value for k, v in elements.items()}
