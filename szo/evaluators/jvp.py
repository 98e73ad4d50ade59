"""Forward gradients, :class:`JVPEvaluator`: each probe is one forward-mode pass giving the loss
and its directional derivative along a tangent (:func:`jvp_closure`)."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call

from ..functional import zo as F
from ..zo.guard import ProbeGuard
from .base import Closure, EvaluatorBase

__all__ = ["JVPEvaluator", "jvp_closure"]

# torch's message for an autograd.Function that has no forward-mode (jvp) rule
_NO_JVP = "You must implement the jvp function"


class _CallClosure(nn.Module):
    """``functional_call`` target: holds the model, its forward calls the user's closure."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, closure):
        return closure()


def jvp_closure(model: nn.Module, names: list[str], closure: Closure, tangents: list[torch.Tensor],
                where: str = "closure", dual_context: Callable[[nn.Module], ContextManager] | None = None
                ) -> tuple[float, float]:
    """``(L(theta), grad L . v)`` from one forward pass with tangent ``v`` (one tensor per parameter).

    The parameters become dual tensors (``torch.autograd.forward_ad``) swapped in with
    ``torch.func.functional_call``; ``dual_context(model)`` is held around the pass (the LIF's
    forward-mode surrogate, ``szo.models.forward_mode.jvp_neurons``).
    """
    if getattr(model, "time_chunk", None) is not None:
        raise ValueError("forward gradients need the multi-step forward: the JVP through a time-chunked "
                         "(streaming) forward is not exact; call model.set_streaming(None)")
    wrapper = _CallClosure(model)
    ctx = dual_context(model) if dual_context is not None else contextlib.nullcontext()
    with ctx, fwAD.dual_level():
        duals = {f"model.{n}": fwAD.make_dual(p.detach(), t.to(p.dtype))
                 for n, p, t in zip(names, model.parameters(), tangents)}
        try:
            value = functional_call(wrapper, duals, (closure,))
        except RuntimeError as e:  # an autograd.Function without a forward-mode rule on the way
            if _NO_JVP not in str(e):
                raise
            raise ValueError(f"forward gradients need forward-mode AD through every operation of the forward, and "
                             f"{where} ran one without it (torch: {str(e).splitlines()[0]}); szo gives SpikingJelly's "
                             f"neurons a forward-mode surrogate (szo.models.forward_mode); for another custom "
                             f"operation use a zeroth-order method (szo-cge, zo-rge, ...)") from None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where} must return the loss as a tensor for a forward gradient, "
                             f"got {type(value).__name__}")
        primal, tangent = fwAD.unpack_dual(value)
        loss = F.check_loss(primal, where)
        if tangent is None:
            raise ValueError(f"{where}'s loss does not depend on the parameters in forward mode "
                             "(did the closure detach it or call .item()?)")
        return loss, F.check_loss(tangent, f"{where} (directional derivative)")


class JVPEvaluator(EvaluatorBase):
    """Forward-gradient probes: ``q`` JVP passes, each the loss and ``grad L . v_j`` for a tangent.

    BN running statistics: every pass starts from the step's statistics, which become their mean
    over the passes (the JVP primal is itself an unperturbed forward of theta_t, ``probe-mean``).
    """

    def __init__(self, model: nn.Module, names: list[str], who: str,
                 dual_context: Callable[[nn.Module], ContextManager] | None = None):
        super().__init__(ProbeGuard(model, who, bn_update="probe-mean"))
        self.model = model
        self.names = names
        self.dual_context = dual_context

    def run(self, closure: Closure, tangents: Callable[[int], list[torch.Tensor]], q: int, *,
            label: str = "tangent") -> tuple[torch.Tensor, torch.Tensor]:
        """``(losses [q], jvps [q])`` (float64) for the tangents ``tangents(j)``, ``j < q``."""
        losses = torch.empty(q, dtype=torch.float64)
        jvps = torch.empty(q, dtype=torch.float64)
        guard = self.guard
        checked = lambda: guard.call(closure)  # noqa: E731  (a closure that runs backward: one line)
        with guard.watch():
            for j in range(q):
                guard.bn.restore()
                guard.random.restore()
                guard.reset()
                losses[j], jvps[j] = jvp_closure(self.model, self.names, checked, tangents(j),
                                                 f"closure ({label} {j + 1}/{q})", self.dual_context)
                guard.bn.accumulate()
        return losses, jvps
