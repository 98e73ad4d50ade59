"""Lava's CUBA-LIF neuron: one dynamics, a float and a bit-exact fixed-point (Loihi) implementation.

One step (:meth:`CubaLIFBase.step`) for every arithmetic: the float reference and the two integer
arithmetics supply only leak, add and fire (the fixed-point backend picks its integer one by tag,
``szo.hw.arithmetic``). Not NIR's ``CubaLIF``: ``szo.models.cuba.NIRCubaLIFNode`` discretises NIR's
continuous-time neuron as norse does (``dt / tau`` steps, per-neuron ``r`` / ``v_leak`` / ``w_in``, the
membrane starting at ``v_leak``, a spike strictly above threshold, a reset *to* ``v_reset``); the maths
differ, so the two are named apart (docs/architecture.md, "Neurons").

Dynamics shared in :class:`CubaLIFBase` (lava ``proc/lif`` / lava-dl ``cuba.Neuron``)::

    I[t] = (1 - dI) I[t-1] + x[t]          current, dI = current decay (fraction lost per step)
    V[t] = (1 - dV) V[t-1] + I[t]          voltage, dV = voltage decay
    s[t] = V[t] > th  (fixed, Loihi)  |  V[t] >= th  (float, SpikingJelly)
    V[t] <- V[t] - th s[t]   (reset="subtract", the paper's soft reset)
    V[t] <- V[t] (1 - s[t])  (reset="zero", Loihi / lava_exchange hard reset)

An optional per-neuron ``bias`` (state units) is added to the voltage each step, as Lava's
LIF does (``v = v (1 - dv) + u + bias``). Two integer arithmetics: :class:`FixedCubaLIF`
(``"szo"``: every add saturates) and :class:`LoihiCubaLIF` (``"loihi"``: bit-exact with
lava-nc ``PyLifModelBitAcc``: the current wraps, the voltage clips to ``+-(2**23 - 1)``).
A standard Lava/Loihi 2 LIF process resets hard (``reset="zero"``); ``reset="subtract"`` on
Loihi needs a custom neuron program.

The paper's LIF (eq. 1) is this neuron with ``dI = 1`` (no synaptic memory: I[t] = x[t]),
``dV = 1/tau`` and ``reset="subtract"`` (:func:`paper_lif`). In fixed point the voltage decay
``1/tau = 1/1.1`` becomes ``round(4096/1.1) = 3724`` on the 12-bit scale, i.e. a retained
fraction 372/4096 = 0.0908203 instead of 0.0909091 (absolute error 8.9e-5, 0.098 % relative).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from szo.hw.fixed import (
    DECAY_SHIFT,
    VTH_SHIFT,
    BitWidths,
    SaturationCounter,
    decay_to_int,
    right_shift_to_zero,
    saturate,
    threshold_to_int,
    wrap_lava,
)

__all__ = ["LAVA_DM_OFFSET", "LAVA_DS_OFFSET", "LAVA_VTH_BITS", "RESETS", "CubaState", "CubaLIFBase",
           "FloatCubaLIF", "FixedCubaLIF", "LoihiCubaLIF", "paper_lif", "voltage_decay_error"]

RESETS: tuple[str, ...] = ("subtract", "zero")
LAVA_DS_OFFSET: int = 1
"""Lava adds 1 to the 12-bit ``du`` register (Loihi ``ds_offset``): current decays 1..4096."""
LAVA_DM_OFFSET: int = 0
"""Lava adds 0 to the 12-bit ``dv`` register (Loihi ``dm_offset``): voltage decays 0..4095."""
LAVA_VTH_BITS: int = 17
"""Lava ``PyLifModelBitAcc.vth``: unsigned 17-bit threshold mantissa (``vThMant``)."""


class CubaState(NamedTuple):
    """Neuron state: synaptic current and membrane voltage (same shape as the input)."""

    current: torch.Tensor
    voltage: torch.Tensor


class CubaLIFBase(ABC):
    """Shared CUBA-LIF dynamics; subclasses supply the arithmetic (leak, add, fire)."""

    def __init__(self, current_decay: float, voltage_decay: float, v_threshold: float = 1.0,
                 reset: str = "subtract") -> None:
        for name, d in (("current_decay", current_decay), ("voltage_decay", voltage_decay)):
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1] lost per step, got {d!r}")
        if reset not in RESETS:
            raise ValueError(f"unknown reset {reset!r}; valid: {list(RESETS)}")
        if not isinstance(v_threshold, (int, float)) or not v_threshold > 0:
            raise ValueError(f"v_threshold must be > 0, got {v_threshold!r}")
        self.current_decay = float(current_decay)
        self.voltage_decay = float(voltage_decay)
        self.v_threshold = float(v_threshold)
        self.reset = reset

    # -- arithmetic hooks -------------------------------------------------------------
    @abstractmethod
    def _leak_current(self, i: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _leak_voltage(self, v: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _add(self, a: torch.Tensor, b: torch.Tensor, quantity: str) -> torch.Tensor: ...

    @abstractmethod
    def _fire(self, v: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _threshold(self) -> float | int: ...

    @abstractmethod
    def initial_state(self, like: torch.Tensor) -> CubaState: ...

    # -- dynamics (shared) ------------------------------------------------------------
    def step(self, x: torch.Tensor, state: CubaState, bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, CubaState]:
        """One time step; returns ``(spike, new_state)`` (voltage after reset).

        ``bias`` (broadcastable to ``x``, state units) is added to the voltage, as in Lava.
        """
        i = self._add(self._leak_current(state.current), x, "current")
        v = self._add(self._leak_voltage(state.voltage), i if bias is None else i + bias, "voltage")
        s = self._fire(v)
        if self.reset == "subtract":
            v = v - s * self._threshold()  # v > th before, so no overflow below
        else:
            v = v * (1 - s)  # hard reset to 0
        return s, CubaState(i, v)

    def run(self, x_seq: torch.Tensor, state: CubaState | None = None, record: bool = False,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, CubaState, CubaState | None]:
        """Run ``x_seq [T, ...]``; returns spikes ``[T, ...]``, final state and (if ``record``) the state sequence."""
        if not isinstance(x_seq, torch.Tensor) or x_seq.dim() < 1:
            raise ValueError("x_seq must be a tensor [T, ...]")
        state = self.initial_state(x_seq[0]) if state is None else state
        spikes, cur, vol = [], [], []
        for t in range(x_seq.shape[0]):
            s, state = self.step(x_seq[t], state, bias)
            spikes.append(s)
            if record:
                cur.append(state.current)
                vol.append(state.voltage)
        rec = CubaState(torch.stack(cur), torch.stack(vol)) if record else None
        return torch.stack(spikes), state, rec


class FloatCubaLIF(CubaLIFBase):
    """Float32 reference (SpikingJelly semantics: fire on ``V >= th``, where the integer arithmetics and
    NIR's ``szo.models.cuba.NIRCubaLIFNode`` fire strictly above)."""

    def _leak_current(self, i: torch.Tensor) -> torch.Tensor:
        return i - i * self.current_decay

    def _leak_voltage(self, v: torch.Tensor) -> torch.Tensor:
        return v - v * self.voltage_decay

    def _add(self, a: torch.Tensor, b: torch.Tensor, quantity: str) -> torch.Tensor:
        return a + b

    def _fire(self, v: torch.Tensor) -> torch.Tensor:
        return (v >= self.v_threshold).to(v.dtype)

    def _threshold(self) -> float:
        return self.v_threshold

    def initial_state(self, like: torch.Tensor) -> CubaState:
        z = torch.zeros_like(like, dtype=torch.float32)
        return CubaState(z, z.clone())


class FixedCubaLIF(CubaLIFBase):
    """Bit-exact Loihi CUBA-LIF on int64 tensors holding ``state_bits``-wide values.

    Inputs are integers in state units (``2**-STATE_SHIFT``). Every add saturates to
    ``widths.state_bits`` and is counted in ``counter[layer]``.
    """

    def __init__(self, current_decay: float, voltage_decay: float, v_threshold: float = 1.0,
                 reset: str = "subtract", widths: BitWidths | None = None,
                 counter: SaturationCounter | None = None, layer: str = "neuron") -> None:
        super().__init__(current_decay, voltage_decay, v_threshold, reset)
        self.widths = widths or BitWidths()
        self.counter = counter if counter is not None else SaturationCounter()
        self.layer = layer
        self.current_decay_int = decay_to_int(self.current_decay, DECAY_SHIFT)
        self.voltage_decay_int = decay_to_int(self.voltage_decay, DECAY_SHIFT)
        self.threshold_int = threshold_to_int(self.v_threshold)

    def _leak(self, s: torch.Tensor, decay_int: int) -> torch.Tensor:
        # |s| < 2**23 and (4096 - d) <= 2**12: the product fits in 36 bits, exact in int64
        return right_shift_to_zero(s * ((1 << DECAY_SHIFT) - decay_int), DECAY_SHIFT)  # round toward zero

    def _leak_current(self, i: torch.Tensor) -> torch.Tensor:
        return self._leak(i, self.current_decay_int)

    def _leak_voltage(self, v: torch.Tensor) -> torch.Tensor:
        return self._leak(v, self.voltage_decay_int)

    def _add(self, a: torch.Tensor, b: torch.Tensor, quantity: str) -> torch.Tensor:
        if b.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"fixed-point neuron input must be an integer tensor (state units), got {b.dtype}")
        return saturate(a + b.to(torch.int64), self.widths.state_bits, self.counter, self.layer, quantity)

    def _fire(self, v: torch.Tensor) -> torch.Tensor:
        return (v > self.threshold_int).to(torch.int64)  # Loihi compares strictly

    def _threshold(self) -> int:
        return self.threshold_int

    def lava_params(self) -> dict[str, int]:
        """This neuron as a Lava ``LIF`` process: ``du``, ``dv`` (12-bit registers), ``vth`` (vThMant).

        ValueError where Lava's registers cannot hold the parameters.
        """
        if self.current_decay_int < LAVA_DS_OFFSET:
            raise ValueError(f"current_decay {self.current_decay!r} -> {self.current_decay_int}/4096: Lava's LIF "
                             f"decays the current by du + {LAVA_DS_OFFSET} (ds_offset), so the smallest current "
                             "decay is 1/4096")
        if self.voltage_decay_int - LAVA_DM_OFFSET > (1 << DECAY_SHIFT) - 1:
            raise ValueError(f"voltage_decay {self.voltage_decay!r} -> {self.voltage_decay_int}/4096: Lava's 12-bit dv "
                             "register holds 0..4095 (dm_offset 0), so a full voltage leak (tau = 1) is not "
                             "representable; use tau > 1")
        if (self.threshold_int >> VTH_SHIFT) >= 1 << LAVA_VTH_BITS:  # Lava: effective_vth = vth << vth_shift
            raise ValueError(f"v_threshold {self.v_threshold!r} needs vThMant = {self.threshold_int >> VTH_SHIFT} > "
                             f"2**{LAVA_VTH_BITS} - 1 (Lava's unsigned {LAVA_VTH_BITS}-bit vth)")
        return {"du": self.current_decay_int - LAVA_DS_OFFSET, "dv": self.voltage_decay_int - LAVA_DM_OFFSET,
                "vth": self.threshold_int >> VTH_SHIFT}

    def initial_state(self, like: torch.Tensor) -> CubaState:
        z = torch.zeros_like(like, dtype=torch.int64)
        return CubaState(z, z.clone())


