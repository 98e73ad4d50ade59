"""NIR's non-spiking neurons (``LI``, ``CubaLI``, ``I``): pure step functions and the multi-step
SpikingJelly memory modules that run them on ``[T, N, *shape]`` sequences.

NIR defines each neuron in continuous time and leaves the discretisation to the simulator.
szo takes forward Euler with step ``dt`` (the reading of its LIF / IF / ``CubaLIF``, and of
norse 1.1's box cells), written as norse forms each operation so that a norse cell fed the same
input gives the same bits::

    LI      tau dv/dt = (v_leak - v) + r I
            v[t] = v[t-1] + dt * (1 / tau) * ((v_leak - v[t-1]) + r x[t])           (norse LIBoxCell, fed r x)
    CubaLI  tau_syn dI/dt = -I + w_in S;  tau_mem dv/dt = (v_leak - v) + r I
            I[t] = I[t-1] + dt * (1 / tau_syn) * ((0 - I[t-1]) + w_in x[t])         (norse LIBoxCell, v_leak 0)
            v[t] = v[t-1] + dt * (1 / tau_mem) * ((v_leak - v[t-1]) + r I[t])       (norse LIBoxCell)
    I       dv/dt = r I
            v[t] = v[t-1] + (dt * r) * x[t]

Each outputs its membrane ``v`` (no spikes); ``LI`` and ``CubaLI`` start at ``v = v_leak`` and
``I = 0`` (norse's initial state), ``I`` at ``v = 0``. ``CubaLI`` is ``CubaLIF``
(:mod:`szo.models.cuba`) without the threshold: the same synapse, this step's current into the
membrane (norse's reading; NIR's own numpy reference feeds the previous step's current).

The step functions (:func:`li_step`, :func:`cuba_li_step`, :func:`integrator_step`) are pure
(state in, state out, norse's functional style); the modules only hold the parameters (float32
buffers, NIR's per-neuron arrays in seconds, not trained) and the state between calls.
:func:`szo.export.nir_import.check_time_constants` is the stability rule applied to them on import.
"""
from __future__ import annotations

from typing import Any

import torch
from spikingjelly.activation_based import base

from szo.models.cuba import register_fields

__all__ = ["CUBA_LI_FIELDS", "CubaLINode", "INode", "LI_FIELDS", "LINode", "cuba_li_step", "integrator_step",
           "li_step"]

LI_FIELDS: tuple[str, ...] = ("tau", "r", "v_leak")
"""The per-neuron arrays of ``nir.LI``."""
CUBA_LI_FIELDS: tuple[str, ...] = ("tau_syn", "tau_mem", "r", "v_leak", "w_in")
"""The per-neuron arrays of ``nir.CubaLI``."""


def li_step(v: torch.Tensor, x: torch.Tensor, *, step: torch.Tensor, r: torch.Tensor,
            v_leak: torch.Tensor) -> torch.Tensor:
    """One forward-Euler step of ``tau dv/dt = (v_leak - v) + r x``; ``step = dt * (1 / tau)``."""
    return v + step * ((v_leak - v) + r * x)


def cuba_li_step(i: torch.Tensor, v: torch.Tensor, x: torch.Tensor, *, syn_step: torch.Tensor,
                 mem_step: torch.Tensor, r: torch.Tensor, v_leak: torch.Tensor,
                 w_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the current-based leaky integrator: ``(I[t], v[t])``, the membrane driven by
    this step's current. ``syn_step = dt * (1 / tau_syn)``, ``mem_step = dt * (1 / tau_mem)``."""
    i = i + syn_step * ((0.0 - i) + w_in * x)
    return i, v + mem_step * ((v_leak - v) + r * i)


def integrator_step(v: torch.Tensor, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:
    """One forward-Euler step of ``dv/dt = r x``; ``gain = dt * r``."""
    return v + gain * x


class _Membrane(base.MemoryModule):
    """Shared by the three nodes: ``fields`` and ``dt`` as buffers, ``shape``, ``extra_repr``."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self, fields: dict[str, Any], dt: float) -> None:
        super().__init__()
        register_fields(self, type(self).__name__, self.FIELDS, fields, dt)

    @property
    def shape(self) -> tuple[int, ...]:
        """The neurons' shape (one sample, without time or batch)."""
        return tuple(self.get_buffer(self.FIELDS[0]).shape)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, dt={self.dt:g}"


class LINode(_Membrane):
    """Multi-step ``nir.LI`` (module docstring): ``[T, N, *shape]`` inputs -> membranes."""

    FIELDS = LI_FIELDS

    def __init__(self, fields: dict[str, Any], dt: float) -> None:
        super().__init__(fields, dt)
        self.register_memory("v", None)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        step = self.dt * (1 / self.tau)  # as norse forms it: 1 / tau, then dt * (1 / tau)
        v = self.v_leak.expand_as(x_seq[0]).clone() if self.v is None else self.v
        out = []
        for x in x_seq:
            v = li_step(v, x, step=step, r=self.r, v_leak=self.v_leak)
            out.append(v)
        self.v = v
        return torch.stack(out)


class CubaLINode(_Membrane):
    """Multi-step ``nir.CubaLI`` (module docstring): ``[T, N, *shape]`` inputs -> membranes."""

    FIELDS = CUBA_LI_FIELDS

    def __init__(self, fields: dict[str, Any], dt: float) -> None:
        super().__init__(fields, dt)
        self.register_memory("i", None)
        self.register_memory("v", None)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        syn_step, mem_step = self.dt * (1 / self.tau_syn), self.dt * (1 / self.tau_mem)
        i = torch.zeros_like(x_seq[0]) if self.i is None else self.i
        v = self.v_leak.expand_as(x_seq[0]).clone() if self.v is None else self.v
        out = []
        for x in x_seq:
            i, v = cuba_li_step(i, v, x, syn_step=syn_step, mem_step=mem_step, r=self.r, v_leak=self.v_leak,
                                w_in=self.w_in)
            out.append(v)
        self.i, self.v = i, v
        return torch.stack(out)


class INode(_Membrane):
    """Multi-step ``nir.I`` (module docstring): ``[T, N, *shape]`` inputs -> membranes."""

    FIELDS = ("r",)

    def __init__(self, fields: dict[str, Any], dt: float) -> None:
        super().__init__(fields, dt)
        self.register_memory("v", None)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        gain = self.dt * self.r
        v = torch.zeros_like(x_seq[0]) if self.v is None else self.v
        out = []
        for x in x_seq:
            v = integrator_step(v, x, gain=gain)
            out.append(v)
        self.v = v
        return torch.stack(out)
