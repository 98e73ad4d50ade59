"""Tensor-train parameterisation of a model's large Linear / Conv2d weights (seed 000 Sec. 3.1).

``tt_parametrize(model, rank=4)`` replaces each large weight by TT-matrix cores through
``torch.nn.utils.parametrize``: the layer's ``weight`` becomes a property computed from the
cores in every forward (``szo.functional.tt.tt_to_matrix``), and the cores
(``<layer>.parametrizations.weight.original0 ...``) are the model's parameters in their place,
initialised by TT-SVD of the current weight. A zeroth-order optimizer over
``model.parameters()`` then works in TT-factor space, a much smaller d.

A Conv2d weight ``[out, in, kh, kw]`` is the matrix ``[out, in*kh*kw]``; a Linear weight
``[out, in]`` is itself. Both dimensions are split into ``cores`` factors
(``szo.functional.tt.factorize``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from szo.functional.tt import factorize, tt_num_params, tt_ranks, tt_svd_matrix, tt_to_matrix

__all__ = ["TTMatrix", "tt_parametrize", "tt_layers"]


class TTMatrix(nn.Module):
    """Parametrization ``cores -> weight``; ``right_inverse`` is the TT-SVD (one tensor per core)."""

    def __init__(self, shape: tuple[int, ...], m_shape: tuple[int, ...], n_shape: tuple[int, ...],
                 ranks: tuple[int, ...]):
        super().__init__()
        self.shape, self.m_shape, self.n_shape, self.ranks = tuple(shape), tuple(m_shape), tuple(n_shape), tuple(ranks)

    def forward(self, *cores: torch.Tensor) -> torch.Tensor:
        return tt_to_matrix(cores).reshape(self.shape)

    def right_inverse(self, weight: torch.Tensor):
        return tuple(tt_svd_matrix(weight.reshape(self.shape[0], -1), self.m_shape, self.n_shape, self.ranks))

    def extra_repr(self) -> str:
        return f"shape={self.shape}, m={self.m_shape}, n={self.n_shape}, ranks={self.ranks}"


def tt_layers(model: nn.Module) -> list[tuple[str, TTMatrix]]:
    """``(layer name, parametrization)`` of every TT-parameterised weight of ``model``."""
    out = []
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m, "weight"):
            for p in m.parametrizations.weight:
                if isinstance(p, TTMatrix):
                    out.append((name, p))
    return out


def tt_parametrize(model: nn.Module, rank: int | list[int] = 4, *, cores: int = 2,
                   min_params: int = 1024) -> dict[str, Any]:
    """TT-parameterise every Linear / Conv2d weight with at least ``min_params`` entries, in place.

    ``rank``: one TT rank for every inner bond, or the full list ``(1, r_1, ..., 1)``; a rank
    larger than a layer allows raises one ValueError naming the layer and its largest ranks.
    Returns a report: per layer the dense and TT parameter counts, ranks, core shapes and the
    relative Frobenius error of the TT-SVD initialisation; ``d_dense`` / ``d_tt`` (the model's
    parameter count before / after).
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an integer >= 1, got {cores!r}")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"min_params must be an integer >= 1, got {min_params!r}")
    if tt_layers(model):
        raise ValueError("the model is already TT-parameterised")
    d_dense = sum(p.numel() for p in model.parameters())
    todo = [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.numel() >= min_params]
    if not todo:
        raise ValueError(f"no Linear / Conv2d weight has >= min_params={min_params} entries; lower tt.min_params")
    owner: dict[int, str] = {}
    for name, m in todo:  # one weight tied to several layers would become independent cores per layer
        if id(m.weight) in owner:
            raise ValueError(f"layers {owner[id(m.weight)]!r} and {name!r} share one weight; TT-parameterising them "
                             "would untie it: untie the weight, or raise min_params to leave one of them dense")
        owner[id(m.weight)] = name
    plans = []
    for name, m in todo:  # validate every layer before changing any
        shape = tuple(m.weight.shape)
        M, N = shape[0], m.weight.numel() // shape[0]
        ms, ns = factorize(M, cores), factorize(N, cores)
        ranks = tt_ranks(rank, ms, ns, where=f"layer {name!r} (weight {list(shape)}, matrix {M}x{N})")
        plans.append((name, m, shape, ms, ns, ranks))
    layers = []
    for name, m, shape, ms, ns, ranks in plans:
        w = m.weight.detach().clone()
        parametrize.register_parametrization(m, "weight", TTMatrix(shape, ms, ns, ranks))
        err = float((m.weight.detach() - w).norm() / w.norm().clamp_min(1e-30))
        layers.append({"layer": name, "shape": list(shape), "m": list(ms), "n": list(ns), "ranks": list(ranks),
                       "dense_params": int(w.numel()), "tt_params": tt_num_params(ms, ns, ranks),
                       "init_rel_error": err})
    d_tt = sum(p.numel() for p in model.parameters())
    return {"layers": layers, "d_dense": d_dense, "d_tt": d_tt, "compression": d_dense / d_tt}
