"""szo.models.pooling: the strided-slice adaptive pool gives PyTorch's values, and falls back to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer

from szo.models import create
from szo.models.pooling import MAX_WINDOW, AdaptiveAvgPool2d, adaptive_avg_pool2d

# (input H, W, output size): uniform windows of 2..16 elements, the slice path
SLICED = [(8, 8, (4, 4)), (8, 8, 4), (6, 8, (3, 4)), (8, 8, (2, 4)), (28, 28, (14, 14)), (16, 16, (4, 4)),
          (8, 6, (None, 3)), (9, 9, (3, 3))]


@pytest.mark.kernels  # also run under ATEN_CPU_CAPABILITY=default by make test-kernels
@pytest.mark.parametrize("h,w,out", SLICED)
@pytest.mark.parametrize("data", ["normal", "spikes", "large"])
def test_slices_equal_pytorch(h, w, out, data):
    g = torch.Generator().manual_seed(h * 100 + w)
    x = torch.randn(37, 5, h, w, generator=g)
    if data == "spikes":
        x = (x > 0.3).float()
    elif data == "large":
        x = x * 1e6 + 1e-3  # rounding in every add: the order of the sum shows
    ref = F.adaptive_avg_pool2d(x, out)
    got = adaptive_avg_pool2d(x, out)
    assert got.shape == ref.shape and got.is_contiguous()
    assert torch.equal(got, ref)


def test_slice_path_is_taken_and_order_matters():
    """The slices are summed in the kernel's order: another order differs on these values, so the test
    above would notice a path that is not the kernel's."""
    x = torch.tensor([[1e8, 1.0], [-1e8, 1.0]]).view(1, 1, 2, 2).repeat(1, 1, 2, 2)
    other = (x[..., 1::2, 0::2] + x[..., 0::2, 0::2] + x[..., 0::2, 1::2] + x[..., 1::2, 1::2]) / 4
    assert not torch.equal(other, F.adaptive_avg_pool2d(x, 2))
    assert torch.equal(adaptive_avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 2))


@pytest.mark.parametrize("case", ["global", "non-uniform", "too-large", "channels-last", "grad", "int", "bfloat16",
                                  "float16"])
def test_fallbacks_give_pytorch(case, monkeypatch):
    x = torch.randn(4, 3, 8, 8)
    out = (4, 4)
    if case == "global":
        out = (1, 1)
    elif case == "non-uniform":
        x = torch.randn(4, 3, 9, 7)
    elif case == "too-large":
        x, out = torch.randn(4, 3, 20, 20), (4, 4)  # 5x5 = 25 > MAX_WINDOW
        assert 25 > MAX_WINDOW
    elif case == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "grad":
        x.requires_grad_(True)
    elif case in ("bfloat16", "float16"):  # PyTorch sums these in float32: slices in their dtype would not
        x = x.to(getattr(torch, case))
    calls = []
    stock = F.adaptive_avg_pool2d
    monkeypatch.setattr(F, "adaptive_avg_pool2d", lambda *a, **k: calls.append(1) or stock(*a, **k))
    if case == "int":
        with pytest.raises(RuntimeError):  # PyTorch's own refusal, not a silent integer average
            adaptive_avg_pool2d(torch.ones(1, 1, 4, 4, dtype=torch.int64), 2)
        assert calls
        return
    got = adaptive_avg_pool2d(x, out)
    assert calls, "expected PyTorch's op"
    assert torch.equal(got, stock(x, out))
    if case == "grad":
        got.sum().backward()
        assert x.grad is not None


def test_module_matches_spikingjelly_single_and_multi_step():
    x = torch.randn(3, 2, 4, 8, 8)
    for mode, inp in (("m", x), ("s", x[0])):
        ours, theirs = AdaptiveAvgPool2d((4, 4), step_mode=mode), layer.AdaptiveAvgPool2d((4, 4), step_mode=mode)
        assert isinstance(ours, torch.nn.AdaptiveAvgPool2d)
        assert torch.equal(ours(inp), theirs(inp))
    with pytest.raises(ValueError, match=r"\[T, N, C, H, W\]"):
        AdaptiveAvgPool2d((4, 4), step_mode="m")(x[0])


def test_convnet_logits_and_gradients_unchanged():
    """The digits ConvNet with its pool swapped back to SpikingJelly's gives the same logits (no-grad,
    the slice path) and the same gradients (autograd, PyTorch's op)."""
    torch.manual_seed(0)
    model = create("spike_convnet", num_classes=10, T=4).train()
    x = torch.rand(16, 1, 8, 8)
    with torch.no_grad():
        ours = model(x)
    stock = layer.AdaptiveAvgPool2d((4, 4), step_mode="m")
    sliced, model.pool = model.pool, stock
    with torch.no_grad():
        ref = model(x)
    assert torch.equal(ours, ref)
    grads = []
    for pool in (stock, sliced):
        model.pool = pool
        model.zero_grad()
        functional.reset_net(model)
        model(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
