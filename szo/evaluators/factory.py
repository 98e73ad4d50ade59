"""The one factory from a probe path to its evaluator: :func:`build_evaluator`.

``szo.zo.ProbePath`` says how a step's probes run and holds every rule on combining its settings;
this turns it into the evaluator that runs them (``szo.zo.LoopEvaluator``, the batched engine's
:class:`~szo.engine.batched.BatchedProbeEvaluator`, ``szo.distributed.DistributedEvaluator``),
after checking the path as the model runs it (its compile, CUDA graphs, streaming, BN-over-time and
backend settings: ``ProbePath.on``). Every forward-only optimizer builds its evaluator here.
"""
from __future__ import annotations

from torch import nn

from ..distributed import DistributedEvaluator
from ..models.streaming import bn_time_of
from ..zo.evaluate import LoopEvaluator, ProbeEvaluator
from ..zo.guard import ProbeGuard
from ..zo.path import ForwardSettings, ProbePath
from .batched import BatchedProbeEvaluator

__all__ = ["build_evaluator"]


def build_evaluator(path: ProbePath, model: nn.Module | None, who: str) -> ProbeEvaluator:
    """The evaluator of ``path`` for ``model`` (None: an optimizer given parameters only; the loop
    then guards the closure's forwards instead), ``who`` naming the optimizer in its messages. One
    ValueError for a path the model cannot run (``ProbePath.check``)."""
    path = path.on(model)
    if model is not None and not isinstance(model, ForwardSettings):  # a model that does not describe itself
        path = path.replace(bn_time=bn_time_of(model))
    path.check()
    guard = ProbeGuard(model, who, bn_update=path.bn_update, freeze_bn=path.freeze_bn)
    if path.distributed is not None:
        ev = DistributedEvaluator(guard, path.distributed, process_group=path.process_group, sync_bn=path.sync_bn)
    elif path.engine == "batched":
        if model is None:
            raise ValueError(f"engine='batched' folds copies of the model: it needs the model ({who}(model, ...)); "
                             "use engine='loop'")
        ev = BatchedProbeEvaluator(guard, model, chunk=path.chunk)
    else:
        ev = LoopEvaluator(guard)
    ev.path = path  # checked again at every step, against the model's forward as it is then
    return ev
