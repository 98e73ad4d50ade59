"""Multi-process SZO on torch.distributed (gloo on CPU, NCCL on GPU).

``torchrun --nproc_per_node=N -m szo recipe NAME ...`` sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; :func:`init_from_env` turns them into a process group. SZO then runs
data-parallel (each rank evaluates every probe on its shard of the global batch; the 2k probe
losses are all-reduced) or perturbation-parallel (each rank evaluates a slice of the probes on the
full batch), see ``szo.optim.SZO(distributed=...)``. Parameters are broadcast once at start-up
and then stay in sync because every rank applies the identical update.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "RankFailure",
    "init_from_env",
    "is_main",
    "get_info",
    "broadcast_parameters",
    "parameters_in_sync",
    "guard",
    "shutdown",
]


class RankFailure(RuntimeError):
    """A peer process died or stopped answering; the run can be continued with ``--resume``."""


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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if dist.is_initialized():
        return get_info()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; valid: gloo, nccl")
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    info = get_info()
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    return info


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (once, at start-up)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src)


@torch.no_grad()
def parameters_in_sync(model: nn.Module) -> bool:
    """Check (cheaply, one all-reduce of 2 numbers) that all ranks hold the same parameters."""
    vec = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    sig = torch.stack([vec.sum(), (vec * torch.arange(1, vec.numel() + 1, dtype=torch.float64)).sum()])
    lo, hi = sig.clone(), sig.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


@contextlib.contextmanager
def guard():
    """Turn a lost peer (closed connection, timeout) into one clear :class:`RankFailure`."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError if hasattr(dist, "DistBackendError") else RuntimeError) as e:
        msg = str(e)
        if any(s in msg.lower() for s in ("connection", "timed out", "timeout", "peer", "closed", "broken pipe")):
            info = get_info()
            raise RankFailure(
                f"rank {info.rank}/{info.world_size}: a peer process stopped answering ({msg.splitlines()[0]}); "
                "stopping. Restart the same command with --resume to continue from the last checkpoint."
            ) from e
        raise


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
