"""The units a subspace method's mu and lr are expressed in (``szo.scale``).

A subspace method moves ``theta = theta_0 + P c``. Under ``scale="absolute"`` (the paper's
procedure, App. G) a coordinate of ``c`` is one unit of parameter-space length, so ``mu`` is a
probe length and ``lr`` a step per unit gradient in parameter space, whatever the network and
trajectory: values tuned on one model do not carry over to another.

Under a relative scale the optimizer works in coordinates ``u`` with ``c = S u``,
``S = diag(s)``, where the ``s_i`` are lengths the subspace itself defines (from the trajectory
covariance eigenvalues the store keeps). Probe ``i`` of CGE moves ``mu * s_i`` along direction
``i``; an RGE / one-point probe moves ``mu * P S z``; the update is eq. (6) on ``u``, i.e.
``c_{t+1} - c_t = S delta_u`` with ``delta_u = momentum delta_u - lr S g_c`` (``g_c = P^T grad``):
in parameter space a step of ``lr * s_i**2`` per unit gradient along direction ``i``. The
estimators, BP-Subspace's projected gradient and the batched / distributed evaluators need no
change: they all see the basis ``P S`` (``SubspaceSpace(..., scales=s)``).

Both relative rules are *normalised*: the estimate in ``u`` is divided by its RMS length over the
first steps (:func:`normalise_`; the loss's own scale is not the subspace's), so ``lr`` is the length
of the first step in units of ``s``, and a random-direction estimate is multiplied once more by its
signal fraction ``sqrt(q / (k + q + 1))`` (``SZO.signal_fraction``). ``trajectory``: one unit for
every direction, the trajectory's spread ``sqrt(sum lambda_i)``: the paper's estimator and update up
to a change of units. ``whitened``: each direction's own spread ``sqrt(lambda_i)``: a diagonal
preconditioner as well. Measured in docs/evidence.md ("Scale-free mu and lr").

:func:`coordinate_scales` is the one place the rule lives.
"""
from __future__ import annotations

import torch

from szo.vocab import SCALES

__all__ = ["SCALES", "NORMALISED", "coordinate_scales", "scale_record", "normalise_"]

#: the rules whose lr is a step length: the estimate (in the scaled coordinates) is divided by its RMS
#: length over the first steps, so lr is the length of the first step in units of the coordinates
NORMALISED: tuple[str, ...] = ("trajectory", "whitened")


def coordinate_scales(eigenvalues: torch.Tensor, scale: str) -> torch.Tensor | None:
    """The unit ``s [k]`` (float64) of each subspace coordinate under ``scale``, or None for
    ``"absolute"`` (the identity: the optimizer then runs its unscaled arithmetic bit for bit).

    ``eigenvalues``: the subspace's ``[k]`` covariance eigenvalues (``Subspace.eigenvalues``: the
    trajectory's variance along each direction)."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    if scale == "absolute":
        return None
    lam = torch.as_tensor(eigenvalues, dtype=torch.float64).detach().cpu().reshape(-1)
    if lam.numel() < 1 or not bool(torch.isfinite(lam).all()) or not bool((lam > 0).all()):
        raise ValueError(f"scale {scale!r} needs the subspace's eigenvalues (finite, > 0, one per direction); "
                         f"got {lam.tolist()[:8]}: use scale 'absolute' for a subspace without them")
    if scale == "trajectory":  # one unit for every direction: the trajectory's spread sqrt(sum lambda)
        return lam.sum().sqrt().expand(lam.numel()).clone()
    return lam.sqrt()  # whitened: each direction's own spread


def normalise_(calibration: dict, g: torch.Tensor, steps: int) -> torch.Tensor:
    """``g`` divided by the RMS length of the estimates of the first ``steps`` nonzero steps
    (``calibration``: ``{"n": steps seen, "sq": their mean squared length}``, updated in place);
    zeros while no nonzero estimate has been seen."""
    n = int(calibration["n"])
    if n < steps:  # still calibrating: the first steps' lengths (afterwards the unit is fixed)
        sq = float(g.pow(2).sum())
        if sq > 0:
            calibration["sq"] = (float(calibration["sq"]) * n + sq) / (n + 1)
            calibration["n"] = n + 1
    if float(calibration["sq"]) <= 0:
        return torch.zeros_like(g)
    return g / float(calibration["sq"]) ** 0.5


def scale_record(scale: str, scales: torch.Tensor | None, calibration: dict | None = None) -> dict:
    """What a run records about its units (results.json ``scale``): the rule, each direction's unit
    and, for a normalised rule, the gradient length its lr is divided by."""
    out: dict = {"rule": scale}
    if scales is not None:
        out["units"] = [float(v) for v in scales]
    if calibration is not None:
        out["gradient_unit"] = float(calibration["sq"]) ** 0.5
        out["calibration_steps"] = int(calibration["n"])
    return out
