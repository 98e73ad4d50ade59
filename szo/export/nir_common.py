"""What szo's NIR export (:mod:`szo.export.nir_export`) and import (:mod:`szo.export.nir_import`)
share: the time step written into time constants, the format tag, the reset kinds, the modules
of NIR's stateless and delay nodes both run (sum pool, threshold, scale, delay), and the small
readers of NIR metadata and errors."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from spikingjelly.activation_based import base
from torch import nn

__all__ = ["DEFAULT_DT", "FORMAT", "RESETS", "Delay", "Scale", "SumPool2d", "Threshold", "meta_str", "nir_modules",
           "why"]

DEFAULT_DT: float = 1e-4
"""Seconds per time step written into NIR time constants (snnTorch / SpikingJelly convention)."""
FORMAT: str = "szo-nir-1"
"""``graph.metadata["format"]`` of graphs written by :func:`to_nir`."""
RESETS = ("subtract", "value")


def nir_modules():
    """``(nir, nirtorch)``, or one ModuleNotFoundError naming the ``deploy`` extra."""
    try:
        import nir
        import nirtorch
    except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
        raise ModuleNotFoundError(f"NIR exchange needs the 'deploy' extra: pip install 'szo[deploy]' ({exc})") from None
    return nir, nirtorch


class SumPool2d(nn.Module):
    """Multi-step sum pooling (``avg_pool2d`` with ``divisor_override=1``: an exact sum)."""

    def __init__(self, kernel_size, stride, padding) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.avg_pool2d(x_seq.flatten(0, 1), self.kernel_size, self.stride, self.padding,
                                           divisor_override=1)
        return y.unflatten(0, x_seq.shape[:2])


class Threshold(nn.Module):
    """NIR ``Threshold``: ``H(x - threshold)`` (strictly above: ``x > threshold``)."""

    def __init__(self, threshold: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("threshold", torch.as_tensor(np.asarray(threshold, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > self.threshold).to(x.dtype)


class Scale(nn.Module):
    """NIR ``Scale``: ``y = x * scale`` elementwise (``scale``: one sample's shape; a trainable
    synapse weight, like a Linear's)."""

    def __init__(self, scale: np.ndarray) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.as_tensor(np.asarray(scale, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Delay(base.MemoryModule):
    """NIR ``Delay`` ``y(t) = x(t - delay)`` in steps of ``dt``: ``y[t] = x[t - d]`` per element
    (``steps``: ``d``, a non-negative integer per element of one sample), 0 before the first
    input reaches it. Multi-step ``[T, N, *shape]``; the last ``max(d)`` inputs are a memory
    (reset by ``functional.reset_net``, kept between calls for streaming and for cycles, whose
    nodes run one step at a time)."""

    def __init__(self, steps: np.ndarray, dt: float) -> None:
        super().__init__()
        self.register_buffer("steps", torch.as_tensor(np.asarray(steps, dtype=np.int64)))
        self.dt = float(dt)
        self.depth = int(self.steps.max()) if self.steps.numel() else 0
        self.register_memory("history", None)

    def extra_repr(self) -> str:
        return f"shape={list(self.steps.shape)}, max steps={self.depth}, dt={self.dt:g}"

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        if self.depth == 0:
            return x_seq
        hist = self.history if self.history is not None else x_seq.new_zeros(self.depth, *x_seq.shape[1:])
        full = torch.cat([hist, x_seq])  # full[depth + t] = x[t]
        T = x_seq.shape[0]
        t = torch.arange(T, device=x_seq.device).view(T, *([1] * (x_seq.dim() - 1)))
        index = (self.depth + t - self.steps).expand_as(x_seq)  # y[t] = x[t - d] = full[depth + t - d]
        self.history = full[-self.depth:]
        return torch.gather(full, 0, index)


def why(exc: BaseException) -> str:
    """One phrase for an error raised while parsing a NIR file."""
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return f"{type(exc).__name__}: {exc}"


def meta_str(meta: dict[str, Any], key: str, default: str) -> str:
    """``meta[key]`` as a str (HDF5 gives bytes back), ``default`` when absent."""
    v = meta.get(key, default)
    return v.decode() if isinstance(v, bytes) else str(v)

