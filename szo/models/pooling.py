"""Adaptive average pooling whose small uniform windows are summed as strided slices on the CPU.

PyTorch's CPU ``adaptive_avg_pool2d`` on an NCHW tensor visits every ``H x W`` plane separately; for
the digits ConvNet's ``[T*N, 16, 8, 8] -> 4x4`` pool that is 4,096 tiny planes. When the windows are
uniform (the input size a multiple of the output size) the same averages are ``kh * kw`` strided slices
added in the kernel's own order (window row by row, left to right) and divided by ``kh``, then by
``kw``, as the kernel does: the same values (``torch.equal``; tests/models/test_pooling.py checks it
against the stock op, under the generic kernels too), and a digits forward of 8.91 instead of 9.74 ms
on one thread (docs/performance.md, "Threads"). Everything else (CUDA, a channels-last input, bfloat16
/ float16, a global or non-uniform pool, a window of more than :data:`MAX_WINDOW` elements, autograd)
goes to PyTorch's op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from spikingjelly.activation_based import layer

__all__ = ["MAX_WINDOW", "AdaptiveAvgPool2d", "adaptive_avg_pool2d"]

MAX_WINDOW = 16
"""The largest window (``kh * kw`` elements) summed as slices; beyond it the stock kernel is as fast."""

_EXACT = (torch.float32, torch.float64)
"""Dtypes the kernel sums in their own precision; it sums bfloat16 / float16 in float32, which slices in
their own dtype would not reproduce."""


def _size(out: int | None, size: int) -> int:
    return size if out is None else int(out)


def adaptive_avg_pool2d(x: torch.Tensor, output_size: int | tuple[int | None, int | None]) -> torch.Tensor:
    """``F.adaptive_avg_pool2d(x, output_size)`` for a 4-D ``x``, by strided slices where the module
    docstring says so."""
    oh, ow = (output_size, output_size) if isinstance(output_size, int) else output_size
    h, w = x.shape[-2:]
    oh, ow = _size(oh, h), _size(ow, w)
    if (x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous() or x.dtype not in _EXACT
            or (x.requires_grad and torch.is_grad_enabled()) or oh < 1 or ow < 1 or h % oh or w % ow):
        return F.adaptive_avg_pool2d(x, (oh, ow))
    kh, kw = h // oh, w // ow
    if not 2 <= kh * kw <= MAX_WINDOW or oh * ow == 1:  # a global pool: PyTorch reduces it another way
        return F.adaptive_avg_pool2d(x, (oh, ow))
    acc: torch.Tensor | None = None
    for i in range(kh):  # the kernel's order: the window's rows, each left to right
        for j in range(kw):
            s = x[..., i::kh, j::kw]
            acc = s.clone(memory_format=torch.contiguous_format) if acc is None else acc.add_(s)
    assert acc is not None
    return acc.div_(kh).div_(kw)  # the kernel's division: by the window's height, then its width


class AdaptiveAvgPool2d(layer.AdaptiveAvgPool2d):
    """SpikingJelly's ``AdaptiveAvgPool2d`` (single- or multi-step) through :func:`adaptive_avg_pool2d`;
    the module, its ``output_size`` and its state dict are SpikingJelly's (exporters and the fixed-point
    converter see an ``nn.AdaptiveAvgPool2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step_mode == "s":
            return adaptive_avg_pool2d(x, self.output_size) if x.dim() == 4 else super().forward(x)
        if x.dim() != 5:
            raise ValueError(f"expected x with shape [T, N, C, H, W], but got x with shape {tuple(x.shape)}")
        return adaptive_avg_pool2d(x.flatten(0, 1), self.output_size).unflatten(0, x.shape[:2])
