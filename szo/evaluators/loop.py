"""The probe loop, :class:`LoopEvaluator`: for each probe of the plan, the step's BN running
statistics put back (``szo.zo.bn``), the neurons reset, the model moved to the probe by the space,
the closure run and its loss checked, and under ``bn_update="probe-mean"`` the probe's statistics
added to the step's mean; the first step's probes are watched for train-mode BN / stateful modules
the optimizer does not know (``ProbeGuard.watch``); the parameters are restored exactly afterwards,
whatever happened. The data- and perturbation-parallel evaluator
(``szo.evaluators.distributed``) is this loop on several processes.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Sequence

import torch

from ..zo.plans import Plan, coord_one_point_plan
from ..zo.protocol import Batch
from ..zo.space import Space, Still
from .base import Closure, EvaluatorBase

__all__ = ["LoopEvaluator"]


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
    def run(self, closure: Closure, space: Space, plan: Plan, *, batch: Batch | None = None,
            label: str = "probe", per_sample: bool = False) -> torch.Tensor:
        """Loss of the closure at every probe of ``plan`` (``[m]``; ``per_sample``: the closure
        returns one loss per sample and the result is ``[m, N]``); the space is back at its point
        afterwards. The loop calls the closure: ``batch`` is not read."""
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
