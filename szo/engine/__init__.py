"""Batched perturbation engine: evaluate many perturbed copies of a model in one pass.

>>> from szo.engine import BatchedEvaluator
>>> ev = BatchedEvaluator(model, tet_loss)
>>> losses = ev.losses(x, y, (theta0, P_t, U, mu))   # == SZO.evaluate_plan, one folded forward
"""
from .batched import (
    ENGINES,
    BatchedEvaluator,
    BatchedPlanEvaluator,
    available_memory_bytes,
    batch_closure,
    make_plan_evaluator,
)

__all__ = ["ENGINES", "BatchedEvaluator", "BatchedPlanEvaluator", "available_memory_bytes", "batch_closure",
           "make_plan_evaluator"]
