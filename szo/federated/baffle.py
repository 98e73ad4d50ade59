"""BAFFLE math (seed 002, Feng et al., Algorithm 1): seeds, loss differences, zero-sum masks, aggregation.

No Flower and no I/O here (``szo.federated.flower`` runs it over the network). One round:

1. the server draws a 32-bit round seed; every client regenerates the same ``K`` directions
   ``z_k ~ N(0, I_k)`` from it (:func:`round_directions`), so no direction crosses the network;
2. client ``c`` evaluates ``dL_k = L_c(theta + sigma u_k) - L_c(theta - sigma u_k)`` on its local
   batch (:func:`loss_differences`), ``u_k = P z_k`` in the subspace (``P`` the stored basis) or
   ``u_k = z_k`` in full space, and uploads only ``K`` numbers: ``(N_c / N) dL_k`` in fixed point
   plus its secure-aggregation mask (:func:`encode`, :func:`pairwise_masks`);
3. the server adds the uploads modulo 2**64 (the masks cancel exactly: they are zero-sum
   integers), decodes ``dL_k = sum_c (N_c / N) dL_k^c``, the loss difference on the union of the
   clients' data, and forms Stein's estimate (eq. 6) ``g = 1/K sum_k dL_k / (2 sigma) z_k``
   (:func:`stein_coordinates`, the central-difference RGE of ``szo.functional.zo``).

Secure aggregation (Bonawitz et al. 2017, as BAFFLE adapts it): each pair of clients ``i < j``
shares a seed, expands it to ``K`` uniform 64-bit integers ``r_ij``; client ``i`` adds
``sum_{j > i} r_ij - sum_{j < i} r_ji`` (mod 2**64). Every ``r_ij`` appears once with each sign,
so the masks sum to exactly 0 mod 2**64 and each single upload is uniformly random to the server.
The pair seed of clients ``i`` and ``j`` comes from Diffie-Hellman key agreement
(:class:`MaskKeys`: X25519, HKDF-SHA256), as in Bonawitz et al.: each client draws its key pair in
its own process and only public keys travel (relayed by the server), so a pair's seed is known to
those two clients only -- not to the server, not to a third client. Dropped clients (secret-shared
seeds, Shamir) are not handled: every client must answer every round.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from torch import nn

from szo.functional.zo import rge_coefficients, sample_gaussian
from szo.zo import HostSpace, LoopEvaluator, ProbeGuard, rge_plan

__all__ = ["FRAC_BITS", "dirichlet_split", "round_directions", "loss_differences", "stein_coordinates",
           "encode", "decode", "pairwise_masks", "aggregate", "PUBLIC_KEY_BYTES", "MaskKeys", "agree_all"]

FRAC_BITS: int = 32
"""Fixed-point fractional bits of an upload: resolution 2**-32 ~ 2.3e-10 of a weighted loss difference."""
_MOD = 1 << 64


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
    evaluator = LoopEvaluator(ProbeGuard(model, "BAFFLE client", freeze_bn=False))
    with evaluator.session():
        losses = evaluator.run(closure, space, plan, label="direction")
    lp, lm = plan.pairs(losses)
    return lp - lm


def stein_coordinates(delta: torch.Tensor, z: torch.Tensor, sigma: float) -> torch.Tensor:
    """Eq. 6 with ``delta_k = sigma z_k``: ``1/K sum_k dL_k / (2 sigma) z_k`` (coordinates of the
    directions; times ``P`` for the parameter-space gradient in the subspace)."""
    return rge_coefficients(delta.to(torch.float64), torch.zeros_like(delta, dtype=torch.float64), z, sigma)


def encode(values: np.ndarray | torch.Tensor, frac_bits: int = FRAC_BITS) -> np.ndarray:
    """Reals -> two's-complement fixed point mod 2**64 (``uint64``), ``round(v * 2**frac_bits)``."""
    v = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("cannot encode non-finite values")
    q = np.round(v * 2.0 ** frac_bits)
    if np.any(np.abs(q) >= 2.0 ** 62):
        raise ValueError(f"values too large for 64-bit fixed point with {frac_bits} fractional bits")
    return q.astype(np.int64).view(np.uint64)


def decode(words: np.ndarray, frac_bits: int = FRAC_BITS) -> np.ndarray:
    """``uint64`` words (a sum mod 2**64) -> float64 reals (signed two's complement)."""
    return np.asarray(words, dtype=np.uint64).view(np.int64).astype(np.float64) / 2.0 ** frac_bits