class LoihiCubaLIF(FixedCubaLIF):
    """Bit-exact with lava-nc ``PyLifModelBitAcc`` (``src/lava/proc/lif/models.py``,
    ``AbstractPyLifModelFixed.subthr_dynamics`` / ``reset_voltage``, ``PyLifModelBitAcc.spiking_activation``).

    Differs from :class:`FixedCubaLIF` only in overflow: the current wraps modulo ``2**24``
    into ``(-2**23, 2**23]`` (counted as ``current_wrap``), the voltage clips to
    ``+-(2**23 - 1)`` (counted as ``voltage``). Inputs are ``a_in << A_IN_SHIFT`` (state units).
    Lava's registers: ``lava_params()``; decays Lava cannot hold raise ValueError.
    """

    def __init__(self, current_decay: float, voltage_decay: float, v_threshold: float = 1.0,
                 reset: str = "zero", widths: BitWidths | None = None,
                 counter: SaturationCounter | None = None, layer: str = "neuron") -> None:
        super().__init__(current_decay, voltage_decay, v_threshold, reset, widths, counter, layer)
        self.lava_params()  # raises ValueError where Lava's registers cannot hold the parameters

    def _add(self, a: torch.Tensor, b: torch.Tensor, quantity: str) -> torch.Tensor:
        if b.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"fixed-point neuron input must be an integer tensor (state units), got {b.dtype}")
        s = a + b.to(torch.int64)
        if quantity == "current":
            return wrap_lava(s, self.widths.state_bits, self.counter, self.layer, "current_wrap")  # wrap, once
        return saturate(s, self.widths.state_bits, self.counter, self.layer, quantity, symmetric=True)  # np.clip


