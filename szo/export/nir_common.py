"""What szo's NIR export (:mod:`szo.export.nir_export`) and import (:mod:`szo.export.nir_import`)
share: the time step written into time constants, the format tag, the reset kinds, the sum pool
and threshold modules both run, and the small readers of NIR metadata and errors."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["DEFAULT_DT", "FORMAT", "RESETS", "SumPool2d", "Threshold", "meta_str", "nir_modules", "why"]

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


def why(exc: BaseException) -> str:
    """One phrase for an error raised while parsing a NIR file."""
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return f"{type(exc).__name__}: {exc}"


def meta_str(meta: dict[str, Any], key: str, default: str) -> str:
    """``meta[key]`` as a str (HDF5 gives bytes back), ``default`` when absent."""
    v = meta.get(key, default)
    return v.decode() if isinstance(v, bytes) else str(v)

