"""Statistics of zeroth-order gradient estimates against a reference gradient (pure math).

Paper Fig. 1 / 9-11 and Prop. 1 compare ZO estimates with the true (for an SNN: the BPTT
surrogate) gradient ``g``. Given ``R`` independent estimates ``g_hat_r`` (rows of ``[R, d]``)
:func:`estimate_statistics` returns

* ``variance``: the trace of their covariance, ``E |g_hat - E g_hat|^2`` (unbiased, R - 1),
* ``cosine`` / ``cosine_std``: mean and std over draws of ``cos(g_hat_r, g)``,
* ``cosine_of_mean``: ``cos(mean_r g_hat_r, g)``,
* ``relative_error``: ``mean_r |g_hat_r - g|^2 / |g|^2``,
* with ``directions`` P (orthonormal columns): ``projected_fraction`` ``|P^T g|^2 / |g|^2`` (how
  much of the gradient the subspace can see) and ``cosine_projected``, the mean cosine to
  ``P P^T g``, the target a subspace estimator is unbiased for as mu -> 0.

:func:`rge_variance_closed_form` is the mu -> 0 variance of Gaussian RGE along orthonormal
directions, ``(k + 1) |P^T g|^2 / q`` (for ``z ~ N(0, I_k)``, ``Cov(z z^T a) = |a|^2 I + a a^T``);
the full-space value is the same with ``k = d`` and ``P = I``. For a quadratic loss the central
difference is exact, so RGE estimates there have exactly this variance in expectation, and CGE
along P returns exactly ``P P^T g``; for smooth losses both hold to ``O(mu^2)``.
"""
from __future__ import annotations

from typing import Callable

import torch

from .zo import cge, rge

__all__ = ["cosine", "estimate_statistics", "rge_variance_closed_form", "draw_estimates"]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors in float64 (0.0 if either is zero)."""
    a, b = a.reshape(-1).to(torch.float64), b.reshape(-1).to(torch.float64)
    na, nb = torch.linalg.vector_norm(a), torch.linalg.vector_norm(b)
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))


def _check_grad_dirs(grad: torch.Tensor, directions: torch.Tensor | None) -> None:
    if grad.dim() != 1:
        raise ValueError(f"grad must be a 1-D [d] tensor, got shape {tuple(grad.shape)}")
    if directions is not None and (directions.dim() != 2 or directions.shape[0] != grad.numel()):
        raise ValueError(f"directions must be [d, k] with d = {grad.numel()}, got {tuple(directions.shape)}")


def rge_variance_closed_form(grad: torch.Tensor, directions: torch.Tensor | None, q: int) -> float:
    """``(k + 1) |P^T g|^2 / q``: the mu -> 0 variance (covariance trace) of Gaussian RGE with q
    probes along the orthonormal columns of ``directions`` (``None``: full space, ``k = d``)."""
    _check_grad_dirs(grad, directions)
    if isinstance(q, bool) or not isinstance(q, int) or q < 1:
        raise ValueError(f"q must be a positive int, got {q!r}")
    g = grad.to(torch.float64)
    if directions is None:
        k, a2 = g.numel(), float(g @ g)
    else:
        a = directions.to(torch.float64).t() @ g
        k, a2 = directions.shape[1], float(a @ a)
    return (k + 1) * a2 / q


def estimate_statistics(estimates: torch.Tensor, grad: torch.Tensor,
                        directions: torch.Tensor | None = None) -> dict[str, float]:
    """Variance, cosines and error of ``R`` estimates ``[R, d]`` against ``grad`` ``[d]`` (see the module doc)."""
    _check_grad_dirs(grad, directions)
    if estimates.dim() != 2 or estimates.shape[1] != grad.numel() or estimates.shape[0] < 1:
        raise ValueError(f"estimates must be [R, d] with R >= 1 and d = {grad.numel()}, got {tuple(estimates.shape)}")
    e, g = estimates.to(torch.float64), grad.to(torch.float64)
    r = e.shape[0]
    mean = e.mean(0)
    cos = torch.tensor([cosine(row, g) for row in e], dtype=torch.float64)
    g2 = float(g @ g)
    out = {
        "repeats": r,
        "variance": float(((e - mean) ** 2).sum(1).sum() / (r - 1)) if r > 1 else 0.0,
        "cosine": float(cos.mean()),
        "cosine_std": float(cos.std(unbiased=True)) if r > 1 else 0.0,
        "cosine_of_mean": cosine(mean, g),
        "relative_error": float(((e - g) ** 2).sum(1).mean() / g2) if g2 > 0 else float("nan"),
        "grad_norm": g2 ** 0.5,
    }
    if directions is not None:
        p = directions.to(torch.float64)
        a = p.t() @ g
        target = p @ a
        out["projected_fraction"] = float(a @ a) / g2 if g2 > 0 else float("nan")
        out["cosine_projected"] = float(sum(cosine(row, target) for row in e) / r)
    return out


def _cge_draws(loss_fn, theta, directions, mu, q, repeats, generator) -> torch.Tensor:
    """CGE is deterministic: one draw, whatever ``repeats`` says (``q`` and ``generator`` unused)."""
    dirs = torch.eye(theta.numel(), dtype=theta.dtype) if directions is None else directions
    return cge(loss_fn, theta, dirs, mu)[None, :]


def _rge_draws(loss_fn, theta, directions, mu, q, repeats, generator) -> torch.Tensor:
    return torch.stack([rge(loss_fn, theta, directions, mu, q, generator) for _ in range(repeats)])


DRAWS = {"cge": _cge_draws, "rge": _rge_draws}
"""The estimators :func:`draw_estimates` draws: name -> ``(loss_fn, theta, directions, mu, q, repeats,
generator) -> [n, d]`` estimates."""


def draw_estimates(loss_fn: Callable[[torch.Tensor], "float | torch.Tensor"], theta: torch.Tensor,
                   directions: torch.Tensor | None, mu: float, *, estimator: str, q: int = 1, repeats: int = 1,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``[repeats, d]`` estimates of ``estimator`` (``"cge"``: deterministic, drawn once;
    ``"rge"``: ``repeats`` independent draws with q probes each) along ``directions``
    (``None``: the full space, i.e. the identity, never materialised for RGE)."""
    draw = DRAWS.get(estimator) if isinstance(estimator, str) else None
    if draw is None:
        raise ValueError(f"estimator must be one of {', '.join(map(repr, DRAWS))}, got {estimator!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return draw(loss_fn, theta, directions, mu, q, repeats, generator)
