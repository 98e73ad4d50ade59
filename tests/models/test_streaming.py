"""Time-chunked (streaming) forward == the multi-step forward, and its BatchNorm policies."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as Fn
from spikingjelly.activation_based import layer, neuron
from torch import nn

import szo.models as M
from szo.models.base import SpikingModel
from szo.models.streaming import STREAM_BN_MODES, BatchNorm2d

# (in_channels, spatial size) of a tiny input per model
SIZES = {"spike_convnet": (1, 8), "spike_resnet20": (3, 8), "spike_resnet18": (3, 8),
         "spike_resnet50": (3, 16), "spike_vgg11": (2, 32),
         "snn_mlp": (7, 10), "snn_rlif": (7, 10)}  # 7 x 10 x 10 = the SHD networks' 700 inputs
DEFAULT_SIZE = (3, 16)
T = 3

_cache: dict[str, dict] = {}


def _model(name: str) -> SpikingModel:
    """A fresh copy of one cached instance per model (building ResNet50 is the slow part)."""
    if name not in _cache:
        torch.manual_seed(0)
        c, _ = SIZES.get(name, DEFAULT_SIZE)
        _cache[name] = {"model": M.create(name, T=T, in_channels=c)}
    return copy.deepcopy(_cache[name]["model"])


def _input(name: str, n: int = 2, seed: int = 0) -> torch.Tensor:
    c, s = SIZES.get(name, DEFAULT_SIZE)
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, s, s, generator=g) * 3.0


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _assert_bn_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if "num_batches" in k:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits to 1e-5 relative (of the largest logit)."""
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("name", M.names())
def test_eval_mode_streaming_equals_multistep(name):
    m = _model(name).eval()
    x = _input(name)
    seq = torch.rand(4, *x.shape, generator=torch.Generator().manual_seed(1)) * 3.0
    with torch.no_grad():
        ref, ref_seq = m(x), m(seq)
        for c in (1, 2):
            _close(m(x, time_chunk=c), ref)
            _close(m(seq, time_chunk=c), ref_seq)  # a [T, N, ...] sequence (T = 4 != model.T)
    assert ref.shape == (T, 2, m.num_classes) and ref.abs().max() > 0


@pytest.mark.parametrize("name", M.names())
def test_train_mode_exact_equals_multistep_logits_and_running_stats(name):
    m = _model(name).train()
    x = _input(name)
    start = copy.deepcopy(m.state_dict())
    with torch.no_grad():
        ref = m(x)
        bn_ref = _bn_state(m)
        for c in (1, 2):
            m.load_state_dict(start)
            out = m(x, time_chunk=c, stream_bn="exact")
            _close(out, ref)
            _assert_bn_close(_bn_state(m), bn_ref)
    if name not in ("snn_mlp", "snn_rlif"):  # the SHD networks have no BatchNorm
        assert any(not torch.equal(bn_ref[k], start[k]) for k in bn_ref if "running_mean" in k)


