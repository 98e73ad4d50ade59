"""The batched perturbation engine's public name (README, docs/performance.md): its home is
``szo.evaluators`` (``szo.evaluators.batched``); this package only hands its names on.

>>> from szo.engine import BatchedEvaluator
>>> ev = BatchedEvaluator(model, tet_loss)
>>> losses = ev.losses(x, y, (theta0, P_t, U, mu))   # == the probe loop's losses, one folded forward
"""
from ..evaluators import (
                          ENGINES,
                          Batch,
                          BatchedEvaluator,
                          BatchedProbeEvaluator,
                          available_memory_bytes,
                          batch_closure,
                          build_evaluator,
)

__all__ = ["ENGINES", "Batch", "BatchedEvaluator", "BatchedProbeEvaluator", "available_memory_bytes", "batch_closure",
           "build_evaluator"]
