"""Forward-mode AD (JVP) through the SpikingJelly LIF and its surrogate.

SpikingJelly's multi-step LIF runs as a custom op (``sj_lif::forward``) and its surrogates
are ``torch.autograd.Function``s with a backward rule only, so neither supports forward-mode
AD (``torch.autograd.forward_ad`` / ``torch.func.jvp``: "You must implement the jvp function").
Inside :func:`jvp_neurons` every ``LIFNode`` of a model runs instead a pure-torch step of
the same neuron (SpikingJelly's own charge / fire / reset equations) whose spike is

    s = H(x) + g(x) - g(x).detach()        g = the surrogate's primitive function

i.e. exactly the Heaviside step in value (``g(x) - g(x)`` is 0 in floating point), and with
tangent ``g'(x) dx``, the surrogate derivative SpikingJelly's backward uses. The
directional derivative of a loss through this forward therefore equals autograd's gradient
through the SpikingJelly LIF, dotted with the tangent (tests/models/test_forward_mode.py
checks both to 1e-5, and that the spikes equal the custom op's).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from spikingjelly.activation_based import neuron
from torch import nn

__all__ = ["jvp_neurons", "lif_multi_step_torch", "surrogate_spike"]


def surrogate_spike(x: torch.Tensor, surrogate: nn.Module) -> torch.Tensor:
    """Heaviside(x) in value, surrogate derivative in forward- and reverse-mode AD."""
    prim = getattr(surrogate, "primitive_function", None)
    alpha = getattr(surrogate, "alpha", None)
    if prim is None or alpha is None or not getattr(surrogate, "spiking", True):
        raise ValueError(f"forward-mode AD needs a SpikingJelly surrogate with primitive_function and alpha "
                         f"in spiking mode, got {type(surrogate).__name__}")
    g = prim(x, alpha)
    return (x >= 0).to(x.dtype) + (g - g.detach())


def lif_multi_step_torch(node: neuron.LIFNode, x_seq: torch.Tensor) -> torch.Tensor:
    """One multi-step LIF forward in plain torch ops (SpikingJelly's LIF equations), state in ``node.v``."""
    v = node.v
    if not isinstance(v, torch.Tensor):
        v = torch.full_like(x_seq[0], float(v))
    tau, v_th, v_reset = node.tau, node.v_threshold, node.v_reset
    spikes = []
    for x in x_seq:
        # charge (neuron.LIFNode.neuronal_charge)
        if node.decay_input:
            h = v + (x - (v if v_reset is None else v - v_reset)) / tau
        else:
            h = v - (v if v_reset is None else v - v_reset) / tau + x
        s = surrogate_spike(h - v_th, node.surrogate_function)
        s_r = s.detach() if node.detach_reset else s
        v = h - s_r * v_th if v_reset is None else h * (1.0 - s_r) + v_reset * s_r
        spikes.append(s)
    node.v = v
    return torch.stack(spikes)


@contextlib.contextmanager
def jvp_neurons(model: nn.Module) -> Iterator[nn.Module]:
    """Run every SpikingJelly ``LIFNode`` of ``model`` through :func:`lif_multi_step_torch` in the block."""
    nodes = [m for m in model.modules() if isinstance(m, neuron.LIFNode)]
    for m in nodes:
        if m.step_mode != "m":
            raise ValueError(f"forward-mode AD supports multi-step LIF nodes (step_mode='m'), got "
                             f"step_mode={m.step_mode!r}")
        if getattr(m, "store_v_seq", False):
            raise ValueError("forward-mode AD does not store v_seq; build the LIF with store_v_seq=False")
        surrogate_spike(torch.zeros(1), m.surrogate_function)  # one clear error before the forward
    try:
        for m in nodes:
            m.multi_step_forward = (lambda x_seq, _m=m: lif_multi_step_torch(_m, x_seq))  # instance override
        yield model
    finally:
        for m in nodes:
            m.__dict__.pop("multi_step_forward", None)
