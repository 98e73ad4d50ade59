"""Losses on per-time-step SNN outputs ``out [T, N, C]`` (SpikingJelly multi-step layout).

* ``tet_loss``: TET (Deng et al., 2022), the paper's supervised loss (Sec. 6: lambda=0.05, phi=1).
* ``mean_output_ce``: cross entropy of the time-averaged output (the usual SNN loss).
* ``rate_mse``: MSE between the time-averaged output (a firing rate for spiking outputs) and the
  one-hot label: the loss of SpikingJelly's Fashion-MNIST tutorial (``F.mse_loss(out_fr, one_hot)``).
* ``entropy_loss``: Tent's entropy (Wang et al., 2020) of the time-averaged output (unsupervised).
* ``accuracy``: top-1 accuracy of the time-averaged output.

Supervised losses take ``(out, y)``; ``entropy`` ignores ``y`` so every loss is ``fn(out, y)``
when obtained through ``get_loss``. Every loss takes ``reduction="mean"`` (the batch mean, a
scalar) or ``"none"`` (one loss per sample, ``[N]``: what per-sample node perturbation needs;
its mean is the ``"mean"`` value).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["tet_loss", "mean_output_ce", "mean_ce", "rate_mse", "entropy_loss", "accuracy", "get_loss", "LOSSES"]


def _check_out(out: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"expected model output of shape [T, N, C], got {shape}")


def _reduce(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_sample
    if reduction != "mean":
        raise ValueError(f"unknown reduction {reduction!r}; valid: mean, none")
    return per_sample.mean()


def tet_loss(out: torch.Tensor, y: torch.Tensor, lamb: float = 0.05, phi: float = 1.0,
             reduction: str = "mean") -> torch.Tensor:
    """TET: ``(1 - lamb) * mean_t CE(out_t, y) + lamb * MSE(out, phi)``.

    The CE part equals SpikingJelly's ``functional.temporal_efficient_training_cross_entropy``;
    the MSE term regularises every output towards the constant ``phi`` (Deng et al., 2022).
    """
    _check_out(out)
    if not 0.0 <= lamb <= 1.0:
        raise ValueError(f"TET lamb must be in [0, 1], got {lamb}")
    T, N, C = out.shape
    if reduction == "mean":  # the fused form (bit-identical to what every earlier run computed)
        ce = F.cross_entropy(out.reshape(T * N, C), y.repeat(T))  # mean over t and n
        mse = F.mse_loss(out, torch.full_like(out, phi))
        return (1.0 - lamb) * ce + lamb * mse
    ce_n = F.cross_entropy(out.reshape(T * N, C), y.repeat(T), reduction="none").view(T, N).mean(0)
    mse_n = (out - phi).pow(2).mean(dim=(0, 2))
    return _reduce((1.0 - lamb) * ce_n + lamb * mse_n, reduction)


def mean_output_ce(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of the time-averaged output ``out.mean(0)``."""
    _check_out(out)
    if reduction == "mean":
        return F.cross_entropy(out.mean(0), y)
    return _reduce(F.cross_entropy(out.mean(0), y, reduction="none"), reduction)


mean_ce = mean_output_ce  # name used in docs/architecture.md


def rate_mse(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``MSE(out.mean(0), one_hot(y))``, averaged over batch and classes (SpikingJelly's tutorial loss)."""
    _check_out(out)
    rate = out.mean(0)
    target = F.one_hot(y, rate.shape[1]).to(rate.dtype)
    if reduction == "mean":
        return F.mse_loss(rate, target)
    return _reduce((rate - target).pow(2).mean(1), reduction)


def entropy_loss(out: torch.Tensor, y: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """Mean over the batch of the softmax entropy of the time-averaged output (``y`` unused)."""
    _check_out(out)
    logp = F.log_softmax(out.mean(0), dim=1)
    return _reduce(-(logp.exp() * logp).sum(1), reduction)


@torch.no_grad()
def accuracy(out: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy (fraction in [0, 1]) of the time-averaged output."""
    _check_out(out)
    return float((out.mean(0).argmax(1) == y).float().mean())


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "tet": tet_loss,
    "ce": mean_output_ce,
    "rate-mse": rate_mse,
    "entropy": entropy_loss,
}


def get_loss(name: str, **kw: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss ``fn(out, y)`` called ``name`` (tet | ce | rate-mse | entropy); ``kw`` only for tet (lamb, phi)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {', '.join(LOSSES)}")
    if kw and name != "tet":
        raise ValueError(f"loss {name!r} takes no options, got {sorted(kw)}")
    if name == "tet":
        bad = set(kw) - {"lamb", "phi"}
        if bad:
            raise ValueError(f"unknown TET option(s) {sorted(bad)}; valid: lamb, phi")
        lamb, phi = float(kw.get("lamb", 0.05)), float(kw.get("phi", 1.0))

        def _tet(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
            return tet_loss(out, y, lamb=lamb, phi=phi, reduction=reduction)

        return _tet
    return LOSSES[name]
