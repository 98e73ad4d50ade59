"""The one collective the forward-only core needs: an in-place float sum all-reduce on any device.

Evaluators that run on several processes (``szo.distributed``) and the BN freezer's
perturbation-parallel commit (``szo.zo.bn``) send their probe losses and statistic sums
through :func:`all_reduce_`, which also returns the payload size (``bytes_communicated``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_", "comm_device", "rank_and_world"]


def comm_device(group=None) -> torch.device:
    """Where collective buffers must live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(t: torch.Tensor, group=None) -> int:
    """In-place sum all-reduce of ``t`` on any device (moved to the GPU and back for NCCL).

    Returns the payload size in bytes (what ``bytes_communicated`` counts).
    """
    dev = comm_device(group)
    if t.device == dev:
        dist.all_reduce(t, group=group)
    else:
        buf = t.to(dev)
        dist.all_reduce(buf, group=group)
        t.copy_(buf)
    return t.numel() * t.element_size()


def rank_and_world(group=None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (the default group when None)."""
    return dist.get_rank(group), dist.get_world_size(group)
