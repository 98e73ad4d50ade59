"""BAFFLE math (seed 002, Feng et al., Algorithm 1): seeds, loss differences, aggregation, SecAgg+ ranges.

No Flower and no I/O here (``szo.federated.flower`` runs it over the network). One round:

1. the server draws a 32-bit round seed; every client regenerates the same ``K`` directions
   ``z_k ~ N(0, I_k)`` from it (:func:`round_directions`), so no direction crosses the network;
2. client ``c`` evaluates ``dL_k = L_c(theta + sigma u_k) - L_c(theta - sigma u_k)`` on its local
   batch (:func:`loss_differences`), ``u_k = P z_k`` in the subspace (``P`` the stored basis) or
   ``u_k = z_k`` in full space, and uploads only those ``K`` numbers (and its BN statistics)
   with its example count ``N_c`` as weight;
3. the server receives only the weighted mean ``sum_c N_c dL_k^c / sum_c N_c`` over the clients
   that answered (Flower's SecAgg+, see ``szo.federated.flower``; :func:`weighted_mean` is what it
   computes, exactly, without secure aggregation), the loss difference on the union of their data,
   and forms Stein's estimate (eq. 6) ``g = 1/K sum_k dL_k / (2 sigma) z_k``
   (:func:`stein_coordinates`, the central-difference RGE of ``szo.functional.zo``).

SecAgg+ sums integers modulo ``2**32``: every value is clipped to ``[-C, C]``, scaled by the
client's weight ``N_c / N`` and stochastically rounded onto ``Q`` levels (:func:`secagg_ranges`
picks ``Q`` so that the clients' sum cannot wrap); :func:`secagg_error_bound` is how far the
secure aggregate can then be from :func:`weighted_mean`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from szo.evaluators import build_evaluator
from szo.functional.zo import rge_coefficients, sample_gaussian
from szo.zo import HostSpace, ProbePath, rge_plan

__all__ = ["dirichlet_split", "round_directions", "RoundSeeds", "loss_differences", "stein_coordinates",
           "weighted_mean", "check_value", "MODULUS_RANGE", "secagg_ranges", "secagg_error_bound"]

def dirichlet_split(labels: Sequence[int] | np.ndarray, n_clients: int, alpha: float, seed: int,
                    min_size: int = 1) -> list[np.ndarray]:
    """Non-IID label-skew split (Hsu et al. 2019): each class's samples are divided among the
    clients in proportions drawn from ``Dirichlet(alpha)``; smaller ``alpha`` = more skew.
    Redraws (same seeded stream) until every client holds ``min_size`` samples. Returns sorted
    index arrays, one per client, that partition ``range(len(labels))``."""
    labels = np.asarray(labels)
    if isinstance(n_clients, bool) or not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"the number of clients must be an int >= 1, got {n_clients!r}")
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0 (e.g. 0.5 skewed, 100 ~ IID), got {alpha}")
    if n_clients * min_size > len(labels):
        raise ValueError(f"{len(labels)} samples cannot give {n_clients} clients {min_size} each")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for cls in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet([alpha] * n_clients)) * len(idx)).astype(int)[:-1]
            for c, chunk in enumerate(np.split(idx, cuts)):
                parts[c].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"no Dirichlet(alpha={alpha}) split gave every one of {n_clients} clients {min_size} "
                     "samples in 1000 draws; raise alpha or lower the number of clients")


class RoundSeeds:
    """The server's round seeds, ``seeds[r]`` for round ``r`` (1-based; ``seeds[0]`` is drawn and
    unused): the draws of ``numpy.random.default_rng(seed).integers(1, 2**31 - 1)`` in order,
    made as the rounds are reached. The same numbers as drawing ``rounds + 1`` of them at once
    (numpy's generator draws them one after another either way), without a table sized by the
    rounds planned (``--rounds 1000000000`` would be 7.45 GiB before round 1)."""

    CHUNK = 1024

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(int(seed))
        self._chunks: list[np.ndarray] = []

    def __getitem__(self, rnd: int) -> int:
        if isinstance(rnd, bool) or not isinstance(rnd, (int, np.integer)) or rnd < 0:
            raise ValueError(f"a round number is an int >= 0, got {rnd!r}")
        i, j = divmod(int(rnd), self.CHUNK)
        while len(self._chunks) <= i:  # up to the round asked for, a chunk at a time
            self._chunks.append(self._rng.integers(1, 2 ** 31 - 1, size=self.CHUNK))
        return int(self._chunks[i][j])


def round_directions(seed: int, K: int, k: int) -> torch.Tensor:
    """The round's ``K`` Gaussian directions ``[K, k]`` (float64), regenerated from the round seed."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"K (directions per round) must be an int >= 1, got {K!r}")
    return sample_gaussian(K, k, torch.Generator().manual_seed(int(seed)), dtype=torch.float64)


@torch.no_grad()
def loss_differences(model: nn.Module, closure: Callable[[], torch.Tensor], point: torch.Tensor, z: torch.Tensor,
                     sigma: float, *, to_params: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     basis: torch.Tensor | None = None) -> torch.Tensor:
    """A client's ``dL_k = L(theta + sigma u_k) - L(theta - sigma u_k)``, float64 ``[K]``.

    ``theta = to_params(point)`` (default: ``point`` itself) in float64, ``u_k = basis @ z_k`` (or
    ``z_k``); every probe loads ``theta +- sigma u_k`` into ``model``'s parameters (rounded once to
    their dtype) and calls ``closure()`` (forward on the client's batch, mean loss). Composed from
    the forward-only core: a parameter-side :class:`~szo.zo.HostSpace`, a two-sided RGE plan along
    ``z`` (``+k``, ``-k`` for each direction in turn) and the loop evaluator. BN running statistics
    are not frozen between the probes: a client resets them and sets ``momentum=None`` first, so
    they end as the average over the round's probes (what it reports). The parameters are back at
    ``theta`` afterwards.
    """
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    space = HostSpace(model, to_params if to_params is not None else (lambda c: c), point.to(torch.float64),
                      probe="params", basis=None if basis is None else basis.to(torch.float64))
    plan = rge_plan(z, sigma, interleaved=True)
    evaluator = build_evaluator(ProbePath(freeze_bn=False), model, "BAFFLE client")
    with evaluator.session():
        losses = evaluator.run(closure, space, plan, label="direction")
    lp, lm = plan.pairs(losses)
    return lp - lm


def stein_coordinates(delta: torch.Tensor, z: torch.Tensor, sigma: float) -> torch.Tensor:
    """Eq. 6 with ``delta_k = sigma z_k``: ``1/K sum_k dL_k / (2 sigma) z_k`` (coordinates of the
    directions; times ``P`` for the parameter-space gradient in the subspace)."""
    return rge_coefficients(delta.to(torch.float64), torch.zeros_like(delta, dtype=torch.float64), z, sigma)


def weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum_c w_c v_c / sum_c w_c`` in float64: the clients' aggregate without secure aggregation
    (``w_c = N_c``: the loss differences of the union of their data)."""
    if not len(vectors):
        raise ValueError("no client uploads to aggregate (zero clients)")
    if len(weights) != len(vectors):
        raise ValueError(f"{len(vectors)} uploads but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(w > 0):
        raise ValueError(f"client weights must be > 0, got {w.tolist()}")
    vs = [np.asarray(v, dtype=np.float64) for v in vectors]
    if any(v.shape != vs[0].shape for v in vs):
        raise ValueError(f"uploads of different shapes: {sorted({v.shape for v in vs})}")
    return sum(wi * v for wi, v in zip(w, vs)) / w.sum()


def check_value(clip_range: float) -> float:
    """The value every client appends to its upload: half the SecAgg+ clip range (never clipped).
    The weighted mean of the answering clients' check values is this value again (within
    :func:`secagg_error_bound` under SecAgg+); an aggregate whose last value is off holds an upload
    that was corrupted, forged or replayed (masks that do not cancel leave noise on the field)."""
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    return clip_range / 2


MODULUS_RANGE: int = 1 << 32
"""SecAgg+'s field: masked sums are taken modulo 2**32 (Flower's default and maximum)."""


def secagg_ranges(n_clients: int) -> tuple[int, int]:
    """``(quantization_range Q, modulus_range M)`` for SecAgg+ with up to ``n_clients`` clients:
    ``M = 2**32`` and the largest power of two ``Q`` with ``n_clients * Q < M``, so that the sum of
    the clients' quantized values (each in ``[0, Q]``) never wraps around the field."""
    if isinstance(n_clients, bool) or not isinstance(n_clients, int) or n_clients < 2:
        raise ValueError(f"secure aggregation needs an int >= 2 clients, got {n_clients!r}")
    q = MODULUS_RANGE >> (n_clients).bit_length()  # n_clients < 2**bit_length, so n * Q < M
    if q < 2:
        raise ValueError(f"{n_clients} clients leave no quantization levels in a 2**32 field")
    return q, MODULUS_RANGE


def secagg_error_bound(n_clients: int, clip: float, quantization_range: int, weight_sum: float) -> float:
    """Largest ``|secure aggregate - weighted_mean|`` of a value when ``n_clients`` answered whose
    weights ``N_c / N`` sum to ``weight_sum``, every ``|value| <= clip``.

    Per client the stochastic rounding is off by less than one level ``2 clip / Q`` and the
    weight ``N_c / N`` is rounded to a multiple of ``1 / Q`` (at most ``1 / (2 Q)`` off, and a
    weight error moves the mean by at most ``2 clip`` per unit weight); both are divided by the
    summed weight: ``n (2 clip / Q + clip / Q) / weight_sum``."""
    if not weight_sum > 0:
        raise ValueError(f"the answering clients' weights must sum to > 0, got {weight_sum}")
    return n_clients * 3.0 * clip / quantization_range / weight_sum
