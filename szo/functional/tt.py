"""Tensor-train (TT-matrix) format of a weight matrix (pure functions, no state, no I/O).

Seed 000 Sec. 3.1 (Oseledets 2011): ``W [M, N]`` with ``M = prod m_k``, ``N = prod n_k`` is
folded into a 2L-way tensor and written as L cores ``G_k [r_{k-1}, m_k, n_k, r_k]``,
``r_0 = r_L = 1``::

    W[(i_1..i_L), (j_1..j_L)] = G_1[:, i_1, j_1, :] G_2[:, i_2, j_2, :] ... G_L[:, i_L, j_L, :]

with ``sum_k r_{k-1} m_k n_k r_k`` numbers instead of ``M N``. The decomposition (TT-SVD) is
tensorly's ``tensor_train_matrix``; the contraction back to ``W`` is plain torch (it runs in
every forward of a TT layer, so it must be differentiable and on the weights' device).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["factorize", "tt_ranks", "tt_num_params", "tt_svd_matrix", "tt_to_matrix", "max_tt_ranks"]


def factorize(n: int, parts: int) -> tuple[int, ...]:
    """``n`` as a product of ``parts`` factors, as balanced as possible, largest first (e.g. 256, 2 -> (16, 16))."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an integer >= 1, got {parts!r}")
    primes, m, p = [], n, 2
    while p * p <= m:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    if m > 1:
        primes.append(m)
    out = [1] * parts
    for f in sorted(primes, reverse=True):  # largest prime into the smallest bucket
        out[out.index(min(out))] *= f
    return tuple(sorted(out, reverse=True))


def max_tt_ranks(m_shape: Sequence[int], n_shape: Sequence[int]) -> tuple[int, ...]:
    """The largest useful TT rank at each bond: ``min(prod_{i<=k} m_i n_i, prod_{i>k} m_i n_i)``."""
    sizes = [a * b for a, b in zip(m_shape, n_shape)]
    out = [1]
    for k in range(1, len(sizes)):
        left = right = 1
        for s in sizes[:k]:
            left *= s
        for s in sizes[k:]:
            right *= s
        out.append(min(left, right))
    return tuple(out + [1])


def tt_ranks(rank: int | Sequence[int], m_shape: Sequence[int], n_shape: Sequence[int],
             where: str = "layer") -> tuple[int, ...]:
    """Full rank vector ``(1, r_1, ..., r_{L-1}, 1)`` from an int or a list, checked against the layer."""
    L = len(m_shape)
    if len(n_shape) != L or L < 1:
        raise ValueError(f"m_shape and n_shape must have the same length >= 1, got {tuple(m_shape)}, {tuple(n_shape)}")
    if isinstance(rank, bool):
        raise ValueError(f"TT rank must be an integer or a list of integers, got {rank!r}")
    ranks = (1,) + (int(rank),) * (L - 1) + (1,) if isinstance(rank, int) else tuple(rank)
    if len(ranks) == L - 1:
        ranks = (1,) + ranks + (1,)
    if len(ranks) != L + 1 or ranks[0] != 1 or ranks[-1] != 1 or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"TT ranks for {L} cores must be an int or (1, r_1, ..., r_{L - 1}, 1) with integers "
                         f">= 1, got {rank!r}")
    top = max_tt_ranks(m_shape, n_shape)
    bad = [k for k in range(L + 1) if ranks[k] > top[k]]
    if bad:
        raise ValueError(f"TT ranks {list(ranks)} are larger than {where} allows: with cores "
                         f"{list(zip(m_shape, n_shape))} the largest ranks are {list(top)}; use ranks <= those")
    return ranks


def tt_num_params(m_shape: Sequence[int], n_shape: Sequence[int], ranks: Sequence[int]) -> int:
    """``sum_k r_{k-1} m_k n_k r_k``: the numbers a TT layer stores instead of ``M N``."""
    return sum(ranks[k] * m_shape[k] * n_shape[k] * ranks[k + 1] for k in range(len(m_shape)))


def tt_svd_matrix(W: torch.Tensor, m_shape: Sequence[int], n_shape: Sequence[int],
                  ranks: Sequence[int]) -> list[torch.Tensor]:
    """TT-SVD (tensorly ``tensor_train_matrix``) of ``W [M, N]``: cores ``[r_{k-1}, m_k, n_k, r_k]``.

    Exact when ``W`` has TT ranks <= ``ranks``; otherwise the quasi-optimal truncation.
    """
    import tensorly as tl
    from tensorly.decomposition import tensor_train_matrix

    m_shape, n_shape = tuple(m_shape), tuple(n_shape)
    if W.dim() != 2:
        raise ValueError(f"W must be a matrix [M, N], got shape {tuple(W.shape)}")
    M, N = W.shape
    pm = pn = 1
    for a in m_shape:
        pm *= a
    for b in n_shape:
        pn *= b
    if (pm, pn) != (M, N):
        raise ValueError(f"m_shape {m_shape} x n_shape {n_shape} does not factor W of shape {(M, N)}")
    ranks = tt_ranks(list(ranks), m_shape, n_shape)
    arr = W.detach().to("cpu", torch.float64).numpy().reshape(m_shape + n_shape)
    with tl.backend_context("numpy"):
        cores = tensor_train_matrix(arr, list(ranks)).factors
    return [torch.as_tensor(c.copy()).to(device=W.device, dtype=W.dtype) for c in cores]  # numpy on the CPU, cores with W


def tt_to_matrix(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract TT-matrix cores back to ``W [prod m_k, prod n_k]`` (differentiable torch)."""
    if not cores:
        raise ValueError("need at least one TT core")
    full = cores[0]  # [1, m_1, n_1, r_1] -> running [M_k, N_k, r_k]
    if full.dim() != 4 or full.shape[0] != 1:
        raise ValueError(f"TT cores must be [r_prev, m, n, r] with r_0 = 1, got {tuple(full.shape)}")
    full = full[0]
    for core in cores[1:]:
        Mk, Nk, _ = full.shape
        _, m, n, r = core.shape
        full = torch.einsum("abr,rmns->ambns", full, core).reshape(Mk * m, Nk * n, r)
    if full.shape[-1] != 1:
        raise ValueError(f"the last TT core must end in rank 1, got {full.shape[-1]}")
    return full[..., 0]
