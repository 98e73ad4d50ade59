"""Multi-process SZO on torch.distributed (gloo on CPU, NCCL on GPU).

``torchrun --nproc_per_node=N -m szo recipe NAME ...`` sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; :func:`launch` (used by the CLI) turns them into a process group
with a bounded timeout. SZO then runs

* data-parallel (``mode="data"``): every rank evaluates every probe on its contiguous shard of
  the same global batch (:meth:`Parallel.shard`); the probe losses are all-reduced. With
  BatchNorm in train mode, each BN layer's batch statistics are also all-reduced per probe
  (:class:`SyncBatchNorm`, ``2C + 1`` float64 per layer), so the run computes the objective of
  the one-process run with the global batch (equal to rounding in float64; in float32 the
  shard-wise sums round differently and a spiking net amplifies that, as it amplifies the
  float32-vs-float64 difference of one process: docs/distributed.md); without sync BN each
  shard would be normalised by its own statistics (a different objective, like DDP without SyncBN).
* perturbation-parallel (``mode="perturbation"``): every rank evaluates a slice of the probes
  on the full batch; only the probe losses cross the network.

The probes of a step run in ``szo.evaluators.DistributedEvaluator``; see
``szo.optim.SZO(probes=ProbePath(distributed=...))``. Parameters are broadcast once at start-up and then stay
in sync because every rank applies the identical update (checked once per epoch by
:func:`parameters_in_sync`). Only rank 0 writes files and logs (:func:`is_main`).

A rank that dies closes its connections: the others' next collective fails and :func:`guard`
turns that into one :class:`RankFailure` line; a rank that hangs is caught by the process-group
timeout (``distributed.timeout_s``). torchrun also stops the remaining workers (SIGTERM), which
:func:`launch` turns into the same kind of one-line error. ``--resume`` continues from rank 0's
last checkpoint, which rank 0 broadcasts to every rank (no shared file system needed).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.exits import RankFailure, env_world_size
from szo.zo.comm import all_reduce_, comm_device
from szo.zo.path import MODES, ProbePath

__all__ = [
    "DistInfo",
    "Parallel",
    "RankFailure",
    "SyncBatchNorm",
    "MODES",
    "init_from_env",
    "launch",
    "is_main",
    "get_info",
    "env_world_size",
    "broadcast_parameters",
    "parameters_in_sync",
    "all_reduce_",
    "guard",
    "shutdown",
    "broadcast_bytes",
    "main_decides",
]



@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def get_info() -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())
    return DistInfo()


def is_main() -> bool:
    """True on rank 0 (and in single-process runs): only it logs and writes checkpoints."""
    return get_info().rank == 0


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> DistInfo:
    """Initialise the default process group from torchrun's environment; no-op for a single process."""
    world = env_world_size()
    if world <= 1:
        return DistInfo()
    if dist.is_initialized():
        return get_info()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; valid: gloo, nccl")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return get_info()


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> int:
    """Copy rank ``src``'s parameters and buffers to every rank (once, at start-up); returns bytes."""
    sent = 0
    dev = comm_device(group)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device == dev:
            dist.broadcast(t.data, src=src, group=group)
        else:
            buf = t.data.to(dev)
            dist.broadcast(buf, src=src, group=group)
            t.data.copy_(buf)
        sent += t.numel() * t.element_size()
    return sent


@torch.no_grad()
def parameters_in_sync(model: nn.Module, group=None) -> bool:
    """Check (cheaply, one all-reduce of 4 numbers) that all ranks hold the same parameters."""
    sig = torch.zeros(2, dtype=torch.float64)
    off = 0
    for p in model.parameters():
        v = p.detach().reshape(-1).double()
        w = torch.arange(off + 1, off + v.numel() + 1, dtype=torch.float64, device=v.device)
        sig[0] += float(v.sum())
        sig[1] += float((v * w).sum())
        off += v.numel()
    both = torch.cat([sig, -sig]).to(comm_device(group))  # MIN of (sig, -sig) = (min, -max)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    both = both.cpu()
    return bool(torch.equal(both[:2], -both[2:]))


