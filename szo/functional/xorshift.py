"""XORShift32 (Marsaglia 2003, shifts 13/17/5) and Rademacher +/-1 draws regenerated from a seed.

Seed-004 (Zhao et al. 2025, App. F): ``state ^= state << 13; state ^= state >> 17;
state ^= state << 5`` on a 32-bit unsigned state; a draw maps the new state's least
significant bit to -1 (LSB 1) or +1 (LSB 0). Perturbations are never stored: the same seed
regenerates the same sequence, so on chip only the 32-bit seed is kept.
"""
from __future__ import annotations

import math

import torch

__all__ = ["MASK32", "XorShift32", "rademacher"]

MASK32: int = 0xFFFFFFFF
SHIFT_A, SHIFT_B, SHIFT_C = 13, 17, 5


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise ValueError(f"XORShift32 seed must be an int in [1, 2**32 - 1], got {seed!r}")
    if seed == 0:
        raise ValueError("XORShift32 seed must be nonzero (state 0 is a fixed point: every draw would be 0); "
                         "valid: an int in [1, 2**32 - 1]")
    return seed


class XorShift32:
    """A 32-bit XORShift generator; ``next()`` returns the new state (an int in [1, 2**32 - 1])."""

    def __init__(self, seed: int) -> None:
        self.state = check_seed(seed)

    def next(self) -> int:
        s = self.state
        s ^= (s << SHIFT_A) & MASK32  # all arithmetic mod 2**32
        s ^= s >> SHIFT_B
        s ^= (s << SHIFT_C) & MASK32
        self.state = s
        return s

    def draws(self, n: int) -> torch.Tensor:
        """The next ``n`` states as an int64 tensor: ``n`` serial steps, computed in lanes.

        XORShift32 is linear over GF(2): ``state_{i+B} = M^B state_i``. From 256 draws on the
        stream is cut into ``~sqrt(n)`` lanes of ``B`` states; each lane's start is one jump
        ``M^B`` (32 XORs, the matrix as the images of the 32 unit states) from the previous one,
        then all lanes step ``B`` times together. The values are the serial recurrence's (a chip
        generates them one by one); node perturbation draws one per node, sample and time step
        (10^5 and more per probe), where the Python loop would dominate the step.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n < 256:
            return torch.tensor([self.next() for _ in range(n)], dtype=torch.int64)
        lanes = math.isqrt(n)
        B = -(-n // lanes)  # lanes * B >= n
        jump = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
        for _ in range(B):  # M^B applied to the 32 unit states: the jump matrix's columns
            jump = _step(jump)
        cols = jump.tolist()
        starts = [self.state]
        for _ in range(lanes - 1):
            s, t = starts[-1], 0
            for b in range(32):
                if s >> b & 1:
                    t ^= cols[b]
            starts.append(t)
        lane = torch.tensor(starts, dtype=torch.int64)
        out = torch.empty(B, lanes, dtype=torch.int64)
        for i in range(B):
            lane = _step(lane)
            out[i] = lane
        seq = out.t().reshape(-1)[:n]  # lane-major: lane j holds states j*B+1 .. (j+1)*B
        self.state = int(seq[-1])
        return seq

    def rademacher(self, n: int) -> torch.Tensor:
        """``n`` values in {-1, +1} (int64): LSB 1 -> -1, LSB 0 -> +1."""
        return 1 - 2 * (self.draws(n) & 1)


def _step(s: torch.Tensor) -> torch.Tensor:
    """One XORShift32 step of every element of an int64 tensor of 32-bit states."""
    s = s ^ ((s << SHIFT_A) & MASK32)
    s = s ^ (s >> SHIFT_B)
    return s ^ ((s << SHIFT_C) & MASK32)


def rademacher(seed: int, n: int) -> torch.Tensor:
    """The ``n`` Rademacher values regenerated from ``seed`` (same seed, same values)."""
    return XorShift32(seed).rademacher(n)
