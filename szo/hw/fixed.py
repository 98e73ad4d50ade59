"""Loihi-style fixed-point number formats: widths as data, named shifts, saturating ops.

Every integer quantity in ``szo.hw`` is an ``int64`` torch tensor holding a value that fits
the bit width stated here; the wider host type only makes the arithmetic exact, every
narrowing is an explicit :func:`saturate` (clamp, never wrap) that is counted.

Units (the same as SpikingJelly ``lava_exchange.CubaLIFNode`` with its default ``scale=1<<6``
and lava-dl's ``cuba.Neuron``):

* current / voltage state: integer ``u`` means ``u / 2**STATE_SHIFT`` (``s_scale = 4096``);
* decays: integer ``d`` means a fraction ``d / 2**DECAY_SHIFT`` lost per step (``p_scale``);
* threshold: ``vth_int = round(v_th * 2**STATE_SHIFT)`` = Loihi ``vThMant << VTH_SHIFT``;
* weights: an 8-bit mantissa ``w`` with a per-layer exponent ``e``: ``W = w * 2**e``;
* graded input activations: integer ``a`` means ``a / 2**ACT_SHIFT`` (the ``2**6`` scale).

Two arithmetics (:data:`ARITHMETICS`) share these formats and differ only where Lava's
bit-accurate models differ from szo's own:

* ``"szo"``: every narrowing saturates (clamp, counted); synaptic sums are shifted into state
  units exactly (right shifts only below ``2**-12``, toward zero); bias added to the current.
* ``"loihi"``: bit-exact with lava-nc ``PyDenseModelBitAcc`` + ``PyLifModelBitAcc``
  (``src/lava/proc/dense/models.py``, ``src/lava/proc/lif/models.py``): the Dense output is
  ``acc`` arithmetically shifted by its weight exponent (*floor* for negative exponents), the
  LIF left-shifts it by :data:`A_IN_SHIFT`, the current *wraps* into ``(-2**23, 2**23]``
  (:func:`wrap_lava`), the voltage clips to ``+-(2**23 - 1)``, the bias is added to the voltage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from szo.functional.integer import SaturationCounter, check_int, int_range, right_shift_to_zero, saturate

__all__ = [
    "ACT_SHIFT",
    "ARITHMETICS",
    "A_IN_SHIFT",
    "DECAY_SHIFT",
    "STATE_SHIFT",
    "VTH_SHIFT",
    "WGT_SHIFT",
    "BitWidths",
    "SaturationCounter",
    "check_arithmetic",
    "decay_to_int",
    "floor_shift",
    "int_range",
    "quantize_bias",
    "quantize_weight",
    "right_shift_to_zero",
    "saturate",
    "shift",
    "threshold_to_int",
    "wrap_lava",
]

DECAY_SHIFT: int = 12
"""Decays are 12-bit fractions of ``2**12`` (lava ``p_scale = 1 << 12``)."""
WGT_SHIFT: int = 6
"""Loihi adds ``w_mant << (WGT_SHIFT + wgtExp)`` to the current (lava ``w_scale = 1 << 6``)."""
ACT_SHIFT: int = 6
"""Graded input activations carry 6 fractional bits (activations scaled by ``2**6``)."""
STATE_SHIFT: int = 12
"""Current/voltage carry 12 fractional bits (lava ``s_scale = scale << 6 = 1 << 12``)."""
VTH_SHIFT: int = 6
"""Loihi threshold ``vth_int = vThMant << VTH_SHIFT`` (so ``vThMant = v_th * 2**6``)."""
A_IN_SHIFT: int = 6
"""Lava's LIF left-shifts its synaptic input ``a_in`` by 6 (``PyLifModelBitAcc.act_shift``):
a Dense output ``a`` is ``a << 6`` state units, so ``STATE_SHIFT = WGT_SHIFT + A_IN_SHIFT``."""

ARITHMETICS: tuple[str, ...] = ("szo", "loihi")
"""``"szo"``: saturating, exact synaptic shifts; ``"loihi"``: bit-exact with Lava's PyLifModelBitAcc /
PyDenseModelBitAcc."""


def check_arithmetic(arithmetic: object) -> str:
    """``arithmetic`` if it is one of :data:`ARITHMETICS`, else one clear ValueError."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"unknown arithmetic {arithmetic!r}; valid: {list(ARITHMETICS)} "
                         "('szo': saturating; 'loihi': bit-exact with Lava's bit-accurate LIF/Dense, wrapping current)")
    return str(arithmetic)