def _short(msg: str, e: BaseException) -> str:
    """First sentence of a backend error, without gloo's ``[path/file.cc:123]`` prefix."""
    line = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0].rstrip(".")


_LOST_PEER = ("connection", "timed out", "timeout", "peer", "closed", "broken pipe", "reset by")


@contextlib.contextmanager
def guard():
    """Turn a lost peer (closed connection, timeout) into one clear :class:`RankFailure`."""
    try:
        yield
    except RankFailure:
        raise
    except RuntimeError as e:  # DistBackendError / DistNetworkError are RuntimeErrors
        msg = str(e)
        if any(s in msg.lower() for s in _LOST_PEER):
            info = get_info()
            raise RankFailure(
                f"rank {info.rank}/{info.world_size}: a peer process stopped answering ({_short(msg, e)}); "
                "stopping. Restart the same command with --resume to continue from the last checkpoint."
            ) from e
        raise


def shutdown() -> None:
    """Leave the process group together: a barrier, then destroy it.

    Without the barrier a rank that finishes first tears its gloo context down while a peer
    still talks to it, and gloo can abort that peer ("terminate called without an active
    exception", SIGABRT) after all its work is done; seen in about 1 of 10 2-process runs.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def launch(device: str = "cpu", timeout_s: float = 300.0) -> Iterator[DistInfo]:
    """The CLI's multi-process context: a no-op for one process; under torchrun it

    * initialises the process group (NCCL for a CUDA device, else gloo) with ``timeout_s``,
    * turns a lost peer into :class:`RankFailure` (:func:`guard`),
    * turns torchrun stopping this worker (SIGTERM, sent when another worker failed) into a
      :class:`RankFailure` with one line instead of a silent kill,
    * destroys the process group on the way out.
    """
    if env_world_size() <= 1:
        yield DistInfo()
        return
    rank, world = os.environ.get("RANK", "?"), env_world_size()

    def _on_sigterm(signum, frame):
        raise RankFailure(f"rank {rank}/{world}: stopped by the launcher (SIGTERM), most likely because another "
                          "rank failed; restart the same command with --resume to continue from the last checkpoint.")

    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with guard():
            info = init_from_env("nccl" if str(device).startswith("cuda") else "gloo", timeout_s)
            yield info
    except BaseException:
        # this rank is already on its way out with one error line: a SIGTERM from torchrun
        # (which stops the other workers when one fails) must not cut that short. The group
        # may be broken, so it is not destroyed (that could block on the lost peer).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise
    signal.signal(signal.SIGTERM, old)
    shutdown()


def broadcast_bytes(data: bytes | None, group=None) -> bytes | None:
    """Rank 0's ``data`` (or None) on every rank: a header ``[present, length]`` then the bytes.
    Other ranks' ``data`` is ignored. A single process gets ``data`` back."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return data
    main = dist.get_rank(group) == 0
    dev = comm_device(group)
    head = torch.tensor([0, 0], dtype=torch.int64)
    if main and data is not None:
        head = torch.tensor([1, len(data)], dtype=torch.int64)
    head = head.to(dev)
    dist.broadcast(head, src=0, group=group)
    present, n = (int(v) for v in head.tolist())
    if not present:
        return None
    if main:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        b = buf.to(dev)
        dist.broadcast(b, src=0, group=group)
        buf = b.cpu()
    return bytes(buf.numpy().tobytes()) if not main else data


