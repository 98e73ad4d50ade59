"""Converter: integer forward, exact kernels, layout, errors, saturation, float/fixed agreement."""
from __future__ import annotations

import pytest
import torch
from spikingjelly.activation_based import layer
from torch import nn

from szo.hw import UnsupportedLayerError, backend, to_fixed
from szo.hw.convert import FLOAT32_EXACT, kernel_dtype
from szo.hw.fixed import STATE_SHIFT
from szo.models import SpikingModel, create, make_neuron


def _active_convnet(seed: int = 0) -> SpikingModel:
    """spike_convnet with weights scaled so that both LIF layers spike on [0, 1] inputs."""
    torch.manual_seed(seed)
    m = create("spike_convnet", T=4).eval()
    with torch.no_grad():
        m.conv1.weight.mul_(4.0)
        m.conv2.weight.mul_(3.0)
        m.bn1.running_mean.fill_(0.1)
        m.bn2.running_var.fill_(0.5)
        m.bn2.weight.uniform_(0.5, 1.5)
        m.fc.weight.mul_(4.0)
    return m


def _digits_like(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 8, 8, generator=g) * (torch.rand(n, 1, 8, 8, generator=g) > 0.4)).float()


def test_same_parameter_layout_and_shared_master_params():
    m = create("spike_convnet")
    f = backend(m, "fixed")
    assert f.param_layout() == m.param_layout()
    assert f.fingerprint() == m.fingerprint()
    assert all(a is b for a, b in zip(f.parameters(), m.parameters()))
    assert torch.equal(f.flat_params(), m.flat_params())
    assert backend(m, "float") is m
    with pytest.raises(ValueError, match="valid: \\['float', 'fixed'\\]"):
        backend(m, "int8")


def test_integer_forward_exact_against_int64_reference():
    m = _active_convnet()
    f = to_fixed(m, verify_exact=True, collect_stats=True)  # every kernel result compared with a pure int64 conv/matmul
    out = f(_digits_like(8))
    assert out.shape == (4, 8, 10)
    # logits are integer readout currents / 2^12
    assert torch.equal(out * (1 << STATE_SHIFT), (out * (1 << STATE_SHIFT)).round())
    assert f.last_readout_sum.dtype == torch.int64
    assert torch.equal(f.last_readout_sum, (out * (1 << STATE_SHIFT)).round().to(torch.int64).sum(0))
    st = f.last_stats
    assert st["sn1"]["spikes"] > 0 and st["sn2"]["spikes"] > 0
    for name, s in st.items():
        if s.get("kernel_dtype") == "torch.float32":  # no float32 partial sum can exceed 2^24
            assert s["bound"] <= FLOAT32_EXACT, name


def test_float64_fallback_engaged_and_exact():
    assert kernel_dtype(FLOAT32_EXACT) == torch.float32
    assert kernel_dtype(FLOAT32_EXACT + 1) == torch.float64
    with pytest.raises(OverflowError, match="2\\*\\*53"):
        kernel_dtype(2**53 + 1)
    m = _active_convnet()
    f = to_fixed(m, verify_exact=True, collect_stats=True)
    x = _digits_like(4) * 500.0  # graded input <= 500 * 64 = 32000 (int16): bound ~ 127 * 32000 * 9 > 2^24
    f(x)
    assert f.last_stats["conv1"]["bound"] > FLOAT32_EXACT
    assert f.last_stats["conv1"]["kernel_dtype"] == "torch.float64"


def test_float_and_fixed_agree_on_small_model():
    m = _active_convnet()
    f = to_fixed(m)
    x = _digits_like(64)
    with torch.no_grad():
        a, b = m(x), f(x)
    agree = (a.mean(0).argmax(1) == b.mean(0).argmax(1)).float().mean()
    # a random net sits near many thresholds; residual gap = input 2^-6 grid, 12-bit leak, V > th vs V >= th
    assert agree >= 0.85, float(agree)
    rel = (a.mean(0) - b.mean(0)).abs().mean() / a.mean(0).abs().mean()
    assert rel < 0.2, float(rel)
    assert f.saturation_counts() == {}