@dataclass(frozen=True)
class BitWidths:
    """Bit widths of every stored or computed quantity (Loihi-1/2 CUBA neuron defaults)."""

    weight_bits: int = 8  # signed synaptic weight mantissa
    weight_exp_min: int = -12  # W = w * 2**e, e >= -STATE_SHIFT keeps the spike->current shift a left shift
    weight_exp_max: int = 1  # Loihi wgtExp in [-8, 7] relative to WGT_SHIFT; e = wgtExp - 6 <= 1
    state_bits: int = 24  # current and voltage registers (saturating)
    decay_bits: int = DECAY_SHIFT  # current/voltage decays on a 4096 scale
    input_bits: int = 16  # graded input spike payload (signed, ACT_SHIFT fractional bits)
    bias_mant_bits: int = 13  # Loihi bias = bias_mant << bias_exp
    bias_exp_max: int = 7
    readout_bits: int = 32  # integer readout accumulator over T

    def __post_init__(self) -> None:
        for name in ("weight_bits", "state_bits", "decay_bits", "input_bits", "bias_mant_bits", "readout_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 48:
                raise ValueError(f"BitWidths.{name} must be an int in [2, 48], got {v!r}")
        if self.decay_bits != DECAY_SHIFT:
            raise ValueError(f"BitWidths.decay_bits must be {DECAY_SHIFT} (the Loihi decay scale), got {self.decay_bits}")
        if not -STATE_SHIFT <= self.weight_exp_min <= self.weight_exp_max <= 16:
            raise ValueError(
                f"need {-STATE_SHIFT} <= weight_exp_min <= weight_exp_max <= 16, "
                f"got [{self.weight_exp_min}, {self.weight_exp_max}]"
            )
        if not 0 <= self.bias_exp_max <= 16:
            raise ValueError(f"BitWidths.bias_exp_max must be in [0, 16], got {self.bias_exp_max}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def floor_shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """``floor(x * 2**n)``: left shift for ``n >= 0``, arithmetic right shift (floor: -7 >> 1 = -4) for ``n < 0``.

    Lava ``PyDenseModelBitAcc.run_spk``: ``np.left_shift(a_accum, weight_exp)`` if
    ``weight_exp > 0`` else ``np.right_shift(a_accum, -weight_exp)``.
    """
    check_int(x, "floor_shift")
    return x << n if n >= 0 else x >> -n  # int64 >> is arithmetic: rounds toward -inf


def wrap_lava(x: torch.Tensor, bits: int, counter: SaturationCounter | None = None,
              layer: str = "", quantity: str = "") -> torch.Tensor:
    """Lava's overflow rule for the LIF current: ``x - 2**bits`` where ``x > 2**(bits-1)``,
    ``x + 2**bits`` where ``x <= -2**(bits-1)`` (once; PyLifModelBitAcc ``subthr_dynamics``).

    A wrap modulo ``2**bits`` into ``(-2**(bits-1), 2**(bits-1)]``, one wrap per step: a sum
    beyond ``3 * 2**(bits-1)`` stays outside the range, as in Lava. Wrapped elements are counted.
    """
    check_int(x, "wrap_lava")
    top = int_range(bits)[1] + 1  # 2**(bits-1): Lava's max_uv_val
    y = torch.where(x > top, x - 2 * top, x)  # positive overflow wraps to negative
    y = torch.where(y <= -top, x + 2 * top, y)  # negative overflow (and -2**(bits-1) itself) wraps to positive
    if counter is not None:
        counter.add(layer, quantity, (y != x).sum())  # a device tensor: no sync here
    return y


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x * 2**n``: left shift (exact) for ``n >= 0``, right shift toward zero for ``n < 0``."""
    check_int(x, "shift")
    return x << n if n >= 0 else right_shift_to_zero(x, -n)


def decay_to_int(decay: float, bits: int = DECAY_SHIFT) -> int:
    """A decay fraction in [0, 1] -> nearest integer on the ``2**bits`` scale (lava step_quantize)."""
    if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be a float in [0, 1] (fraction lost per step), got {decay!r}")
    # round half to even, as torch.round in lava_exchange's step_quantize (Python's round does the same)
    return round(decay * (1 << bits))


def threshold_to_int(v_threshold: float) -> int:
    """Threshold in state units; must be a multiple of ``2**-VTH_SHIFT`` (Loihi vThMant << 6)."""
    mant = v_threshold * (1 << VTH_SHIFT)
    if not math.isfinite(mant) or mant <= 0 or mant != round(mant):
        raise ValueError(
            f"v_threshold must be a positive multiple of 2**-{VTH_SHIFT} (Loihi vThMant << {VTH_SHIFT}), got {v_threshold!r}"
        )
    return int(round(mant)) << (STATE_SHIFT - VTH_SHIFT)


REQUANT_TOL: float = 2.0 ** -20
"""Relative slack of the exponent choice: a weight written back as ``w_int 2**e`` through a float32
parameter (and a BN scale) may come back ``(1 + ~2**-23)`` times larger; it still gets ``e``."""


def _exponent(x: torch.Tensor, lo: int, hi: int, e_min: int, e_max: int) -> int:
    """The smallest ``e`` in ``[e_min, e_max]`` with every ``x / 2**e`` in ``[lo, hi]`` (up to REQUANT_TOL):
    the negative side may reach ``lo = -2**(bits-1)``, so ``w_int 2**e`` re-quantises to ``(w_int, e)``
    for every mantissa, -128 included."""
    top = float(x.max()) if x.numel() else 0.0
    bottom = float(x.min()) if x.numel() else 0.0
    need = max(top / hi, bottom / lo, 0.0)  # lo < 0: bottom / lo > 0 for a negative bottom
    if need == 0.0:
        return e_min
    e = math.ceil(math.log2(need / (1.0 + REQUANT_TOL)))
    while top / 2.0**e > hi * (1.0 + REQUANT_TOL) or bottom / 2.0**e < lo * (1.0 + REQUANT_TOL):
        e += 1  # guard log2 rounding
    return min(max(e, e_min), e_max)


def quantize_weight(w: torch.Tensor, widths: BitWidths) -> tuple[torch.Tensor, int, int]:
    """Float weights -> ``(w_int, e, n_saturated)`` with ``W ~= w_int * 2**e``, ``w_int`` signed ``weight_bits``.

    ``e`` is the smallest exponent in ``[weight_exp_min, weight_exp_max]`` for which every weight
    fits ``[-2**(bits-1), 2**(bits-1) - 1]`` (per-layer exponent, lava ``quantize_8b`` with a
    power-of-two scale): the negative side reaches -128, so the weights an integer learner writes
    back (``szo.hw.optim.mcu``: mantissas clipped to [-128, 127]) re-quantise to the same integers.
    Rounding is to nearest (ties to even); weights beyond the range at ``weight_exp_max`` saturate.
    """
    lo, hi = int_range(widths.weight_bits)
    w = w.detach().to(torch.float64)
    amax = float(w.abs().max()) if w.numel() else 0.0  # NaN if any weight is NaN, inf if any is infinite
    if not math.isfinite(amax):
        raise ValueError("weights contain NaN or Inf; cannot quantise")
    e = _exponent(w, lo, hi, widths.weight_exp_min, widths.weight_exp_max)
    q = torch.round(w * 2.0 ** (-e))  # exact: scaling by a power of two, then round to nearest
    n_sat = int(((q < lo) | (q > hi)).sum())
    return q.clamp(lo, hi).to(torch.int64), e, n_sat  # saturate out-of-range weights


def quantize_bias(b_state: torch.Tensor, widths: BitWidths) -> tuple[torch.Tensor, int, int]:
    """Bias in state units (float) -> ``(bias_int, exp, n_sat)`` with bias = mant << exp (Loihi biasMant/biasExp).

    Returns the effective integer ``mant << exp`` (what is added to the current each step).
    """
    lo, hi = int_range(widths.bias_mant_bits)
    b = b_state.detach().to(torch.float64)
    exp = _exponent(b, lo, hi, 0, widths.bias_exp_max)  # -4096 << exp re-quantises to itself too
    mant = torch.round(b / 2.0**exp)  # round to nearest (ties to even)
    n_sat = int(((mant < lo) | (mant > hi)).sum())
    return mant.clamp(lo, hi).to(torch.int64) << exp, exp, n_sat  # saturate the mantissa
