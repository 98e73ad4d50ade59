"""Forward-mode AD (JVP) through SpikingJelly's spiking neurons and their surrogates.

SpikingJelly's neurons run as custom ops (``sj_lif::forward``, ``sj_if``, ``sj_plif``) and its
surrogates are ``torch.autograd.Function``s with a backward rule only, so neither supports
forward-mode AD (``torch.autograd.forward_ad`` / ``torch.func.jvp``: "You must implement the jvp
function"). Inside :func:`jvp_neurons` every spike is instead

    s = H(x) + g(x) - g(x).detach()        g = the surrogate's primitive function

i.e. exactly the Heaviside step in value (``g(x) - g(x)`` is 0 in floating point), and with
tangent ``g'(x) dx``, the surrogate derivative SpikingJelly's backward uses. Two ways, one spike:

* every multi-step ``LIFNode`` (szo's paper neuron, whose no-grad fast path would bypass the
  tangent) runs a pure-torch step of the same neuron, :func:`lif_multi_step_torch`;
* every other SpikingJelly neuron (``BaseNode``: ``IFNode`` -- the tutorial network's --,
  ``ParametricLIFNode``, a single-step ``LIFNode``, ...) keeps its own forward, with its surrogate
  replaced by :class:`ForwardModeSurrogate`. SpikingJelly's functional neurons
  (``functional.if_multi_step`` & co.) run "the Torch reference formulas" for a surrogate that is
  not one of their built-ins, so the neuron's own charge / fire / reset equations run in torch ops
  and call this spike; PLIF's learnable ``w`` gets its tangent like any parameter.

The directional derivative of a loss through this forward therefore equals autograd's gradient
through SpikingJelly's neurons, dotted with the tangent (tests/models/test_forward_mode.py checks
it to 1e-5 for the LIF, IF and PLIF, and that the spikes equal the custom ops').
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from spikingjelly.activation_based import neuron
from spikingjelly.activation_based.neuron import BaseNode
from torch import nn

__all__ = ["jvp_neurons", "lif_multi_step_torch", "surrogate_spike", "ForwardModeSurrogate"]


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


class ForwardModeSurrogate(nn.Module):
    """A SpikingJelly surrogate's stand-in inside :func:`jvp_neurons`: :func:`surrogate_spike` with
    the original's primitive and alpha. The original is held outside the module tree, so the
    model's parameter names (what ``functional_call`` swaps) do not change."""

    def __init__(self, surrogate: nn.Module):
        super().__init__()
        surrogate_spike(torch.zeros(1), surrogate)  # one clear error before the forward
        self.__dict__["surrogate"] = surrogate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return surrogate_spike(x, self.surrogate)


def _lif_override(m: nn.Module) -> bool:
    """``m`` runs :func:`lif_multi_step_torch` (a multi-step LIF), not its own forward."""
    return isinstance(m, neuron.LIFNode) and m.step_mode == "m"


@contextlib.contextmanager
def jvp_neurons(model: nn.Module) -> Iterator[nn.Module]:
    """In the block, every SpikingJelly neuron of ``model`` spikes with a forward-mode rule (module
    docstring): multi-step ``LIFNode`` through :func:`lif_multi_step_torch`, every other
    ``BaseNode`` with its surrogate replaced by :class:`ForwardModeSurrogate`."""
    lifs = [m for m in model.modules() if _lif_override(m)]
    others = [m for m in model.modules() if isinstance(m, BaseNode) and not _lif_override(m)]
    for m in lifs:
        if getattr(m, "store_v_seq", False):
            raise ValueError("forward-mode AD does not store v_seq; build the LIF with store_v_seq=False")
        surrogate_spike(torch.zeros(1), m.surrogate_function)  # one clear error before the forward
    stand_ins = {m: ForwardModeSurrogate(m.surrogate_function) for m in others}
    try:
        for m in lifs:
            m.multi_step_forward = (lambda x_seq, _m=m: lif_multi_step_torch(_m, x_seq))  # instance override
        for m, sg in stand_ins.items():
            m.surrogate_function = sg
        yield model
    finally:
        for m in lifs:
            m.__dict__.pop("multi_step_forward", None)
        for m, sg in stand_ins.items():
            m.surrogate_function = sg.surrogate