def test_requantises_after_in_place_update():
    m = _active_convnet()
    f = to_fixed(m)
    x = _digits_like(4)
    before = f(x)
    w0 = f.quantized_layers()["fc"]["w_int"].clone()
    with torch.no_grad():
        f.fc.weight.data.add_(0.05)  # the way SZO writes: through .data, no version bump
    after = f(x)
    assert not torch.equal(before, after)
    assert not torch.equal(w0, f.quantized_layers()["fc"]["w_int"])


def test_saturation_counted_never_wraps():
    m = _active_convnet()
    f = to_fixed(m)
    with torch.no_grad():
        f.fc.weight.data.fill_(1e4)  # beyond 127 * 2^1: mantissa saturates at the max exponent
        f.fc.bias.data.fill_(1e4)
    out = f(torch.ones(2, 1, 8, 8))
    sat = f.saturation_counts()
    assert sat["fc"]["weight"] == f.fc.weight.numel()
    assert sat["fc"]["bias"] == f.fc.bias.numel()
    assert sat["fc"]["current"] > 0
    top = (2**23 - 1) / (1 << STATE_SHIFT)
    assert float(out.max()) == pytest.approx(top) and float(out.min()) >= 0  # pinned at +max, not wrapped
    with torch.no_grad():
        f.fc.weight.data.fill_(-1e4)
        f.fc.bias.data.fill_(-1e4)
    out = f(torch.ones(2, 1, 8, 8))
    assert float(out.min()) == pytest.approx(-(2**23) / (1 << STATE_SHIFT)) and float(out.max()) <= 0


def test_unsupported_layer_names_path_and_type():
    m = create("spike_convnet", activation="relu")
    with pytest.raises(UnsupportedLayerError) as ei:
        to_fixed(m)
    msg = str(ei.value)
    assert "'sn1'" in msg and "ReLU" in msg and "supported layer types" in msg and "LIFNode" in msg


class _BNFirst(SpikingModel):
    def __init__(self):
        super().__init__(num_classes=3, T=2, model_name="bn_first")
        self.bn = layer.BatchNorm2d(1, step_mode="m")
        self.conv = layer.Conv2d(1, 4, 3, step_mode="m")
        self.sn = make_neuron("lif")
        self.flat = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(4 * 36, 3, step_mode="m")

    def forward_seq(self, x):
        return self.fc(self.flat(self.sn(self.conv(self.bn(x)))))


def test_unfoldable_batchnorm_rejected():
    with pytest.raises(UnsupportedLayerError, match="'bn'.*must directly follow a Conv2d/Linear"):
        to_fixed(_BNFirst())


def test_residual_resnet20_converts_and_runs_exactly():
    torch.manual_seed(0)
    m = create("spike_resnet20", T=2).eval()
    f = to_fixed(m, verify_exact=True, collect_stats=True)
    x = torch.rand(1, 3, 8, 8) * 2
    out = f(x)
    assert out.shape == (2, 1, 10) and torch.isfinite(out).all()
    kinds = {s["type"] for s in f.last_stats.values()}
    assert {"conv2d", "neuron", "sumpool", "linear"} <= kinds
    with torch.no_grad():
        ref = m(x)
    assert (ref - out).abs().max() < 0.05


