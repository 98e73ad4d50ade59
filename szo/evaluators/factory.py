"""The one factory from a probe path to its evaluator: :func:`build_evaluator`.

``szo.zo.ProbePath`` says how a step's probes run and holds every rule on combining its settings;
this turns it into the evaluator that runs them (:class:`~szo.evaluators.loop.LoopEvaluator`,
:class:`~szo.evaluators.batched.BatchedProbeEvaluator`,
:class:`~szo.evaluators.distributed.DistributedEvaluator`), after checking the path as the model
runs it (its compile, CUDA graphs, streaming, BN-over-time and backend settings: ``ProbePath.on``)
and against the process group (a ``DistributedDataParallel`` model runs data mode; a one-process
path on one rank of several is refused). Every forward-only optimizer builds its evaluator here,
with its path.
"""
from __future__ import annotations

from torch import nn

from ..models.streaming import bn_time_of
from ..zo.guard import ProbeGuard
from ..zo.path import ForwardSettings, ProbePath
from .base import ProbeEvaluator
from .batched import BatchedProbeEvaluator
from .distributed import DistributedEvaluator, check_process_group, ddp_path
from .loop import LoopEvaluator

__all__ = ["build_evaluator"]


def build_evaluator(path: ProbePath, model: nn.Module | None, who: str) -> ProbeEvaluator:
    """The evaluator of ``path`` for ``model`` (None: an optimizer given parameters only; the loop
    then guards the closure's forwards instead), ``who`` naming the optimizer in its messages. One
    ValueError for a path the model cannot run (``ProbePath.check``) or one that would let the
    replicas of a multi-process run drift apart."""
    path = ddp_path(path, model, who).on(model)
    if model is not None and not isinstance(model, ForwardSettings):  # a model that does not describe itself
        path = path.replace(bn_time=bn_time_of(model))
    path.check()
    check_process_group(path, who)
    guard = ProbeGuard(model, who, bn_update=path.bn_update, freeze_bn=path.freeze_bn)
    if path.distributed is not None:
        return DistributedEvaluator(guard, path)
    if path.engine == "batched":
        if model is None:
            raise ValueError(f"engine='batched' folds copies of the model: it needs the model ({who}(model, ...)); "
                             "use engine='loop'")
        return BatchedProbeEvaluator(guard, model, path)
    return LoopEvaluator(guard, path)
