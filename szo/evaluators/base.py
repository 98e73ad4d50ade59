"""The evaluator protocol and what every evaluator shares.

An evaluator runs a plan's probes and returns their losses. An optimizer runs its probes inside
``with evaluator.session():`` (one per step: the BN snapshot at the start, the BN commit / restore
at the end, a restore on any error; autocast's weight cache off, ``szo.precision.fresh_casts``: the
probes move the parameters in place), gives each ``run`` the step's closure and, explicitly, the
step's batch (``szo.zo.Batch``: what an evaluator that never calls the closure folds the probes
over), and after its update asks ``evaluator.unperturbed(closure)`` for the BN forward of
``bn_update="recompute"``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Protocol, runtime_checkable

import torch

from ..precision import fresh_casts, refuse_cached_parametrizations
from ..zo.guard import ProbeGuard
from ..zo.path import ProbePath
from ..zo.plans import Plan
from ..zo.protocol import Batch
from ..zo.space import Space

__all__ = ["Closure", "ProbeEvaluator", "EvaluatorBase"]

Closure = Callable[[], torch.Tensor]


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

    def run(self, closure: Closure, space: Space, plan: Plan, *, batch: Batch | None = None,
            label: str = "probe") -> torch.Tensor: ...

    def unperturbed(self, closure: Closure) -> float: ...


class EvaluatorBase:
    """What every evaluator shares: the step scope around the probes and the BN forward."""

    distributed: str | None = None
    sees_outputs = True

    def __init__(self, guard: ProbeGuard, path: ProbePath | None = None):
        self.guard = guard
        self.path = path
        """The probe path it was built from (:func:`~szo.evaluators.build_evaluator`; None: built
        directly). Every step checks it again against the model's forward as it is then: a forward
        switched to CUDA graphs or torch.compile after the optimizer was built is refused before its
        probes run."""
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
