"""The one place that builds neurons (paper eq. (1)-(2) LIF, or the ReLU ANN twin).

Eq. (1): u[t] = (1 - 1/tau) (u[t-1] - V_th s[t-1]) + W s_{l-1}[t] + b
Eq. (2): s[t] = H(u[t] - V_th)

SpikingJelly's ``LIFNode(decay_input=False, v_reset=None)`` charges
``h[t] = (1 - 1/tau) v[t-1] + x[t]`` and soft-resets ``v[t] = h[t] - V_th s[t]``,
which is exactly eq. (1)-(2).
"""

from __future__ import annotations

import inspect
from typing import Any

from spikingjelly.activation_based import neuron, surrogate
from torch import nn

TAU: float = 1.1
"""LIF membrane time constant (paper Sec. 6 / App. G)."""
V_TH: float = 1.0
"""LIF firing threshold (paper Sec. 6 / App. G)."""

ACTIVATIONS: tuple[str, ...] = ("lif", "relu")

_LIF_KEYS = frozenset(inspect.signature(neuron.LIFNode.__init__).parameters) - {"self"}


def lif_defaults() -> dict[str, Any]:
    """Keyword arguments of the paper's LIF (a fresh dict; the surrogate is a new instance)."""
    return dict(
        tau=TAU,
        decay_input=False,
        v_threshold=V_TH,
        v_reset=None,  # soft reset: subtract V_th on a spike
        surrogate_function=surrogate.PiecewiseQuadratic(),  # triangle surrogate
        detach_reset=False,
        step_mode="m",
    )


def make_neuron(activation: str = "lif", **overrides: Any) -> nn.Module:
    """Build one activation layer.

    ``"lif"``: the paper's multi-step LIF (``overrides`` replace any ``LIFNode`` argument,
    e.g. ``store_v_seq=True``). ``"relu"``: an elementwise ``nn.ReLU`` (the ANN twin; it
    acts on ``[T, N, ...]`` directly and takes no overrides).
    """
    if activation == "lif":
        unknown = sorted(set(overrides) - _LIF_KEYS)
        if unknown:
            raise ValueError(
                f"unknown LIF override(s) {unknown}; valid keys: {sorted(_LIF_KEYS)}"
            )
        kwargs = lif_defaults()
        kwargs.update(overrides)
        return neuron.LIFNode(**kwargs)
    if activation == "relu":
        if overrides:
            raise ValueError(
                f"activation 'relu' takes no overrides, got {sorted(overrides)}"
            )
        return nn.ReLU()
    raise ValueError(f"unknown activation {activation!r}; valid: {list(ACTIVATIONS)}")
