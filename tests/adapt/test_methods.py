"""szo.adapt.methods: none / bn / tent / bp-subspace / szo-cge / szo-rge adapters."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from szo.adapt import METHODS, build_adapter, check_model, collect_params, configure_model
from szo.losses import entropy_loss
from szo.models import create


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    m = create("spike_convnet", num_classes=10, T=2, width=4)
    # non-trivial BN statistics and affine parameters, as after source training
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(0.2, 0.6)
            bn.num_batches_tracked.fill_(7)
    return m


def random_subspace(model, k: int = 3, seed: int = 0):
    d = sum(p.numel() for p in model.parameters())
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return SimpleNamespace(basis=q.float(), layout=[(n, tuple(p.shape)) for n, p in model.named_parameters()])


def batch(seed: int = 1, n: int = 8, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(n, 1, 8, 8, generator=g) + shift


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def adapter_for(method, model, **kw):
    kw.setdefault("lr", 1.0)
    kw.setdefault("tent_lr", 0.05)
    kw.setdefault("q", 2)
    kw.setdefault("scale", "absolute")  # the subspace here has no eigenvalues (the default scale's units)
    return build_adapter(method, model, subspace=random_subspace(model), generator=torch.Generator().manual_seed(0),
                         **kw)


def test_entropy_loss_matches_hand_computation():
    # T=2, N=1, C=2: time mean logits [0, ln 3] -> p = [1/4, 3/4]
    out = torch.tensor([[[0.0, 0.0]], [[0.0, 2 * math.log(3.0)]]])
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(entropy_loss(out)) == pytest.approx(expected, abs=1e-6)
    # batch mean
    out2 = torch.cat([out, torch.zeros(2, 1, 2)], dim=1)
    assert float(entropy_loss(out2)) == pytest.approx((expected + math.log(2.0)) / 2, abs=1e-6)


def test_bn_mode_uses_test_batch_statistics_and_reset_restores_source():
    model = tiny_model()
    src = state(model)
    x = batch()
    adapter = build_adapter("bn", model)
    out = adapter(x)
    # reference: the source model with BN running statistics replaced by this batch's statistics
    ref = tiny_model()
    ref.eval()
    with torch.no_grad():
        h = ref.conv1(x.unsqueeze(0).repeat(2, 1, 1, 1, 1))
        flat = h.flatten(0, 1)
        ref.bn1.running_mean.copy_(flat.mean((0, 2, 3)))
        ref.bn1.running_var.copy_(flat.var((0, 2, 3), unbiased=False))
        ref.bn1.eps = ref.bn1.eps  # same eps
        h = ref.sn1(ref.bn1(h))
        h2 = ref.conv2(h).flatten(0, 1)
        ref.bn2.running_mean.copy_(h2.mean((0, 2, 3)))
        ref.bn2.running_var.copy_(h2.var((0, 2, 3), unbiased=False))
        ref.reset_state()
        expected = ref(x)
    assert torch.allclose(out, expected, atol=1e-5)
    # differs from the source model's prediction with running statistics
    none_out = build_adapter("none", tiny_model())(x)
    assert not torch.allclose(out, none_out)
    # parameters never change; buffers track the test data and reset restores all bit-exactly
    params_after = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(params_after[n], src[n]) for n in params_after)
    assert not torch.equal(model.bn1.running_mean, src["bn1.running_mean"])
    adapter.reset()
    assert same(state(model), src)
    assert adapter.counts() == {"fp": 1, "bp": 0, "batches": 1}


def test_none_is_the_source_model_in_eval_mode():
    model = tiny_model()
    src = state(model)
    x = batch()
    out = build_adapter("none", model)(x)
    ref = tiny_model().eval()
    with torch.no_grad():
        assert torch.equal(out, ref(x))
    assert same(state(model), src)


def test_tent_configure_collect_check():
    model = configure_model(tiny_model())
    check_model(model)
    params, names = collect_params(model)
    assert names == ["bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"]
    assert all(p.requires_grad for p in params)
    assert not model.conv1.weight.requires_grad and not model.fc.weight.requires_grad
    assert model.bn1.training and not model.training
    plain = tiny_model()
    with pytest.raises(ValueError, match="configure_model"):
        check_model(plain)  # everything requires grad and BN is in train mode? -> not Tent's setup


def test_tent_changes_only_bn_affine_parameters():
    model = tiny_model()
    src = state(model)
    adapter = adapter_for("tent", model)
    for s in range(3):
        adapter(batch(seed=s, shift=1.0))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), src[n])}
    assert changed == {"bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"}
    assert adapter.counts() == {"fp": 3, "bp": 3, "batches": 3}


@pytest.mark.parametrize("method", ["tent", "bp-subspace", "szo-cge", "szo-rge"])
def test_reset_restores_parameters_and_bn_buffers_bit_exactly(method):
    model = tiny_model()
    src = state(model)
    adapter = adapter_for(method, model)
    x = batch(shift=1.0)
    first = adapter(x)
    for s in range(2):
        adapter(batch(seed=10 + s, shift=1.0))
    assert not same(state(model), src)  # adapted: parameters and BN buffers moved
    adapter.reset()
    assert same(state(model), src)
    # the optimizer state is back too: the first step from the source repeats exactly (CGE/BP are
    # deterministic; RGE draws fresh directions after a reset, so only its prediction repeats)
    again = adapter(x)
    assert torch.equal(again, first)
    if method != "szo-rge":
        adapter2 = adapter_for(method, tiny_model())
        adapter2(x)
        assert same(state(model), state(adapter2.model))


@pytest.mark.parametrize("method", ["tent", "szo-cge"])
def test_continual_does_not_reset(method):
    """Without reset() the second batch starts from the adapted state (continual setting)."""
    model = tiny_model()
    adapter = adapter_for(method, model)
    x1, x2 = batch(seed=1, shift=1.0), batch(seed=2, shift=1.0)
    adapter(x1)
    adapted = state(model)
    out_continual = adapter(x2)
    fresh = adapter_for(method, tiny_model())
    out_fresh = fresh(x2)
    assert not torch.equal(out_continual, out_fresh)
    # predict="before": the continual prediction is the adapted model's clean prediction
    probe = tiny_model()
    probe.load_state_dict(adapted)
    ref = build_adapter("bn", probe)(x2)
    assert torch.allclose(out_continual, ref, atol=1e-6)


@pytest.mark.parametrize("method", ["tent", "bp-subspace", "szo-cge", "szo-rge"])
def test_predict_before_and_after(method):
    x = batch(shift=1.0)
    src_pred = build_adapter("bn", tiny_model())(x)
    before = adapter_for(method, tiny_model(), predict="before")
    out_before = before(x)
    assert torch.allclose(out_before, src_pred, atol=1e-6)  # the model as the batch arrived
    after = adapter_for(method, tiny_model(), predict="after")
    out_after = after(x)
    assert same(state(before.model), state(after.model))  # same update either way
    upd = tiny_model()
    upd.load_state_dict(state(after.model))
    assert torch.allclose(out_after, build_adapter("bn", upd)(x), atol=1e-6)  # the updated model
    assert not torch.equal(out_after, out_before)
    # cost: "after" adds one clean forward for BP methods; SZO pays one clean forward either way
    k, q = 3, 2
    expected_fp = {"tent": (1, 2), "bp-subspace": (1, 2), "szo-cge": (2 * k + 1,) * 2, "szo-rge": (2 * q + 1,) * 2}
    assert (before.forward_passes, after.forward_passes) == expected_fp[method]


def test_szo_adapter_is_forward_only_and_lowers_entropy():
    model = tiny_model()
    adapter = adapter_for("szo-cge", model, lr=0.5, mu=0.1)
    x = batch(shift=1.0)
    with torch.no_grad():
        e0 = float(entropy_loss(build_adapter("bn", tiny_model())(x)))
    for _ in range(15):
        adapter(x)
    with torch.no_grad():
        e1 = float(entropy_loss(adapter._clean_forward(x)))
    assert adapter.backward_passes == 0
    assert all(p.grad is None for p in model.parameters())
    assert e1 < e0


def test_bad_names_give_one_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="unknown method 'sgd'; valid: " + ", ".join(METHODS)):
        build_adapter("sgd", model)
    with pytest.raises(ValueError, match="valid: before, after"):
        build_adapter("bn", model, predict="during")
    with pytest.raises(ValueError, match="valid: adam, sgd"):
        build_adapter("tent", model, tent_optimizer="rmsprop")
    with pytest.raises(ValueError, match="needs an adaptation subspace"):
        build_adapter("szo-cge", model, lr=1.0)
