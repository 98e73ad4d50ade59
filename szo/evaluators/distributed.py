"""The probe loop on every rank of a torch.distributed group: :class:`DistributedEvaluator`.

Data mode is also what ``SZO(DDP(model), ...)`` runs by itself: a forward-only step never runs the
backward pass whose gradient all-reduce keeps DDP's replicas equal, so :func:`ddp_path` turns a
``DistributedDataParallel`` model into data mode on its process group, and
:func:`check_process_group` refuses, in one line, a probe path that would run alone on one rank of
a multi-process group (Lightning's ``ddp`` / ``ddp_spawn``: the replicas would drift apart).
Launch, process groups, :class:`~szo.distributed.SyncBatchNorm` and run bookkeeping stay in
``szo.distributed``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed import SyncBatchNorm
from ..methods import list_methods
from ..zo.comm import all_reduce_, rank_and_world
from ..zo.guard import ProbeGuard
from ..zo.path import ProbePath
from .loop import LoopEvaluator

__all__ = ["DistributedEvaluator", "ddp_path", "check_process_group"]


class DistributedEvaluator(LoopEvaluator):
    """The probe loop on every rank of a torch.distributed group (a probe evaluator), for a path with
    ``distributed`` set (its ``process_group``, or the default group, and its ``sync_bn``).

    ``"perturbation"``: rank r runs probes ``r, r + W, ...`` on the whole batch; ``"data"``: every
    rank runs all probes on its shard of the batch and the closure returns the shard's MEAN loss
    (the step averages the W ranks' losses: with equal shards that is the batch mean; with unequal
    shards multiply the shard's mean by ``W * n_shard / n``, as ``szo.train.fit`` does) and, with
    ``sync_bn`` and BN in train mode, BN layers normalise with the global batch statistics
    (:class:`SyncBatchNorm`, one all-reduce per BN layer and probe).
    Then the m probe losses (float64) are all-reduced -- never a gradient or a weight tensor --
    and under ``bn_update="probe-mean"`` the BN statistic sums (once per step). Every rank ends
    the step with the same losses, hence the same update. ``bytes_communicated`` counts the
    payloads this rank sent.
    """

    def __init__(self, guard: ProbeGuard, path: ProbePath):
        mode = path.distributed
        if mode is None:
            raise ValueError("DistributedEvaluator runs a path with distributed='data' or 'perturbation'; "
                             "got distributed=None (szo.evaluators.LoopEvaluator runs one process)")
        path.check()  # the mode is one of MODES
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"distributed={mode!r} needs an initialised torch.distributed process "
                             "group (dist.init_process_group, or launch with torchrun)")
        super().__init__(guard, path)
        self.distributed = mode
        self.group = path.process_group
        self.sync_bn = bool(path.sync_bn)
        self._sync: SyncBatchNorm | None = None

    def _sync_bn(self) -> "SyncBatchNorm | None":
        """Data mode with ``sync_bn``, a model and BN in train mode: a synchronised-BN context."""
        if self.distributed != "data" or not self.sync_bn or self.guard.model is None:
            return None
        sbn = SyncBatchNorm(self.guard.model, self.group)
        return sbn if sbn.active else None

    def _rows(self, m: int):
        if self.distributed == "perturbation":
            rank, world = rank_and_world(self.group)
            return range(rank, m, world)
        return range(m)

    def _context(self):
        self._sync = self._sync_bn()
        return self._sync if self._sync is not None else contextlib.nullcontext()

    def _reduce(self, losses: torch.Tensor, rows) -> torch.Tensor:
        if self._sync is not None:
            self.bytes_communicated += self._sync.bytes
            self._sync = None
        self.bytes_communicated += all_reduce_(losses, self.group)
        if self.distributed == "data":
            losses /= rank_and_world(self.group)[1]
        return losses

    def _end_session(self) -> None:
        if self.guard.probe_mean:
            self.bytes_communicated += self.guard.bn.commit(True, self.group)
        else:
            self.guard.bn.restore()

    def unperturbed(self, closure) -> float:
        """The BN forward of theta_{t+1}; in data mode on every shard, its loss all-reduced (the
        batch's), BN statistics synchronised (``sync_bn``) or averaged over the ranks."""
        if self.distributed != "data":
            return self.guard.unperturbed_forward(closure)
        sync = self._sync_bn()
        loss = self.guard.unperturbed_forward(closure, distributed=sync is None, process_group=self.group, sync=sync)
        if sync is not None:
            self.bytes_communicated += sync.bytes
        buf = torch.tensor([loss], dtype=torch.float64)
        self.bytes_communicated += all_reduce_(buf, self.group)
        return float(buf[0]) / rank_and_world(self.group)[1]


# ----------------------------------------------------------------------------- DDP and foreign launchers
def ddp_path(path: ProbePath, model: nn.Module | None, who: str) -> ProbePath:
    """``path`` for ``model``: a ``DistributedDataParallel`` model runs data mode on its process
    group by itself (a forward-only step never calls the backward whose gradient all-reduce keeps
    DDP's replicas equal; data mode averages the probe losses over the ranks instead, so every rank
    applies the same update, equal to the one-process step on the whole batch up to float rounding).
    Each rank's closure returns its shard's mean loss, as it does for DDP. A mode set explicitly is
    kept."""
    if not isinstance(model, DistributedDataParallel) or path.distributed is not None:
        return path
    spec = path.method
    if spec is not None and "data" not in spec.parallel:
        raise ValueError(f"{who} on a DistributedDataParallel model runs data-parallel, and method {spec.name!r} "
                         f"does not run on several processes; data-parallel methods: "
                         f"{', '.join(list_methods(parallel='data'))} (or train the unwrapped model in one process)")
    return path.replace(distributed="data", process_group=model.process_group)


def check_process_group(path: ProbePath, who: str) -> None:
    """One ValueError when ``path`` runs in one process while torch.distributed spans several
    (Lightning's ``ddp`` / ``ddp_spawn``, a ``torchrun`` script): each rank would step on its own
    shard alone and the replicas would drift apart without a word."""
    if path.distributed is not None or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(path.process_group)
    spec = path.method
    if world > 1 and spec is not None and "data" not in spec.parallel:
        raise ValueError(f"torch.distributed runs {world} processes and method {spec.name!r} runs in one: its "
                         "replicas would drift apart; run it without a process group, or use one of "
                         f"{', '.join(list_methods(parallel='data'))} with probes=ProbePath(distributed='data')")
    if world > 1:
        raise ValueError(f"torch.distributed runs {world} processes and {who}'s probes would run on this one "
                         "alone, so the replicas drift apart (a forward-only step has no backward for DDP to "
                         "all-reduce): set probes=ProbePath(distributed='data') (each rank's closure returns "
                         "its shard's mean loss; Lightning ddp / ddp_spawn) or distributed='perturbation' "
                         "(each rank the whole batch), or pass DistributedDataParallel(model)")
