"""Integer arithmetic primitives shared by the fixed-point backend (``szo.hw``) and the
forward-only core's integer space and update rules (``szo.zo``): signed ranges, counted
saturation (clamp, never wrap) and the round-toward-zero right shift. Pure functions and one
small counter; no I/O.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from spikingjelly.activation_based import lava_exchange

__all__ = ["LOSS_FRAC", "SaturationCounter", "check_int", "fixed_point_losses", "int_range", "right_shift_to_zero",
           "round_to_int", "saturate"]

# Fractional bits of a loss in fixed point (Q.24: one unit 2**-24 = 6e-8, finer than float32's ulp of a
# loss >= 1): the integer learner turns every loss into these integers before it differences them,
# so all of its later arithmetic is exact and no summation order can change an integer it decides
LOSS_FRAC: int = 24


def int_range(bits: int, signed: bool = True) -> tuple[int, int]:
    """Inclusive ``(lo, hi)`` of a ``bits``-wide integer."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 63:
        raise ValueError(f"bits must be an int in [1, 63], got {bits!r}")
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


class SaturationCounter:
    """Counts clamped elements per ``(layer, quantity)``; never silent, never wrapping.

    A count may be an int or a 0-d integer tensor: tensors stay on their device and are summed
    there, so counting a clamp on a GPU does not wait for it; :meth:`as_dict` and
    :meth:`total` read them (zero counts are left out).
    """

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, int | torch.Tensor]] = defaultdict(dict)

    def add(self, layer: str, quantity: str, n: int | torch.Tensor) -> None:
        if not isinstance(n, torch.Tensor):
            if not n:
                return
            n = int(n)
        d = self._counts[layer]
        old = d.get(quantity, 0)
        if isinstance(old, torch.Tensor) and isinstance(n, torch.Tensor) and old.device != n.device:
            n = n.to(old.device)
        d[quantity] = old + n  # a new value: never an in-place update of a caller's tensor

    def as_dict(self) -> dict[str, dict[str, int]]:
        out = {}
        for layer, d in self._counts.items():
            counts = {q: int(v) for q, v in d.items()}
            counts = {q: v for q, v in counts.items() if v}
            if counts:
                out[layer] = counts
        return out

    def total(self) -> int:
        return sum(sum(d.values()) for d in self.as_dict().values())

    def reset(self) -> None:
        self._counts.clear()


def check_int(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} needs an int32/int64 tensor, got {got}")


def saturate(x: torch.Tensor, bits: int, counter: SaturationCounter | None = None,
             layer: str = "", quantity: str = "", symmetric: bool = False) -> torch.Tensor:
    """Clamp a signed integer tensor to ``bits`` (two's complement range; ``symmetric``:
    ``+-(2**(bits-1) - 1)``, Lava's voltage limits); count clamped elements."""
    check_int(x, "saturate")
    lo, hi = int_range(bits)
    y = x.clamp(-hi if symmetric else lo, hi)  # saturate, never wrap
    if counter is not None:
        counter.add(layer, quantity, (y != x).sum())  # a device tensor: no sync here
    return y


def round_to_int(x: torch.Tensor, bound_bits: int) -> torch.Tensor:
    """Round a float tensor to nearest (ties to even) and convert it to int64, every value first
    clamped to ``+-2**bound_bits`` (``bound_bits <= 62``).

    torch converts a float beyond int64 (and NaN) to ``-2**63``: an update ``round(lr g)`` at a huge
    ``lr`` would wrap to the opposite sign. Clamped first, a value past ``2**bound_bits`` stays on
    its own side, so ``sat(theta - step)`` of a ``bits``-wide ``theta`` with ``bound_bits >= bits``
    saturates exactly as the unbounded step would. NaN has no side: a ValueError.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"round_to_int needs a float tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if isinstance(bound_bits, bool) or not isinstance(bound_bits, int) or not 1 <= bound_bits <= 62:
        raise ValueError(f"bound_bits must be an int in [1, 62], got {bound_bits!r}")
    if bool(torch.isnan(x).any()):
        raise ValueError("cannot round NaN to an integer (a non-finite estimate or learning rate)")
    bound = float(1 << bound_bits)  # exact in float64 and float32
    return torch.round(x.clamp(-bound, bound)).to(torch.int64)  # [-2**62, 2**62]: no wrap


def right_shift_to_zero(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``sign(x) * (|x| >> bits)``: arithmetic right shift rounding toward zero (-7 >> 1 = -3).

    SpikingJelly's ``lava_exchange.right_shift_to_zero`` (as Loihi), with ValueErrors instead of asserts.
    """
    check_int(x, "right_shift_to_zero")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 0:
        raise ValueError(f"shift must be a non-negative int, got {bits!r}")
    return lava_exchange.right_shift_to_zero(x, bits)


def fixed_point_losses(losses: torch.Tensor, frac: int = LOSS_FRAC) -> torch.Tensor:
    """``round(l * 2**frac)`` as int64 (to nearest, ties to even): losses as an MCU holds them.

    Scaling by a power of two is exact and rounding is correctly rounded, so the integers depend
    only on the float losses given (compute those in float64 from exact integer logits to keep
    them the same on every machine: ``FixedPointNetwork.readout_precision``)."""
    l64 = losses.detach().to(torch.float64)
    if not bool(torch.isfinite(l64).all()):
        raise ValueError("a loss is not finite; the integer learner needs finite losses")
    scaled = l64 * float(1 << frac)
    if l64.numel() and float(scaled.abs().max()) >= 2.0 ** 62:
        raise ValueError(f"a loss of magnitude {float(l64.abs().max()):.3g} does not fit in int64 with {frac} "
                         "fractional bits")
    return torch.round(scaled).to(torch.int64)
