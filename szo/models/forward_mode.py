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
import inspect
from typing import Iterator

import torch
from spikingjelly.activation_based import neuron
from spikingjelly.activation_based.neuron import BaseNode
from torch import nn

__all__ = ["jvp_neurons", "lif_multi_step_torch", "surrogate_spike", "ForwardModeSurrogate"]


def _hyperparameters(fn, surrogate: nn.Module, skip: int) -> tuple | None:
    """The surrogate's hyperparameters in the order ``fn`` takes them after its first ``skip`` arguments
    (``alpha``; ``w, c``; ``leak, k``; ``alpha, beta``), read from its public attributes; None when ``fn``
    does not name them (SpikingJelly's base class: ``primitive_function(x, **kwargs)``, not implemented)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or not all(
            hasattr(surrogate, p.name) for p in params):
        return None
    return tuple(getattr(surrogate, p.name) for p in params)


class _RuleSpike(torch.autograd.Function):
    """Heaviside(x) whose tangent and gradient are a surrogate's own backward rule applied to them
    (SpikingJelly's static ``backward(grad, x, *hyperparameters)``)."""

    @staticmethod
    def forward(x, rule, args):
        return (x >= 0).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.rule, ctx.args = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def jvp(ctx, dx, _rule, _args):
        (x,) = ctx.saved_tensors
        return ctx.rule(dx, x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ctx.rule(grad, x, *ctx.args), None, None


def _spike_rule(surrogate: nn.Module):
    """``x -> spike`` with a forward-mode rule for one SpikingJelly surrogate: its own backward rule
    (:class:`_RuleSpike`: the derivative SpikingJelly's backward uses, exactly) where it has one named by
    its hyperparameters, else its primitive function g (``H(x) + g(x) - g(x).detach()``, S2NN); one
    ValueError for a surrogate with neither, or one not in spiking mode."""
    name = type(surrogate).__name__
    if not getattr(surrogate, "spiking", True):
        raise ValueError(f"forward-mode AD needs a SpikingJelly surrogate in spiking mode; {name} has spiking=False "
                         "(it outputs its primitive function, not spikes)")
    rule = getattr(type(surrogate), "backward", None)  # SpikingJelly's static backward(grad, x, ...), not Module's
    args = None if rule is None else _hyperparameters(rule, surrogate, 2)
    if args is not None:
        return lambda x: _RuleSpike.apply(x, rule, args)
    prim = getattr(type(surrogate), "primitive_function", None)
    args = None if prim is None else _hyperparameters(prim, surrogate, 1)
    if args is not None:
        def spike(x: torch.Tensor) -> torch.Tensor:
            g = prim(x, *args)
            return (x >= 0).to(x.dtype) + (g - g.detach())
        return spike
    raise ValueError(f"forward-mode AD needs a SpikingJelly surrogate with a backward rule or a primitive function "
                     f"named by its hyperparameters; {name} has neither")


def surrogate_spike(x: torch.Tensor, surrogate: nn.Module) -> torch.Tensor:
    """Heaviside(x) in value, surrogate derivative in forward- and reverse-mode AD."""
    return _spike_rule(surrogate)(x)


def lif_multi_step_torch(node: neuron.LIFNode, x_seq: torch.Tensor) -> torch.Tensor:
    """One multi-step LIF forward in plain torch ops (SpikingJelly's LIF equations), state in ``node.v``."""
    v = node.v
    if not isinstance(v, torch.Tensor):
        v = torch.full_like(x_seq[0], float(v))
    tau, v_th, v_reset = node.tau, node.v_threshold, node.v_reset
    spike = _spike_rule(node.surrogate_function)
    spikes = []
    for x in x_seq:
        # charge (neuron.LIFNode.neuronal_charge)
        if node.decay_input:
            h = v + (x - (v if v_reset is None else v - v_reset)) / tau
        else:
            h = v - (v if v_reset is None else v - v_reset) / tau + x
        s = spike(h - v_th)
        s_r = s.detach() if node.detach_reset else s
        v = h - s_r * v_th if v_reset is None else h * (1.0 - s_r) + v_reset * s_r
        spikes.append(s)
    node.v = v
    return torch.stack(spikes)


class ForwardModeSurrogate(nn.Module):
    """A SpikingJelly surrogate's stand-in inside :func:`jvp_neurons`: :func:`surrogate_spike` with
    the original's primitive function (or backward rule) and hyperparameters, found once. The
    original is held outside the module tree, so the model's parameter names (what
    ``functional_call`` swaps) do not change."""

    def __init__(self, surrogate: nn.Module):
        super().__init__()
        self.__dict__["spike"] = _spike_rule(surrogate)  # one clear error before the forward
        self.__dict__["surrogate"] = surrogate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spike(x)


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
