"""Batched perturbation engine: evaluate many perturbed copies of a model in one pass.

>>> from szo.engine import BatchedEvaluator
>>> ev = BatchedEvaluator(model, tet_loss)
>>> losses = ev.losses(x, y, (theta0, P_t, U, mu))   # == the probe loop's losses, one folded forward

``BatchedProbeEvaluator`` is the same engine as a ``szo.zo`` probe evaluator
(``SZO(..., probes=ProbePath(engine="batched"))``); :func:`build_evaluator` is the one factory that
turns a ``szo.zo.ProbePath`` into the evaluator that runs it (loop, batched or distributed).
"""
from .batched import ENGINES, BatchedEvaluator, BatchedProbeEvaluator, available_memory_bytes, batch_closure
from .factory import build_evaluator

__all__ = ["ENGINES", "BatchedEvaluator", "BatchedProbeEvaluator", "available_memory_bytes", "batch_closure",
           "build_evaluator"]
