"""Batched perturbation engine: evaluate many perturbed copies of a model in one pass.

>>> from szo.engine import BatchedEvaluator
>>> ev = BatchedEvaluator(model, tet_loss)
>>> losses = ev.losses(x, y, (theta0, P_t, U, mu))   # == the probe loop's losses, one folded forward

``BatchedProbeEvaluator`` is the same engine as a ``szo.zo`` probe evaluator (``SZO(engine="batched")``).
"""
from .batched import ENGINES, BatchedEvaluator, BatchedProbeEvaluator, available_memory_bytes, batch_closure

__all__ = ["ENGINES", "BatchedEvaluator", "BatchedProbeEvaluator", "available_memory_bytes", "batch_closure"]
