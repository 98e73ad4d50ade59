"""NIR's current-based LIF (``CubaLIF``) as a multi-step SpikingJelly memory module: :class:`NIRCubaLIFNode`.

Not the fixed-point backend's neuron: ``szo.hw.neuron`` (``CubaLIFBase``: ``FloatCubaLIF`` /
``FixedCubaLIF`` / ``LoihiCubaLIF``) is Lava's CUBA-LIF, a different discretisation with one step
shared by its float and integer arithmetics: per-step *decay fractions* ``dI`` / ``dV`` (no ``dt``,
``r``, ``v_leak`` or ``w_in``), state starting at 0, a spike where ``V >= th`` (float, SpikingJelly's
comparison) or ``V > th`` (integer, Loihi's), and a reset by subtraction or to 0. The neuron here is
NIR's graph primitive as norse steps it: forward Euler with ``dt / tau``, per-neuron arrays, the
membrane starting at ``v_leak``, a spike only where ``h > v_threshold`` (strictly above) and a reset
*to* ``v_reset``. The two agree only in special cases, so they are named apart
(docs/architecture.md, "Neurons").

NIR (``nir.CubaLIF``) defines the neuron in continuous time::

    tau_syn dI/dt = -I + w_in S
    tau_mem dv/dt = (v_leak - v) + r I
    z = [v > v_threshold];  v <- v_reset where z

and leaves the discretisation to each simulator. :class:`NIRCubaLIFNode` takes norse's (norse 1.1.0,
``norse.torch.utils.import_nir.CubaLIF``: ``LIBoxCell`` then ``LIFBoxCell``; forward Euler with
step ``dt``, the membrane integrating the current *of this step*), written with the same float
operations in the same order, so that a graph norse runs gives the same spikes here::

    I[t] = I[t-1] + dt / tau_syn * ((0 - I[t-1]) + w_in x[t])
    h[t] = v[t-1] + dt / tau_mem * (r I[t] + v_leak - v[t-1])
    z[t] = [h[t] - v_threshold > 0]
    v[t] = (1 - z[t]) h[t] + z[t] v_reset

starting from ``I = 0`` and ``v = v_leak``. Where the readings differ (docs/deploy.md):

* NIR's own numpy reference (``paper/03_rnn/extras/debug_CubaLIF/nir_reference_impl.py`` in the
  NIR repository) integrates the membrane with the current of the *previous* step and resets by
  subtraction; norse and snnTorch use this step's current and a reset to a value. szo takes
  norse's.
* norse leaks the synaptic current towards ``v_leak`` and starts it there (its synapse is an
  ``LIBoxCell`` sharing the neuron's ``v_leak``), and resets to 0 whatever ``v_reset`` says. szo
  takes the spec: the current leaks to 0 and starts at 0, the membrane resets to ``v_reset``.
  The two agree whenever ``v_leak = v_reset = 0`` (norse's braille network, snnTorch's exports).

The parameters are per-neuron buffers (float32, NIR's arrays), not trained; the spikes are a
comparison, so the node has no surrogate gradient: it is for forward-only training and
evaluation.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from spikingjelly.activation_based import base

__all__ = ["CUBA_FIELDS", "NIRCubaLIFNode", "CubaLIFNode", "register_fields"]

CUBA_FIELDS: tuple[str, ...] = ("tau_syn", "tau_mem", "r", "v_leak", "v_threshold", "v_reset", "w_in")
"""The per-neuron arrays of ``nir.CubaLIF``, in seconds (time constants) and NIR's units."""


def register_fields(module: torch.nn.Module, kind: str, names: tuple[str, ...], values: dict[str, Any],
                    dt: float) -> None:
    """A NIR neuron's per-neuron arrays ``names`` (float32 buffers of one shape) and ``dt`` (seconds) on
    ``module``; one ValueError naming ``kind`` for a missing field, mismatched shapes or a bad dt."""
    missing = [k for k in names if k not in values]
    if missing:
        raise ValueError(f"{kind} needs the fields {list(names)}; missing {missing}")
    arrays = {k: torch.from_numpy(np.asarray(values[k], dtype=np.float64)).float() for k in names}
    shapes = {tuple(a.shape) for a in arrays.values()}
    if len(shapes) != 1:
        raise ValueError(f"{kind} fields must share one shape, got {sorted(shapes)}")
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not dt > 0:
        raise ValueError(f"dt must be a positive number of seconds, got {dt!r}")
    for k, a in arrays.items():
        module.register_buffer(k, a)
    module.dt = float(dt)


class NIRCubaLIFNode(base.MemoryModule):
    """Multi-step ``[T, N, *shape] -> [T, N, *shape]`` spikes of NIR ``CubaLIF`` neurons (module
    docstring: norse's discretisation, fires strictly above ``v_threshold``, resets to ``v_reset``;
    not ``szo.hw.neuron``'s Lava CUBA-LIF). ``fields``: the seven arrays of :data:`CUBA_FIELDS`, each of the neurons' shape;
    ``dt``: seconds per step. Memories ``i`` (synaptic current) and ``v`` (membrane) carry over
    between calls until ``reset()`` (``functional.reset_net``)."""

    def __init__(self, fields: dict[str, Any], dt: float) -> None:
        super().__init__()
        register_fields(self, "NIRCubaLIFNode", CUBA_FIELDS, fields, dt)
        self.register_memory("i", None)
        self.register_memory("v", None)

    @property
    def shape(self) -> tuple[int, ...]:
        """The neurons' shape (one sample, without time or batch)."""
        return tuple(self.v_threshold.shape)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, dt={self.dt:g}"

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        # the step factors as norse forms them: 1 / tau (a float32 division), then dt * (1 / tau)
        syn_step = self.dt * (1 / self.tau_syn)
        mem_step = self.dt * (1 / self.tau_mem)
        i = torch.zeros_like(x_seq[0]) if self.i is None else self.i
        v = self.v_leak.expand_as(x_seq[0]).clone() if self.v is None else self.v
        out = []
        for x in x_seq:
            i = i + syn_step * ((0.0 - i) + self.w_in * x)  # LIBoxCell with v_leak 0: ((v_leak - i) + x)
            h = v + mem_step * (self.r * i + self.v_leak - v)  # LIFBoxCell: (input + v_leak - v)
            z = (h - self.v_threshold > 0).to(h.dtype)  # norse's heaviside(h - v_th): strictly above
            v = (1 - z) * h + z * self.v_reset  # norse's reset_value
            out.append(z)
        self.i, self.v = i, v
        return torch.stack(out)


CubaLIFNode = NIRCubaLIFNode
"""The earlier name of :class:`NIRCubaLIFNode` (kept for code and NIR imports written against it)."""
