"""Evaluators: how a step's probes run. One protocol, one factory, several implementations.

* :class:`ProbeEvaluator` (``base``) -- the protocol: ``session()`` around a step's probes,
  ``run(closure, space, plan, *, batch=None)`` -> the probe losses, ``unperturbed(closure)``;
  :class:`EvaluatorBase` the part every evaluator shares;
* :class:`LoopEvaluator` (``loop``) -- THE probe loop, one closure call per probe;
* :class:`BatchedProbeEvaluator` (``batched``) -- the probes folded into copies of the model, one
  forward per chunk of probes, over the step's :class:`Batch` (it never calls the closure);
  :class:`BatchedEvaluator` is the engine on its own;
* :class:`DistributedEvaluator` (``distributed``) -- the loop on several processes: data mode (a
  shard of the batch per rank; what ``SZO(DistributedDataParallel(model), ...)`` runs) or
  perturbation mode (a slice of the probes per rank);
* :class:`JVPEvaluator` (``jvp``) -- forward gradients, one forward-mode pass per tangent;
* :func:`build_evaluator` (``factory``) -- the evaluator of a ``szo.zo.ProbePath``, built with it.

The batch reaches an evaluator explicitly: ``opt.step(closure, batch=Batch(x, y, loss_fn))`` (or
``opt.step(batch=Batch(x, y, loss_fn))``: the step builds the closure from the batch and its model)
hands it to ``run``. Launch, process groups and ``SyncBatchNorm`` are ``szo.distributed``'s.
"""
from ..zo.path import ENGINES
from ..zo.protocol import Batch
from .base import Closure, EvaluatorBase, ProbeEvaluator
from .batched import BatchedEvaluator, BatchedProbeEvaluator, available_memory_bytes, batch_closure
from .distributed import DistributedEvaluator, check_process_group, ddp_path
from .factory import build_evaluator
from .jvp import JVPEvaluator, jvp_closure
from .loop import LoopEvaluator

__all__ = ["Batch", "BatchedEvaluator", "BatchedProbeEvaluator", "Closure", "DistributedEvaluator", "ENGINES",
           "EvaluatorBase", "JVPEvaluator", "LoopEvaluator", "ProbeEvaluator", "available_memory_bytes",
           "batch_closure", "build_evaluator", "check_process_group", "ddp_path", "jvp_closure"]