def test_szo_optimizer_runs_on_fixed_backend():
    pytest.importorskip("subspace_store")
    from subspace_store import Subspace
    from szo.optim import SZO

    m = _active_convnet()
    f = to_fixed(m)
    d, k = f.num_params(), 3
    P, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(0)))
    sub = Subspace(P, torch.zeros(d), f.flat_params(), torch.ones(k), torch.ones(k) / k, layout=f.param_layout())
    x, y = _digits_like(16), torch.arange(16) % 10
    opt = SZO(f.parameters(), sub, mu=0.5, lr=0.5, model=f, scale="absolute")
    theta0 = f.flat_params()
    opt.step(lambda: nn.functional.cross_entropy(f(x).mean(0), y))
    assert opt.forward_passes == 2 * k
    moved = f.flat_params() - theta0
    # the update lies in span(P)
    torch.testing.assert_close(P @ (P.t() @ moved), moved, atol=1e-5, rtol=0)
    assert moved.abs().max() > 0


def test_quantized_basis_error_and_on_chip_szo():
    pytest.importorskip("subspace_store")
    from subspace_store import Subspace
    from szo.hw.optim.onchip import OnChipSZO, basis_error, evaluate_fixed, quantize_basis, quantized_subspace

    m = _active_convnet()
    f = to_fixed(m)
    d, k = f.num_params(), 4
    P, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1)))
    P_int, scale = quantize_basis(P, 8)
    assert P_int.abs().max() <= 127 and scale.shape == (k,)
    e8, e4 = basis_error(P, 8), basis_error(P, 4)
    assert 0 < e8 < 0.02 < e4 < 0.3  # int8 ~0.9 %, int4 ~16 % on a random orthonormal basis
    sub = Subspace(P, torch.zeros(d), f.flat_params(), torch.ones(k), torch.ones(k) / k, layout=f.param_layout())
    qs = quantized_subspace(sub, 8)
    assert qs.provenance["basis_quantization"]["bits"] == 8
    x, y = _digits_like(16), torch.arange(16) % 10
    closure = lambda: nn.functional.cross_entropy(f(x).mean(0), y)  # noqa: E731
    runs = []
    for _ in range(2):
        m.load_flat_params(sub.reference)
        opt = OnChipSZO(f, sub, lr=0.5, estimator="rademacher", q=2, seed=7)
        opt.step(closure)
        runs.append(opt.c.clone())
        assert opt.forward_passes == 4 and opt.c.dtype == torch.int64
    assert torch.equal(runs[0], runs[1]) and runs[0].abs().max() > 0  # regenerated from the seed
    acc = evaluate_fixed(f, [(x, y)])
    assert 0.0 <= acc <= 1.0
    assert acc == float((f.last_readout_sum.argmax(1) == y).float().mean())
    f.train()
    assert evaluate_fixed(f, [(x[:5], y[:5]), (x[5:], y[5:])]) == acc and f.training  # mode restored
    f.eval()
    from szo.hw.optim.onchip import learner_state_bits

    assert opt.state_bits() == learner_state_bits(d, k) and opt.d == d
    assert opt.counter.as_dict() == {}  # theta_ref fits 16 bits: no clamp counted
    with pytest.raises(ValueError, match="valid: cge, rademacher"):
        OnChipSZO(f, sub, estimator="spsa")


def test_on_chip_szo_is_an_optimizer_whose_state_resumes_exactly():
    from subspace_store import Subspace
    from szo.hw.optim.onchip import OnChipSZO

    m = _active_convnet()
    f = to_fixed(m)
    d, k = f.num_params(), 3
    P, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(2)))
    ref = f.flat_params()
    sub = Subspace(P, torch.zeros(d), ref, torch.ones(k), torch.ones(k) / k, layout=f.param_layout())
    x, y = _digits_like(8), torch.arange(8) % 10
    closure = lambda: nn.functional.cross_entropy(f(x).mean(0), y)  # noqa: E731

    def fresh():
        m.load_flat_params(ref)
        return OnChipSZO(f, sub, lr=0.5, estimator="rademacher", q=2, seed=5, mu_lsb=1 << 14)

    a = fresh()
    sched = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)  # an ordinary torch scheduler drives lr
    for _ in range(2):
        a.step(closure)
        sched.step()
    assert a.lr == 0.125
    saved = a.state_dict()
    a.step(closure)
    b = fresh()
    b.load_state_dict(saved)
    b.step(closure)
    assert torch.equal(a.c, b.c) and torch.equal(a.delta, b.delta) and a.forward_passes == b.forward_passes == 12
    # a NaN probe raises and leaves the parameters at c, not at the probe
    before = f.flat_params().clone()
    with pytest.raises(ValueError, match="non-finite"):
        b.step(lambda: torch.tensor(float("nan")))
    assert torch.equal(f.flat_params(), before)


