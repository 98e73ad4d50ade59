"""Subspaces that are *not* the PCA of the run's own trajectory, for the "where does the
subspace's power come from" study (issue 13), and the projection of a point onto a subspace.

The trajectory-based variants need no new code: :func:`~subspace_store.build_subspace` with

* the whole trajectory (the paper),
* ``window=(0, E)``: only its first E epochs (DLDR-style),
* another seed's trajectory and ``reference=theta_0`` of this run (same model layout),

cover them. This module adds the two that do not come from a trajectory:

* :func:`random_subspace`: a seeded random orthonormal basis of the same k (SubZero-style),
* :func:`coordinate_subspace`: the unit vectors of chosen parameter tensors (e.g. every BN
  affine parameter and the classifier, :func:`bn_and_head_names`): training there is plain
  ZO on those coordinates,

and :func:`project_point`: ``theta_ref + P P^T (theta - theta_ref)``, the closest point of
the affine subspace to ``theta`` (reviewer 3: does the subspace already contain the BP
solution?).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.functional.basis import haar_basis
from szo.layout import layout_from_json

from .format import Subspace

__all__ = ["random_subspace", "coordinate_subspace", "bn_and_head_names", "project_point"]


def _check_reference(reference: Any, d: int | None = None) -> torch.Tensor:
    if not isinstance(reference, torch.Tensor) or reference.dim() != 1 or reference.numel() < 1:
        raise ValueError(f"reference must be a non-empty 1-D tensor (theta_ref), got {getattr(reference, 'shape', reference)!r}")
    if d is not None and reference.numel() != d:
        raise ValueError(f"reference has {reference.numel()} entries but the layout describes d = {d} parameters")
    return reference.detach().to("cpu", torch.float32).clone()


def _flat(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # no variance spectrum: every direction counts the same
    return torch.zeros(k, dtype=torch.float64), torch.full((k,), 1.0 / k, dtype=torch.float64)


def random_subspace(reference: torch.Tensor, k: int, seed: int, *, layout: Any = None,
                    fingerprint: str | None = None, model: str | None = None,
                    dtype: torch.dtype = torch.float32, variance: float | None = None) -> Subspace:
    """A uniformly random k-dimensional subspace through ``reference``: the Q factor of a seeded
    ``[d, k]`` Gaussian (``szo.functional.basis.haar_basis``: float64 QR, columns signed so that
    diag(R) > 0: Haar-distributed).

    ``explained_variance_ratio`` is ``1/k`` (no trajectory). ``eigenvalues`` are zeros, or with
    ``variance`` (the total variance of the trajectory subspace it is compared with, e.g.
    ``pca.eigenvalues.sum()``) that total spread evenly, ``variance / k`` per direction: a random basis
    has no spread of its own, and this gives it the PCA's units under ``szo.scale: trajectory``
    (``sqrt(sum lambda)``, the same sigma; docs/methods.md, "A refreshed random subspace").
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    ref = _check_reference(reference)
    d = ref.numel()
    if k > d:
        raise ValueError(f"k must be <= d = {d}, got k = {k}")
    if variance is not None and (isinstance(variance, bool) or not isinstance(variance, (int, float))
                                 or not math.isfinite(variance) or variance <= 0):
        raise ValueError(f"variance must be a finite number > 0 (a trajectory subspace's total variance), "
                         f"got {variance!r}")
    q = haar_basis(d, k, torch.Generator().manual_seed(seed))
    ev, evr = _flat(k)
    provenance = {"builder": "random-orthonormal", "seed": seed, "k": k, "N": None, "reference": "tensor"}
    if variance is not None:  # borrowed units: the compared trajectory's total variance, evenly
        ev = torch.full((k,), float(variance) / k, dtype=torch.float64)
        provenance["variance"] = float(variance)
    return Subspace(basis=q.to(dtype), mean=ref.clone(), reference=ref, eigenvalues=ev,
                    explained_variance_ratio=evr, layout=layout, fingerprint=fingerprint, model=model,
                    provenance=provenance)


def coordinate_subspace(layout: Any, names: Sequence[str], reference: torch.Tensor, *,
                        fingerprint: str | None = None, model: str | None = None,
                        dtype: torch.dtype = torch.float32) -> Subspace:
    """The coordinate subspace of the parameter tensors ``names``: one unit-vector column per
    scalar parameter, in layout order, so ``k`` = their total number of entries."""
    lay = layout_from_json(layout)
    if not lay:
        raise ValueError("layout must be a non-empty [(name, shape)] list (e.g. szo.layout.param_layout(model))")
    offsets, d = {}, 0
    for n, s in lay:
        size = int(torch.Size(s).numel())
        offsets[n] = (d, size)
        d += size
    names = list(names)
    unknown = [n for n in names if n not in offsets]
    if not names or unknown:
        raise ValueError(f"names must be a non-empty list of layout parameter names; unknown: {unknown}; "
                         f"valid: {list(offsets)}")
    ref = _check_reference(reference, d)
    rows = torch.cat([torch.arange(offsets[n][0], offsets[n][0] + offsets[n][1])
                      for n, _ in lay if n in set(names)])
    k = int(rows.numel())
    basis = torch.zeros(d, k, dtype=dtype)
    basis[rows, torch.arange(k)] = 1.0
    ev, evr = _flat(k)
    return Subspace(basis=basis, mean=ref.clone(), reference=ref, eigenvalues=ev,
                    explained_variance_ratio=evr, layout=lay, fingerprint=fingerprint, model=model,
                    provenance={"builder": "coordinate", "parameters": [n for n, _ in lay if n in set(names)],
                                "k": k, "N": None, "reference": "tensor"})


def bn_and_head_names(model: nn.Module) -> list[str]:
    """Names of every BatchNorm affine parameter and of the last ``nn.Linear``'s parameters."""
    names: list[str] = []
    linear = None
    for mod_name, mod in model.named_modules():
        if isinstance(mod, _BatchNorm) and mod.affine:
            names += [f"{mod_name}.{p}" for p, _ in mod.named_parameters(recurse=False)]
        if isinstance(mod, nn.Linear):
            linear = mod_name
    if linear is not None:
        names += [f"{linear}.{p}" for p, _ in model.get_submodule(linear).named_parameters(recurse=False)]
    if not names:
        raise ValueError(f"{type(model).__name__} has neither BatchNorm affine parameters nor a Linear layer")
    return names


def project_point(subspace: Subspace, theta: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``theta_ref + P P^T (theta - theta_ref)`` (P orthonormal) and its distance to ``theta``
    (``|(I - P P^T)(theta - theta_ref)|``), computed in float64."""
    if not isinstance(theta, torch.Tensor) or theta.dim() != 1 or theta.numel() != subspace.d:
        raise ValueError(f"theta must be a [{subspace.d}] tensor, got {getattr(theta, 'shape', theta)!r}")
    p = subspace.basis.to(torch.float64)
    ref = subspace.reference.to(torch.float64)
    delta = theta.detach().to("cpu", torch.float64) - ref
    inside = p @ (p.t() @ delta)
    return (ref + inside).to(torch.float32), float(torch.linalg.vector_norm(delta - inside))