def paper_lif(kind: str = "fixed", *, tau: float = 1.1, v_threshold: float = 1.0, reset: str = "subtract",
              widths: BitWidths | None = None, counter: SaturationCounter | None = None,
              layer: str = "neuron") -> CubaLIFBase:
    """The paper's LIF (eq. 1) as a CUBA neuron: ``dI = 1``, ``dV = 1/tau``, soft reset.

    ``kind``: ``"float"``, ``"fixed"`` (szo arithmetic) or ``"loihi"`` (Lava bit-accurate arithmetic).
    """
    if not isinstance(tau, (int, float)) or not tau >= 1.0:
        raise ValueError(f"tau must be >= 1 (decay 1/tau in (0, 1]), got {tau!r}")
    if kind == "float":
        return FloatCubaLIF(1.0, 1.0 / tau, v_threshold, reset)
    if kind == "fixed":
        return FixedCubaLIF(1.0, 1.0 / tau, v_threshold, reset, widths, counter, layer)
    if kind == "loihi":
        return LoihiCubaLIF(1.0, 1.0 / tau, v_threshold, reset, widths, counter, layer)
    raise ValueError(f"unknown neuron kind {kind!r}; valid: ['float', 'fixed', 'loihi']")


def voltage_decay_error(tau: float) -> dict[str, float]:
    """The 12-bit mapping of ``1/tau``: integer decay, retained factors and their error."""
    d = decay_to_int(1.0 / tau)
    exact = 1.0 - 1.0 / tau
    fixed = ((1 << DECAY_SHIFT) - d) / (1 << DECAY_SHIFT)
    return {"decay_int": d, "retained_exact": exact, "retained_fixed": fixed,
            "abs_error": fixed - exact, "rel_error": (fixed - exact) / exact if exact else 0.0}
