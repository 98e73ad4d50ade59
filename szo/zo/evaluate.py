"""Evaluators: how the probes of a plan run. One protocol, several implementations.

* :class:`LoopEvaluator` -- THE probe loop: for each probe of the plan, the step's BN running
  statistics put back (``szo.zo.bn``), the neurons reset, the model moved to the probe by the
  space, the closure run and its loss checked, and under ``bn_update="probe-mean"`` the probe's
  statistics added to the step's mean; the first step's probes are watched for train-mode BN /
  stateful modules the optimizer does not know (``ProbeGuard.watch``); the parameters are
  restored exactly afterwards, whatever happened.
* ``szo.engine.BatchedEvaluator`` -- the same plan as folded forwards (one per chunk of probes).
* ``szo.distributed.DistributedEvaluator`` -- the loop on several processes (a slice of the
  probes, or a shard of the batch, per rank; losses all-reduced).
* :class:`JVPEvaluator` -- forward gradients: each probe is one forward-mode pass giving the
  loss and its directional derivative along a tangent.

An optimizer runs its probes inside ``with evaluator.session():`` (one per step: the BN
snapshot at the start, the BN commit / restore at the end, a restore on any error; autocast's
weight cache off, ``szo.precision.fresh_casts``: the probes move the parameters in place), and
after its update asks ``evaluator.unperturbed(closure)`` for the BN forward of ``bn_update="recompute"``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call

from ..functional import zo as F
from ..precision import fresh_casts, refuse_cached_parametrizations
from .guard import ProbeGuard
from .plans import Plan, coord_one_point_plan
from .space import Space, Still

__all__ = ["ProbeEvaluator", "EvaluatorBase", "LoopEvaluator", "JVPEvaluator", "jvp_closure"]

Closure = Callable[[], torch.Tensor]

# torch's message for an autograd.Function that has no forward-mode (jvp) rule
_NO_JVP = "You must implement the jvp function"


@runtime_checkable
class ProbeEvaluator(Protocol):
    """Runs a plan's probes and returns their losses (float64 ``[m]``, probe order)."""

    guard: ProbeGuard
    distributed: str | None
    bytes_communicated: int

    @property
    def sees_outputs(self) -> bool:
        """Every probe calls the closure (whose outputs a trainer can read)."""
        ...

    def session(self) -> ContextManager: ...

    def run(self, closure: Closure, space: Space, plan: Plan, *, label: str = "probe") -> torch.Tensor: ...

    def unperturbed(self, closure: Closure) -> float: ...


class EvaluatorBase:
    """What every evaluator shares: the step scope around the probes and the BN forward."""

    distributed: str | None = None
    sees_outputs = True
    path = None
    """The probe path it was built from (``szo.engine.build_evaluator`` sets it; None: built directly).
    Every step checks it again against the model's forward as it is then: a forward switched to CUDA
    graphs or torch.compile after the optimizer was built is refused before its probes run."""

    def __init__(self, guard: ProbeGuard):
        self.guard = guard
        self.bytes_communicated = 0

    @contextlib.contextmanager
    def session(self) -> Iterator["EvaluatorBase"]:
        """One step's probes: BN snapshot (and the random state every probe replays) before, commit /
        restore after, restore on error; each probe casts the parameters where they are, whatever
        autocast block encloses the step."""
        if self.path is not None:
            self.path.on(self.guard.model).check()
        refuse_cached_parametrizations(self.guard.model, self.guard.who)
        self.guard.begin_step()
        with fresh_casts():
            try:
                yield self
            except BaseException:
                self.guard.bn.restore()
                raise
        self._end_session()

    def _end_session(self) -> None:
        self.guard.end_probes()

    def unperturbed(self, closure: Closure) -> float:
        """The unperturbed train-mode forward of the updated model (``bn_update="recompute"``)."""
        return self.guard.unperturbed_forward(closure)


class LoopEvaluator(EvaluatorBase):
    """The probe loop: one closure call per probe (see the module docstring)."""

    # ------------------------------------------------------------------ the loop
    def _rows(self, m: int) -> Sequence[int]:
        """The probes this process evaluates."""
        return range(m)

    def _context(self) -> ContextManager:
        """Held around the probes (the distributed evaluator's synchronised BN)."""
        return contextlib.nullcontext()

    def _reduce(self, losses: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The step's losses from this process' (the distributed evaluator all-reduces them)."""
        return losses

    @torch.no_grad()
    def run(self, closure: Closure, space: Space, plan: Plan, *, label: str = "probe",
            per_sample: bool = False) -> torch.Tensor:
        """Loss of the closure at every probe of ``plan`` (``[m]``; ``per_sample``: the closure
        returns one loss per sample and the result is ``[m, N]``); the space is back at its point
        afterwards."""
        guard, m = self.guard, plan.m
        losses: torch.Tensor | None = None if per_sample else torch.zeros(m, dtype=torch.float64)
        rows = self._rows(m)
        mover = space.mover(plan)
        try:
            with self._context(), guard.watch():
                for j in rows:
                    mover.move(j)
                    v = guard.probe(closure, f"closure ({label} {j + 1}/{m})", per_sample)
                    if losses is None:  # per sample: [m, N], N known after the first probe
                        losses = torch.zeros(m, v.numel(), dtype=torch.float64)
                    losses[j] = v
        finally:
            mover.restore()
        return self._reduce(losses, rows)

    def centre(self, closure: Closure, *, label: str = "clean forward", per_sample: bool = False
               ) -> "float | torch.Tensor":
        """The closure's loss at the current point, run as a probe (the step's BN statistics, reset
        neurons, the loss check): a float, or the float64 ``[N]`` per-sample losses."""
        out = self.run(closure, Still(), coord_one_point_plan(0, 1.0), label=label, per_sample=per_sample)[0]
        return out if per_sample else float(out)


# ---------------------------------------------------------------------- forward gradients
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
