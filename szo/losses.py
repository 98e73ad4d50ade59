"""Losses on per-time-step SNN outputs ``out [T, N, C]`` (SpikingJelly multi-step layout).

* ``tet_loss``: TET (Deng et al., 2022), the paper's supervised loss (Sec. 6: lambda=0.05, phi=1).
* ``mean_output_ce``: cross entropy of the time-averaged output (the usual SNN loss).
* ``rate_mse``: MSE between the time-averaged output (a firing rate for spiking outputs) and the
  one-hot label: the loss of SpikingJelly's Fashion-MNIST tutorial (``F.mse_loss(out_fr, one_hot)``).
* ``entropy_loss``: Tent's entropy (Wang et al., 2020) of the time-averaged output (unsupervised).
* ``accuracy``: top-1 accuracy of the time-averaged output.

Supervised losses take ``(out, y)``; ``entropy`` ignores ``y`` so every loss is ``fn(out, y)``
when obtained through ``get_loss``.
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


def tet_loss(out: torch.Tensor, y: torch.Tensor, lamb: float = 0.05, phi: float = 1.0) -> torch.Tensor:
    """TET: ``(1 - lamb) * mean_t CE(out_t, y) + lamb * MSE(out, phi)``.

    The CE part equals SpikingJelly's ``functional.temporal_efficient_training_cross_entropy``;
    the MSE term regularises every output towards the constant ``phi`` (Deng et al., 2022).
    """
    _check_out(out)
    if not 0.0 <= lamb <= 1.0:
        raise ValueError(f"TET lamb must be in [0, 1], got {lamb}")
    T, N, C = out.shape
    ce = F.cross_entropy(out.reshape(T * N, C), y.repeat(T))  # mean over t and n
    mse = F.mse_loss(out, torch.full_like(out, phi))
    return (1.0 - lamb) * ce + lamb * mse


def mean_output_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the time-averaged output ``out.mean(0)``."""
    _check_out(out)
    return F.cross_entropy(out.mean(0), y)


mean_ce = mean_output_ce  # name used in docs/architecture.md


def rate_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``MSE(out.mean(0), one_hot(y))``, averaged over batch and classes (SpikingJelly's tutorial loss)."""
    _check_out(out)
    rate = out.mean(0)
    return F.mse_loss(rate, F.one_hot(y, rate.shape[1]).to(rate.dtype))


def entropy_loss(out: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of the softmax entropy of the time-averaged output (``y`` unused)."""
    _check_out(out)
    logp = F.log_softmax(out.mean(0), dim=1)
    return -(logp.exp() * logp).sum(1).mean()


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

        def _tet(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return tet_loss(out, y, lamb=lamb, phi=phi)

        return _tet
    return LOSSES[name]