def _neuron_rates(model: nn.Module, x: torch.Tensor) -> list[float]:
    rates: list[float] = []
    hs = [mod.register_forward_hook(lambda _m, _i, o: rates.append(float(o.mean())))
          for mod in model.modules() if isinstance(mod, neuron.LIFNode)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hs:
            h.remove()
    return rates


def test_the_test_inputs_make_every_layer_spike():
    for name in M.names():
        rates = _neuron_rates(_model(name).train(), _input(name))
        assert rates and min(rates) > 0.01, name


def _bn_inputs(model: nn.Module, x: torch.Tensor) -> dict[nn.Module, torch.Tensor]:
    """Input of every BN layer in one multi-step forward."""
    seen: dict[nn.Module, torch.Tensor] = {}
    hs = [mod.register_forward_hook(lambda mod_, inp, _o: seen.__setitem__(mod_, inp[0].detach().clone()))
          for mod in model.modules() if isinstance(mod, BatchNorm2d)]
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for h in hs:
            h.remove()
    seen["out"] = out
    return seen


def _expected_update(mod: BatchNorm2d, inp: torch.Tensor, rm0, rv0) -> tuple[torch.Tensor, torch.Tensor]:
    """One momentum update with the statistics of ``inp`` over every dim but the channel."""
    x = inp.flatten(0, 1).transpose(0, 1).reshape(inp.shape[2], -1).double()
    f = mod.momentum
    return ((1 - f) * rm0.double() + f * x.mean(1)).float(), ((1 - f) * rv0.double() + f * x.var(1)).float()


@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20", "spike_vgg11"])
def test_running_mode_is_eval_normalisation_with_batch_stat_update(name):
    """'running': logits of the eval-mode forward; running stats updated with the T*N statistics
    of that forward's BN inputs (one update, num_batches_tracked + 1)."""
    m = _model(name).train()
    x = _input(name)
    with torch.no_grad():  # non-trivial running statistics to start from
        m(x * 0.5)
    start = copy.deepcopy(m.state_dict())
    ref_model = copy.deepcopy(m).eval()
    seen = _bn_inputs(ref_model, x)
    with torch.no_grad():
        for c in (1, 2):
            m.load_state_dict(start)
            out = m(x, time_chunk=c, stream_bn="running")
            _close(out, seen["out"])
            for (name_, mod), (_, mod0) in zip(m.named_modules(), ref_model.named_modules()):
                if isinstance(mod, BatchNorm2d):
                    rm, rv = _expected_update(mod, seen[mod0], start[name_ + ".running_mean"],
                                              start[name_ + ".running_var"])
                    torch.testing.assert_close(mod.running_mean, rm, rtol=1e-5, atol=1e-7)
                    torch.testing.assert_close(mod.running_var, rv, rtol=1e-5, atol=1e-7)
                    assert int(mod.num_batches_tracked) == int(start[name_ + ".num_batches_tracked"]) + 1


@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20"])
def test_chunk_mode_is_per_step_batch_norm(name):
    """'chunk' with c = 1 == a multi-step forward whose BN normalises each step with its own
    batch statistics; running stats get one update with the statistics over all steps."""
    m = _model(name).train()
    x = _input(name)
    start = copy.deepcopy(m.state_dict())
    with torch.no_grad():
        out = m(x, time_chunk=1, stream_bn="chunk")
    got_bn = _bn_state(m)
    ref_model = copy.deepcopy(m)
    ref_model.load_state_dict(start)
    ref_model.eval()  # running stats untouched; per-step batch statistics patched in below

    def per_step(mod):
        return lambda xs: torch.stack([Fn.batch_norm(xt, None, None, mod.weight, mod.bias, True, 0.0, mod.eps)
                                       for xt in xs])

    bns = [mod for mod in ref_model.modules() if isinstance(mod, BatchNorm2d)]
    for mod in bns:
        mod.forward = per_step(mod)
    seen = _bn_inputs(ref_model, x)
    _close(out, seen["out"])
    for (name_, mod) in ref_model.named_modules():
        if isinstance(mod, BatchNorm2d):
            rm, rv = _expected_update(mod, seen[mod], start[name_ + ".running_mean"], start[name_ + ".running_var"])
            torch.testing.assert_close(got_bn[name_ + ".running_mean"], rm, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got_bn[name_ + ".running_var"], rv, rtol=1e-5, atol=1e-7)
    m.load_state_dict(start)
    with torch.no_grad():
        full = m(x)
    assert float((out - full).abs().max()) > 1e-4  # per-step statistics really are a different function


def test_chunk_at_least_T_is_the_multistep_forward():
    m = _model("spike_convnet").train()
    x = _input("spike_convnet")
    start = copy.deepcopy(m.state_dict())
    with torch.no_grad():
        ref = m(x)
        for mode in STREAM_BN_MODES:
            m.load_state_dict(start)
            assert torch.equal(m(x, time_chunk=T, stream_bn=mode), ref)
            m.load_state_dict(start)
            assert torch.equal(m(x, time_chunk=T + 5, stream_bn=mode), ref)


# ------------------------------------------------------------------------------ memory
def test_streaming_holds_one_time_step_of_activations():
    """The largest tensor any layer produces does not grow with T when time_chunk = 1."""
    def biggest(T_: int, chunk) -> int:
        torch.manual_seed(0)
        m = M.create("spike_resnet20", T=T_).train()
        sizes = []
        hs = [mod.register_forward_hook(lambda _m, _i, o: sizes.append(o.numel()))
              for mod in m.modules() if not list(mod.children())]
        with torch.no_grad():
            out = m(_input("spike_resnet20"), time_chunk=chunk, stream_bn="running")
        for h in hs:
            h.remove()
        assert out.shape[0] == T_
        return max(sizes)

    assert biggest(1, 1) == biggest(6, 1)
    assert biggest(6, 2) == 2 * biggest(1, 1)
    assert biggest(6, None) == 6 * biggest(1, None)


# ------------------------------------------------------------------------------ API
def test_set_streaming_and_context_manager():
    m = _model("spike_convnet").eval()
    x = _input("spike_convnet")
    assert m.time_chunk is None and m.stream_bn == "exact"
    calls = []
    orig = m.forward_seq
    m.forward_seq = lambda xs: (calls.append(xs.shape[0]), orig(xs))[1]
    with torch.no_grad():
        m(x)
        assert calls == [T]
        with m.streaming(1, "running") as same:
            assert same is m and (m.time_chunk, m.stream_bn) == (1, "running")
            calls.clear()
            m(x)
            assert calls == [1] * T
            calls.clear()
            m(x, time_chunk=2)  # an explicit argument wins over the model setting
            assert calls == [2, 1]
        assert m.time_chunk is None and m.stream_bn == "exact"
        m.set_streaming(2)
        calls.clear()
        m(x)
        assert calls == [2, 1]


def test_state_is_reset_and_persistent_state_streams_across_calls():
    m = _model("spike_convnet").eval()
    x = _input("spike_convnet")
    seq = x.unsqueeze(0).repeat(4, 1, 1, 1, 1)
    with torch.no_grad():
        whole = m(seq)
        m(x, time_chunk=1)
        assert all(not isinstance(mod.v, torch.Tensor) or not mod.v.any()
                   for mod in m.modules() if isinstance(mod, neuron.LIFNode))
        with m.persistent_state():  # two calls of 2 steps, each chunked: the 4-step sequence
            parts = [m(seq[:2], time_chunk=1), m(seq[2:], time_chunk=1)]
    _close(torch.cat(parts), whole)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_bad_time_chunk_raises(bad):
    m = _model("spike_convnet")
    with pytest.raises(ValueError, match="time_chunk must be a positive int"):
        m(_input("spike_convnet"), time_chunk=bad)
    with pytest.raises(ValueError, match="time_chunk must be a positive int"):
        m.set_streaming(bad)


def test_bad_stream_bn_raises():
    m = _model("spike_convnet")
    with pytest.raises(ValueError, match="unknown stream_bn 'tdbn'; valid: exact, running, chunk"):
        m(_input("spike_convnet"), time_chunk=1, stream_bn="tdbn")
    with pytest.raises(ValueError, match="valid: exact, running, chunk"):
        m.set_streaming(1, "batch")


def test_exact_needs_no_grad_and_no_persistent_state():
    m = _model("spike_convnet").train()
    x = _input("spike_convnet")
    with pytest.raises(ValueError, match="no-grad"):
        m(x, time_chunk=1, stream_bn="exact")
    with torch.no_grad(), m.persistent_state():
        with pytest.raises(ValueError, match="persistent_state"):
            m(x, time_chunk=1, stream_bn="exact")
    # gradients through 'running' / 'chunk' and through eval-mode BN are fine
    m(x, time_chunk=1, stream_bn="chunk").sum().backward()
    assert m.conv1.weight.grad is not None
    m.eval()
    m.zero_grad()
    m(x, time_chunk=1).sum().backward()
    g1 = m.conv1.weight.grad.clone()
    m.zero_grad()
    m(x).sum().backward()
    torch.testing.assert_close(g1, m.conv1.weight.grad)


class _PlainBN(SpikingModel):
    def __init__(self, track: bool = True):
        super().__init__(num_classes=2, T=3, model_name="plain_bn")
        self.conv = layer.Conv2d(1, 2, 3, padding=1, step_mode="m")
        self.bn = (layer.BatchNorm2d(2, step_mode="m") if track
                   else BatchNorm2d(2, track_running_stats=False, step_mode="m"))
        self.sn = M.make_neuron("lif")
        self.fc = layer.Linear(2 * 4 * 4, 2, step_mode="m")
        self.flat = layer.Flatten(step_mode="m")

    def forward_seq(self, x_seq):
        return self.fc(self.flat(self.sn(self.bn(self.conv(x_seq)))))


def test_foreign_batch_norm_and_missing_running_stats_raise():
    x = torch.rand(2, 1, 4, 4)
    m = _PlainBN().train()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"bn \(spikingjelly.*BatchNorm2d\).*szo.models.streaming.BatchNorm2d"):
            m(x, time_chunk=1)
        m.eval()
        _close(m(x, time_chunk=1), m(x))  # eval-mode BN of any class streams exactly
        m2 = _PlainBN(track=False).eval()  # no running stats: batch statistics even in eval mode
        with pytest.raises(ValueError, match="stream_bn='running' needs running statistics"):
            m2(x, time_chunk=1, stream_bn="running")
        _close(m2(x, time_chunk=1, stream_bn="exact"), m2(x))


def test_failed_forward_leaves_no_stream_attached():
    m = _model("spike_convnet").train()
    with torch.no_grad(), pytest.raises(RuntimeError):
        m(torch.rand(2, 3, 8, 8), time_chunk=1)  # wrong channel count
    assert all(mod.stream_policy is None for mod in m.modules() if isinstance(mod, BatchNorm2d))
    with torch.no_grad():
        m(_input("spike_convnet"))  # still an ordinary model


def test_bn_layer_reused_within_a_step_is_rejected():
    class Reuse(_PlainBN):
        def __init__(self):
            super().__init__()
            self.bn = BatchNorm2d(2, step_mode="m")

        def forward_seq(self, x_seq):
            return self.fc(self.flat(self.sn(self.bn(self.bn(self.conv(x_seq))))))

    with torch.no_grad(), pytest.raises(ValueError, match="once per time step"):
        Reuse().train()(torch.rand(2, 1, 4, 4), time_chunk=1, stream_bn="running")
