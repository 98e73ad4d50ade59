"""The fixed-point backend's integer arithmetics, chosen once by a tag (as Lava picks a process model).

``szo.hw.convert.FixedPointNetwork`` takes ``arithmetic=TAG`` (``szo.hw.fixed.ARITHMETICS``, a recipe's
``hw.arithmetic``) and looks the implementation up in :data:`ARITHMETIC_MODELS` once, at conversion; no
method compares the tag afterwards. An implementation says the three things in which the arithmetics
differ (``szo.hw.fixed``'s module docstring):

* :attr:`~IntegerArithmetic.neuron`: the integer CUBA-LIF class (``szo.hw.neuron``);
* :meth:`~IntegerArithmetic.synaptic_current`: a synapse's integer accumulator into state units;
* :meth:`~IntegerArithmetic.add_currents`: a residual sum of two currents.

``"szo"`` (:class:`SaturatingArithmetic`): every narrowing saturates and is counted, synaptic sums are
shifted exactly, the bias is added to the current. ``"loihi"`` (:class:`LavaBitAccurate`): bit-exact with
lava-nc ``PyDenseModelBitAcc`` -> ``PyLifModelBitAcc`` (floor shift by the weight exponent, the bias into
the voltage, the current wrapping in the neuron).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from szo.hw.fixed import (
    A_IN_SHIFT,
    BitWidths,
    SaturationCounter,
    check_arithmetic,
    floor_shift,
    int_range,
    saturate,
    shift,
)
from szo.hw.neuron import FixedCubaLIF, LoihiCubaLIF

__all__ = ["SynapticCurrent", "IntegerArithmetic", "SaturatingArithmetic", "LavaBitAccurate", "ARITHMETIC_MODELS",
           "arithmetic_model"]


class SynapticCurrent(NamedTuple):
    """A synapse's output in state units: ``current`` (what the next layer receives), ``synaptic`` (the sum
    without bias, recorded), ``bias`` (a bias left for the neuron to add to its voltage, or None) and
    ``lava_rounding`` (``record``: the same sum floor-shifted as Lava's Dense would, for comparison; or None)."""

    current: torch.Tensor
    synaptic: torch.Tensor
    bias: torch.Tensor | None
    lava_rounding: torch.Tensor | None


class IntegerArithmetic:
    """One integer arithmetic of the fixed-point backend (its ``tag`` is a ``hw.arithmetic`` value)."""

    tag: str = ""
    neuron: type[FixedCubaLIF] = FixedCubaLIF

    def synaptic_current(self, acc: torch.Tensor, to_state: int, bias: torch.Tensor | None, widths: BitWidths,
                         counter: SaturationCounter, path: str, record: bool) -> SynapticCurrent:
        """The integer accumulator ``acc`` (one unit = ``2**to_state`` state units) and the synapse's integer
        ``bias`` as the current the next layer receives."""
        raise NotImplementedError

    def add_currents(self, s: torch.Tensor, a_bias: torch.Tensor | None, b_bias: torch.Tensor | None,
                     widths: BitWidths, counter: SaturationCounter, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A residual sum ``s`` of two currents (with the biases each carried): ``(current, bias)``."""
        raise NotImplementedError


class SaturatingArithmetic(IntegerArithmetic):
    """``"szo"``: every narrowing saturates (counted per layer), synaptic sums shift into state units exactly
    (right shifts toward zero), the bias is added to the current."""

    tag = "szo"
    neuron = FixedCubaLIF

    def synaptic_current(self, acc, to_state, bias, widths, counter, path, record):
        syn = shift(acc, to_state)  # into state units: exact left shift, or toward-zero right shift
        cur = syn if bias is None else syn + bias
        cur = saturate(cur, widths.state_bits, counter, path, "current")  # 24-bit synaptic current
        # what Lava's Dense makes of the same sum (floor shift to a_out, << 6)
        lava = floor_shift(acc, to_state - A_IN_SHIFT) << A_IN_SHIFT if record else None
        return SynapticCurrent(cur, syn, None, lava)

    def add_currents(self, s, a_bias, b_bias, widths, counter, name):
        return saturate(s, widths.state_bits, counter, name, "current"), None


class LavaBitAccurate(IntegerArithmetic):
    """``"loihi"``: bit-exact with lava-nc ``PyDenseModelBitAcc`` -> ``PyLifModelBitAcc``: ``a_out`` is the
    accumulator shifted by the weight exponent (floor for negative ones), the LIF takes ``a_in << 6``; the
    bias enters the voltage of the neuron the current feeds; the current wraps in the neuron."""

    tag = "loihi"
    neuron = LoihiCubaLIF

    def synaptic_current(self, acc, to_state, bias, widths, counter, path, record):
        a_out = floor_shift(acc, to_state - A_IN_SHIFT)
        lo, hi = int_range(16)  # Lava declares a_out / a_in 16-bit but does not clip: count, do not change
        counter.add(path, "a_out_beyond_16bit", ((a_out < lo) | (a_out > hi)).sum())
        cur = a_out << A_IN_SHIFT  # PyLifModelBitAcc: activation_in << act_shift (exact)
        return SynapticCurrent(cur, cur, bias, None)

    def add_currents(self, s, a_bias, b_bias, widths, counter, name):
        # Lava sums the projections into one in-port without clipping; the LIF wraps
        bias = a_bias if b_bias is None else (b_bias if a_bias is None else a_bias + b_bias)
        return s, bias


ARITHMETIC_MODELS: dict[str, IntegerArithmetic] = {m.tag: m for m in (SaturatingArithmetic(), LavaBitAccurate())}
"""``hw.arithmetic`` tag -> its implementation (one per entry of ``szo.hw.fixed.ARITHMETICS``;
tests/hw/test_arithmetic.py checks the two agree)."""


def arithmetic_model(tag: object) -> IntegerArithmetic:
    """The implementation of ``tag`` (``szo.hw.fixed.check_arithmetic``: one ValueError naming the valid tags)."""
    return ARITHMETIC_MODELS[check_arithmetic(tag)]
