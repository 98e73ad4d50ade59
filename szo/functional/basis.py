"""Random orthonormal bases: the one draw of a Haar-distributed k-dimensional subspace of R^d.

Used by the store's fixed random variant (``subspace_store.random_subspace``) and by the refreshed
random subspace of ``szo.optim.SZO(model, Refreshed(subspace, every=T0))``, so that both draw the same distribution the same way.
"""
from __future__ import annotations

import torch

__all__ = ["haar_basis"]


def haar_basis(d: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A ``[d, k]`` float64 basis with orthonormal columns, uniformly (Haar) distributed: the Q factor
    of a ``[d, k]`` standard Gaussian drawn from ``generator`` (float64 QR), each column signed so that
    the diagonal of R is positive (without the sign fix QR's convention would bias the distribution).

    Draws exactly ``d * k`` float64 normals from ``generator`` (so a saved generator state redraws the
    same basis)."""
    for name, v in (("d", d), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if k > d:
        raise ValueError(f"k must be <= d = {d}, got k = {k}")
    q, r = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))
    diag = torch.diagonal(r)
    return q * torch.sign(diag).where(diag != 0, torch.ones(k, dtype=torch.float64))