def _pair_words(secret: bytes, rnd: int, i: int, j: int, K: int) -> np.ndarray:
    digest = hashlib.sha256(b"baffle-mask|%s|%d|%d|%d" % (secret, rnd, i, j)).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).integers(0, _MOD, size=K, dtype=np.uint64,
                                                                          endpoint=False)


def pairwise_masks(client: int, clients: Sequence[int], rnd: int, K: int, pair_secrets: Mapping[int, bytes]
                   ) -> np.ndarray:
    """Client ``client``'s mask ``sum_{j > i} r_ij - sum_{j < i} r_ji`` (mod 2**64, ``uint64 [K]``),
    ``r_ij`` expanded from the pair secret ``pair_secrets[j]`` it shares with client ``j``
    (:attr:`MaskKeys.pair`) and the round.

    Over all ``clients`` the masks sum to exactly 0 mod 2**64 (uint64 arithmetic wraps)."""
    if client not in clients:
        raise ValueError(f"client {client} is not one of the round's clients {list(clients)}")
    missing = [j for j in clients if j != client and j not in pair_secrets]
    if missing:
        raise ValueError(f"client {client} has no pair secret with client(s) {missing}: run the key agreement "
                         "(MaskKeys.agree) with every client's public key first")
    mask = np.zeros(K, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in clients:
            if j > client:
                mask += _pair_words(pair_secrets[j], rnd, client, j, K)
            elif j < client:
                mask -= _pair_words(pair_secrets[j], rnd, j, client, K)
    return mask


PUBLIC_KEY_BYTES = 32
"""An X25519 public key, raw."""


class MaskKeys:
    """One client's side of the masking-key agreement (Bonawitz et al. 2017, the pairwise masks).

    The client draws an X25519 key pair in its own process; only the 32-byte :attr:`public` key
    leaves it, relayed by the server to the other clients. The pair secret of clients ``i`` and
    ``j`` is HKDF-SHA256 of X25519(sk_i, pk_j) = X25519(sk_j, pk_i), bound to the pair: the two
    of them know it, nobody else does -- the server included. As in Bonawitz et al.'s
    honest-but-curious model the server is trusted to relay the public keys unchanged (one that
    substitutes keys can unmask; signed keys from a PKI would prevent that)."""

    def __init__(self, client: int):
        self.client = int(client)
        self._sk = X25519PrivateKey.generate()
        self.public: bytes = self._sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.pair: dict[int, bytes] = {}

    def agree(self, publics: Mapping[int, bytes]) -> dict[int, bytes]:
        """Derive the pair secret with every other client from ``{client id: public key}`` (its
        own entry, if present, must be its own key); returns and keeps :attr:`pair`."""
        pair = {}
        for j, pk in publics.items():
            j = int(j)
            if not isinstance(pk, (bytes, bytearray)) or len(pk) != PUBLIC_KEY_BYTES:
                got = f"{len(pk)} bytes" if isinstance(pk, (bytes, bytearray)) else type(pk).__name__
                raise ValueError(f"client {j}'s public key must be {PUBLIC_KEY_BYTES} raw bytes (X25519), got {got}")
            if j == self.client:
                if bytes(pk) != self.public:
                    raise ValueError(f"the key relayed as client {j}'s is not this client's own public key")
                continue
            shared = self._sk.exchange(X25519PublicKey.from_public_bytes(bytes(pk)))
            lo, hi = sorted((self.client, j))
            pair[j] = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                           info=b"szo-baffle-mask|%d|%d" % (lo, hi)).derive(shared)
        self.pair = pair
        return pair


def agree_all(clients: Sequence[int]) -> list[MaskKeys]:
    """Key agreement among ``clients`` in one process (tests, simulations): every client's keys,
    each with its pair secrets."""
    keys = [MaskKeys(c) for c in clients]
    publics = {k.client: k.public for k in keys}
    for k in keys:
        k.agree(publics)
    return keys


def aggregate(uploads: Sequence[np.ndarray], frac_bits: int = FRAC_BITS) -> np.ndarray:
    """Sum the (masked, encoded) uploads mod 2**64 and decode: ``sum_c (N_c / N) dL^c`` as float64."""
    if not uploads:
        raise ValueError("no client uploads to aggregate (zero clients)")
    total = np.zeros_like(np.asarray(uploads[0], dtype=np.uint64))
    with np.errstate(over="ignore"):
        for u in uploads:
            u = np.asarray(u, dtype=np.uint64)
            if u.shape != total.shape:
                raise ValueError(f"upload of shape {u.shape} does not match {total.shape}")
            total += u
    return decode(total, frac_bits)