class _AvgPoolNet(SpikingModel):
    """conv -> LIF -> 3x3 average pool (factor 1/9 folded into fc) -> fc."""

    def __init__(self):
        super().__init__(num_classes=3, T=2, model_name="avgpool_net")
        self.conv = layer.Conv2d(1, 4, 3, padding=1, step_mode="m")
        self.sn = make_neuron("lif")
        self.pool = layer.AvgPool2d(3, step_mode="m")
        self.flat = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(4 * 9, 3, step_mode="m")

    def forward_seq(self, x):
        return self.fc(self.flat(self.pool(self.sn(self.conv(x)))))


def _spy_kernels(monkeypatch):
    """Record the integer weights every conv / linear kernel of the fixed forward is called with."""
    import szo.hw.convert as conv

    seen: dict[tuple, list[torch.Tensor]] = {}
    for name in ("conv2d", "linear"):
        orig = getattr(conv.F, name)

        def spy(x, w, *a, _orig=orig, _name=name, **kw):
            seen.setdefault((_name, tuple(w.shape)), []).append(w.round().to(torch.int64))
            return _orig(x, w, *a, **kw)

        monkeypatch.setattr(conv.F, name, spy)
    return seen


@pytest.mark.parametrize("which", ["avgpool", "convnet"])
def test_quantized_layers_match_what_the_forward_uses(which, monkeypatch):
    torch.manual_seed(0)
    if which == "avgpool":
        m, x = _AvgPoolNet().eval(), torch.rand(2, 1, 9, 9) * 2
        with torch.no_grad():
            m.conv.weight.mul_(4.0)
        f = to_fixed(m, collect_stats=True)
        before = f.quantized_layers()  # static 1/9 known at conversion
        assert before["fc"]["mult"] == pytest.approx(1 / 9) and before["conv"]["mult"] == 1.0
    else:
        m, x = _active_convnet(), _digits_like(4)
        f = to_fixed(m, collect_stats=True)
        with pytest.raises(ValueError, match="'fc'.*AdaptiveAvgPool2d.*run the network once"):
            f.quantized_layers()  # the 4x4 adaptive pool's window depends on the input size
    seen = _spy_kernels(monkeypatch)
    f(x)
    q = f.quantized_layers()
    assert set(q) == {n for n, s in f.last_stats.items() if s["type"] in ("conv2d", "linear")}
    for path, lay in q.items():
        assert lay["exp"] == f.last_stats[path]["weight_exp"], path
        used = seen[("conv2d" if lay["w_int"].dim() == 4 else "linear", tuple(lay["w_int"].shape))]
        assert all(torch.equal(u, lay["w_int"]) for u in used), path
    pooled = q["fc"]
    assert pooled["mult"] == pytest.approx(1 / 9 if which == "avgpool" else 1 / 4)
    # the pooling factor changes the exponent (and, for 1/9, the mantissas) against the unpooled weights
    w = m.fc.weight.detach().double()
    from szo.hw.fixed import quantize_weight

    w_plain, e_plain, _ = quantize_weight(w, f.widths)
    assert pooled["exp"] < e_plain
    if which == "avgpool":
        assert not torch.equal(pooled["w_int"], w_plain)