def main_decides(fn, group=None) -> bytes | None:
    """Run ``fn() -> bytes | None`` on rank 0 only and return its result on every rank; a
    ``ValueError`` / ``FileNotFoundError`` it raises is raised (as ``ValueError``, same line)
    on every rank, so that a check only rank 0 can make (its run directory, its checkpoint)
    stops all ranks with one clear line instead of leaving them waiting for a collective.
    A single process just calls ``fn``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return fn()
    payload = None
    if dist.get_rank(group) == 0:
        try:
            got = fn()
            payload = b"N" if got is None else b"O" + got
        except (ValueError, FileNotFoundError) as e:
            payload = b"E" + str(e).encode("utf-8")
            err = e
        else:
            err = None
    got = broadcast_bytes(payload, group) or b"N"  # rank 0 always sends a payload
    if got[:1] == b"E":
        if dist.get_rank(group) == 0 and err is not None:
            raise err
        raise ValueError(got[1:].decode("utf-8"))
    return None if got[:1] == b"N" else got[1:]


# ----------------------------------------------------------------------------- sync BN
class SyncBatchNorm:
    """Context manager: BatchNorm layers in train mode normalise with the statistics of the
    global batch (all ranks' shards), as one process with the whole batch would.

    Works on CPU (gloo) and GPU (NCCL), for ``torch.nn`` and SpikingJelly (multi-step) BN
    layers, without replacing modules: a forward pre-hook all-reduces the shard's per-channel
    ``[sum, sum of squares]`` (float64) and the sample count, puts the global mean and biased
    variance into the running-statistic buffers and switches the layer to eval mode for that
    call; the forward hook switches it back and applies the usual running-statistics update
    (momentum, unbiased variance, ``num_batches_tracked``). Every rank must run the same
    forwards (the same collectives in the same order). ``bytes`` counts the payloads.
    """

    def __init__(self, model: nn.Module, group=None):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self.group = group
        self.bytes = 0
        self._handles: list = []
        self._pending: dict[int, tuple] = {}

    @property
    def active(self) -> bool:
        return any(m.training for m in self.layers)

    def __enter__(self) -> "SyncBatchNorm":
        for m in self.layers:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.layers:  # a forward that raised: put the layer back as it was
            if id(m) in self._pending:
                self._undo(m, self._pending.pop(id(m))[0])  # entry = (saved, mean, var, n)

    @staticmethod
    def _undo(m: _BatchNorm, saved: tuple) -> None:
        training, rm, rv, tracked = saved
        m.training = training
        if tracked:
            m.running_mean.copy_(rm)
            m.running_var.copy_(rv)
        else:
            m.running_mean, m.running_var = None, None

    @torch.no_grad()
    def _pre(self, m: _BatchNorm, args: tuple):
        if not m.training:
            return None
        x = args[0]
        if getattr(m, "step_mode", "s") == "m":  # SpikingJelly multi-step: [T, N, C, ...]
            x = x.flatten(0, 1)
        if x.dim() < 2:
            raise ValueError(f"BatchNorm input must be [N, C, ...], got shape {tuple(args[0].shape)}")
        dims = [0] + list(range(2, x.dim()))
        xd = x.double()
        n_local = x.numel() // x.shape[1]
        buf = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                         torch.tensor([float(n_local)], dtype=torch.float64, device=x.device)])
        self.bytes += all_reduce_(buf, self.group)
        n = float(buf[-1])
        if n <= 1:
            raise ValueError(f"BatchNorm in train mode needs more than 1 value per channel over all ranks, got {n:.0f}")
        C = x.shape[1]
        mean = buf[:C] / n
        var = (buf[C:2 * C] / n - mean * mean).clamp_(min=0.0)
        tracked = m.running_mean is not None and m.running_var is not None
        if tracked:
            saved = (True, m.running_mean.clone(), m.running_var.clone(), True)
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
        else:
            saved = (True, None, None, False)
            m.running_mean, m.running_var = mean.to(x.dtype), var.to(x.dtype)
        self._pending[id(m)] = (saved, mean, var, n)
        m.training = False  # normalise with the buffers = the global batch statistics
        return None

    @torch.no_grad()
    def _post(self, m: _BatchNorm, args: tuple, out):
        entry = self._pending.pop(id(m), None)
        if entry is None:
            return None
        saved, mean, var, n = entry
        self._undo(m, saved)
        if saved[3]:  # running statistics: the update nn.BatchNorm makes in train mode
            m.num_batches_tracked.add_(1)
            f = (1.0 / float(m.num_batches_tracked)) if m.momentum is None else m.momentum
            m.running_mean.copy_((1.0 - f) * m.running_mean.double() + f * mean)
            m.running_var.copy_((1.0 - f) * m.running_var.double() + f * var * (n / (n - 1.0)))
        return None


# ----------------------------------------------------------------------------- runs
@dataclass
class Parallel:
    """What the trainer needs to run one recipe on all ranks of the default process group.

    ``mode``: ``"data"`` (shard every global batch) or ``"perturbation"`` (split the probes);
    ``sync_bn``: data mode only, see :class:`SyncBatchNorm`. ``startup_bytes`` counts the
    one-off broadcasts (checkpoint on resume, parameters and buffers).
    """

    mode: str = "data"
    sync_bn: bool = True
    group: object = None
    info: DistInfo = field(default_factory=get_info)
    startup_bytes: int = 0

    def __post_init__(self) -> None:
        ProbePath(distributed=self.mode).check()  # the mode is one of MODES
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("multi-process training needs an initialised torch.distributed process group "
                             "(launch with torchrun)")

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def enabled(self) -> bool:
        return self.info.enabled

    @property
    def is_main(self) -> bool:
        return self.info.rank == 0

    @property
    def shards_batches(self) -> bool:
        return self.mode == "data"

    def shard_bounds(self, n: int) -> tuple[int, int]:
        """This rank's contiguous slice ``[lo, hi)`` of ``n`` items (sizes differ by at most 1)."""
        base, extra = divmod(n, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def shard(self, batch: Sequence[int]) -> list[int]:
        lo, hi = self.shard_bounds(len(batch))
        return list(batch[lo:hi])

    def check_batches(self, batch_size: int, n_samples: int, steps_per_epoch: int | None) -> None:
        """Data mode: every global batch must split into non-empty, equal-sized shards
        (the last, partial batch of an epoch may differ by one sample per shard)."""
        if not self.shards_batches:
            return
        W = self.world_size
        if batch_size % W:
            raise ValueError(f"data-parallel SZO splits every batch over the {W} processes: the batch size "
                             f"{batch_size} must be a multiple of {W} (e.g. {max(W, batch_size - batch_size % W)} "
                             f"or {batch_size + W - batch_size % W}; set data.batch_size), or use "
                             f"distributed.mode=perturbation")
        n_batches = -(-n_samples // batch_size)
        last = n_samples - (n_batches - 1) * batch_size
        if (steps_per_epoch is None or steps_per_epoch >= n_batches) and last < W:
            raise ValueError(f"the last batch of an epoch holds {last} sample(s), fewer than the {W} processes; "
                             f"choose a data.batch_size that leaves at least {W} (or none) of the "
                             f"{n_samples} samples for the last batch")

    def sum_(self, values: Sequence[float]) -> list[float]:
        """All-reduce (sum) a few bookkeeping numbers (float64)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        all_reduce_(t, self.group)
        return t.tolist()

    def broadcast_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0's ``data`` (or None) on every rank (see :func:`broadcast_bytes`)."""
        out = broadcast_bytes(data, self.group)
        self.startup_bytes += (len(out) if out is not None else 0) + 16
        return out

    def broadcast_model(self, model: nn.Module) -> None:
        self.startup_bytes += broadcast_parameters(model, group=self.group)

    def check_in_sync(self, model: nn.Module) -> None:
        if not parameters_in_sync(model, self.group):
            raise RuntimeError("the parameters differ between ranks although every rank applied the same update; "
                               "is the forward pass non-deterministic across processes?")

    def describe(self) -> dict:
        return {"world_size": self.world_size, "mode": self.mode, "backend": self.info.backend,
                "sync_bn": bool(self.sync_bn and self.mode == "data")}