def test_stats_only_when_asked_and_the_forward_is_the_same():
    m = _active_convnet()
    x = _digits_like(8)
    plain, counted = to_fixed(m), to_fixed(m, collect_stats=True)
    a, b = plain(x), counted(x)
    assert torch.equal(a, b) and torch.equal(plain.last_readout_sum, counted.last_readout_sum)
    assert plain.last_stats == {} and counted.last_stats["sn1"]["spikes"] > 0
    assert counted.last_stats["conv2"]["synops"] > 0


def test_saturation_counter_sums_device_tensors_lazily():
    from szo.hw.fixed import SaturationCounter

    c = SaturationCounter()
    c.add("L", "current", torch.tensor(2))
    c.add("L", "current", 3)
    c.add("L", "voltage", torch.tensor(0))
    c.add("M", "x", 0)
    assert c.as_dict() == {"L": {"current": 5}} and c.total() == 5
    c.reset()
    assert c.as_dict() == {} and c.total() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_chip_szo_and_evaluate_fixed_with_a_cuda_model():
    from subspace_store import Subspace
    from szo.hw.optim.onchip import OnChipSZO, evaluate_fixed

    m = _active_convnet()
    f = to_fixed(m).cuda()
    d, k = f.num_params(), 3
    P, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(3)))
    sub = Subspace(P, torch.zeros(d), m.flat_params().cpu(), torch.ones(k), torch.ones(k) / k, layout=f.param_layout())
    x, y = _digits_like(8), torch.arange(8) % 10
    xc, yc = x.cuda(), y.cuda()
    opt = OnChipSZO(f, sub, lr=0.5, estimator="rademacher", q=1, seed=3)  # theta_ref on the host, as P
    opt.step(lambda: nn.functional.cross_entropy(f(xc).mean(0), yc))
    assert opt.forward_passes == 2 and f.fc.weight.is_cuda
    acc = evaluate_fixed(f, [(x, y)])  # CPU batches are moved to the network's device
    assert acc == float((f.last_readout_sum.argmax(1).cpu() == y).float().mean())


def test_quantize_weight_round_trips_every_mantissa_including_the_most_negative():
    """``w_int 2**e`` -> ``(w_int, e)`` for mantissas in [-128, 127] (what an integer learner writes back),
    also through a float32 parameter divided by a BN scale and folded again."""
    from szo.hw.fixed import BitWidths, quantize_bias, quantize_weight

    P = BitWidths()
    g = torch.Generator().manual_seed(0)
    for e in (-12, -9, -3, 0, 1):
        for ends in ([-128, 5], [-128, 127], [-3, 127], [-64, 63], [-1, 0]):
            w_int = torch.randint(-127, 127, (40,), generator=g)
            w_int[:2] = torch.tensor(ends)
            w_int = w_int.clamp(min(ends), max(ends))
            scale = torch.rand(40, generator=g, dtype=torch.float64) + 0.5
            stored = ((w_int.double() * 2.0**e) / scale).float()  # the parameter, as written back
            q, e2, n_sat = quantize_weight(stored.double() * scale, P)
            if int(w_int.max()) > 63 or int(w_int.min()) < -64 or e == P.weight_exp_min:  # no finer exponent fits
                assert (e2, n_sat) == (e, 0) and torch.equal(q, w_int), (e, ends)
            else:  # a finer exponent holds the same values exactly
                assert torch.equal(q.double() * 2.0**e2, w_int.double() * 2.0**e), (e, ends)
    w, e, _ = quantize_weight(torch.tensor([-128.0, 127.0]), P)
    assert e == 0 and w.tolist() == [-128, 127]
    w, e, _ = quantize_weight(torch.tensor([-128.5, 10.0]), P)  # beyond -128: the next exponent
    assert e == 1 and w.tolist() == [-64, 5]
    b, bexp, _ = quantize_bias(torch.tensor([-4096.0 * 4, 100.0]), P)  # bias mantissa -4096 << 2
    assert bexp == 2 and b.tolist() == [-16384, 100]
