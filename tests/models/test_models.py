"""Model zoo tests, parametrized over the registry (timm style)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from spikingjelly.activation_based import neuron, surrogate
from torch import nn

from szo.models import SpikingModel, create, make_neuron, names, register_model
from szo.models.neurons import TAU, V_TH

# (in_channels, spatial size) of a tiny input per model
INPUT = {
    "spike_convnet": (1, 8),
    "snn_mlp": (7, 10),  # 7 x 10 x 10 = the 700 inputs the SHD networks flatten a frame to
    "snn_rlif": (7, 10),
    "spike_resnet20": (3, 8),
    "spike_resnet8": (1, 28),
    "spike_resnet18": (3, 8),
    "spike_resnet50": (3, 32),
    "spike_vgg11": (2, 32),
}
# paper Table 1 parameter counts, with the class counts they were reported for
TABLE1 = {
    "spike_resnet20": (10, 0.27e6),
    "spike_resnet18": (100, 11.22e6),
    "spike_resnet50": (1000, 25.56e6),
    "spike_vgg11": (11, 9.50e6),
}
SMALL = ["spike_convnet", "spike_resnet20"]
NO_BN = {"snn_mlp", "snn_rlif"}  # the fully connected SHD networks have no BatchNorm

_cache: dict[str, SpikingModel] = {}


def _model(name: str) -> SpikingModel:
    """One default instance per model (building ResNet50 twice is wasted time)."""
    if name not in _cache:
        torch.manual_seed(0)
        _cache[name] = create(name, T=2)
    return _cache[name]


def _input(name: str, n: int = 2, seed: int = 0) -> torch.Tensor:
    c, s = INPUT[name]
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, s, s, generator=g) * 3.0


def test_registry_lists_all_models() -> None:
    assert set(INPUT) <= set(names())
    assert names() == sorted(names())


@pytest.mark.parametrize("name", names())
def test_forward_shape_static_and_sequence(name: str) -> None:
    m = _model(name).eval()
    with torch.no_grad():
        out = m(_input(name))
        assert out.shape == (2, 2, m.num_classes)
        seq = _input(name).unsqueeze(0).repeat(3, 1, 1, 1, 1)
        assert m(seq).shape == (3, 2, m.num_classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(TABLE1))
def test_param_count_matches_table1(name: str) -> None:
    classes, expected = TABLE1[name]
    m = _model(name)
    assert m.num_classes == classes  # default matches the paper's setting
    assert abs(m.num_params() - expected) / expected <= 0.03, m.num_params()


def test_resnet8_is_sized_for_mnist5k() -> None:
    m = _model("spike_resnet8")
    assert m.num_params() == 77_754  # issue 13: a Spike-ResNet of 50k-300k parameters
    assert (m.num_classes, create("spike_resnet8").T) == (10, 4)
    with torch.no_grad():
        feats = m.stages(m.stem(_input("spike_resnet8").unsqueeze(0)))
    assert feats.shape[-2:] == (4, 4)  # 28 -> 14 (stem) -> 14 -> 7 -> 4


def test_convnet_is_small() -> None:
    assert 1_000 < _model("spike_convnet").num_params() < 20_000


@pytest.mark.parametrize("name", names())
def test_flat_params_round_trip_and_order(name: str) -> None:
    m = _model(name)
    flat = m.flat_params()
    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.numel() == m.num_params()
    assert not flat.requires_grad
    # order == named_parameters, each block flattened row-major
    off = 0
    layout = m.param_layout()
    for (lname, shape), (pname, p) in zip(layout, m.named_parameters()):
        assert lname == pname and shape == tuple(p.shape)
        assert torch.equal(flat[off:off + p.numel()], p.detach().reshape(-1))
        off += p.numel()
    assert off == flat.numel() and len(layout) == len(list(m.parameters()))
    # a new tensor, not a view: editing it leaves the model alone
    flat[:5] += 1.0
    assert not torch.equal(m.flat_params()[:5], flat[:5])
    # load a different vector and read it back, then restore
    orig = m.flat_params()
    new = torch.linspace(-1, 1, orig.numel())
    m.load_flat_params(new)
    assert torch.equal(m.flat_params(), new)
    first_name, first_shape = layout[0]
    n0 = torch.Size(first_shape).numel()
    assert torch.equal(dict(m.named_parameters())[first_name].detach().reshape(-1), new[:n0])
    m.load_flat_params(orig)
    assert torch.equal(m.flat_params(), orig)


def test_load_flat_params_keeps_parameter_objects_and_grad() -> None:
    m = create("spike_convnet", T=2)
    before = [id(p) for p in m.parameters()]
    vec = torch.zeros(m.num_params(), dtype=torch.float64)
    m.load_flat_params(vec)
    assert [id(p) for p in m.parameters()] == before
    assert all(p.requires_grad and p.dtype == torch.float32 for p in m.parameters())
    assert m.flat_params().abs().sum() == 0
    vec[0] = 7.0  # the model does not alias the caller's vector
    assert m.flat_params()[0] == 0


def test_load_flat_params_rejects_bad_vectors() -> None:
    m = _model("spike_convnet")
    d = m.num_params()
    with pytest.raises(ValueError, match=f"d={d}"):
        m.load_flat_params(torch.zeros(d + 1))
    with pytest.raises(ValueError, match="1-D"):
        m.load_flat_params(torch.zeros(1, d))
    with pytest.raises(ValueError, match="torch.Tensor"):
        m.load_flat_params([0.0] * d)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", names())
def test_bn_buffers_not_in_flat_vector(name: str) -> None:
    m = _model(name)
    buffers = dict(m.named_buffers())
    assert any(k.endswith("running_mean") for k in buffers) == (name not in NO_BN)
    layout_names = {n for n, _ in m.param_layout()}
    assert not layout_names & set(buffers)
    assert m.num_params() == sum(p.numel() for p in m.parameters())


def test_fingerprint_definition() -> None:
    m = _model("spike_resnet20")
    layout = [[n, list(p.shape)] for n, p in m.named_parameters()]
    expected = hashlib.sha256(json.dumps(["spike_resnet20", layout]).encode()).hexdigest()
    assert m.fingerprint() == expected
    assert create("spike_resnet20", num_classes=5).fingerprint() != expected
    assert create("spike_resnet20", T=7).fingerprint() == expected  # T is not a parameter


@pytest.mark.parametrize("name", SMALL)
def test_state_dict_round_trip(name: str) -> None:
    torch.manual_seed(1)
    a = create(name, T=2)
    a.train()
    with torch.no_grad():
        for _ in range(15):  # move BN running stats to the data so eval-mode layers spike
            a(_input(name, n=4))
    torch.manual_seed(2)
    b = create(name, T=2)
    assert not torch.equal(a.flat_params(), b.flat_params())
    b.load_state_dict(a.state_dict())
    a.eval(), b.eval()
    x = _input(name, seed=3)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert not torch.equal(ya[:, 0], ya[:, 1])  # non-trivial output (spikes reach the head)
    assert torch.equal(ya, yb)
    assert torch.equal(a.flat_params(), b.flat_params())
    for (na, ba), (nb, bb) in zip(a.named_buffers(), b.named_buffers()):
        assert na == nb and torch.equal(ba, bb)


@pytest.mark.parametrize("name", SMALL)
def test_reset_semantics(name: str) -> None:
    # train-mode BN normalises with batch statistics, so every layer spikes at init
    m = create(name, T=2).train()
    x = _input(name, seed=4)
    with torch.no_grad():
        y1, y2 = m(x), m(x)
        assert not torch.equal(y1[:, 0], y1[:, 1])
        assert torch.equal(y1, y2)  # state reset after every forward
        with m.persistent_state():
            p1 = m(x)
            m(10.0 * x)  # strong drive leaves large residual membrane potentials
            p2 = m(x)
        assert torch.equal(p1, y1)
        assert not torch.equal(p2, p1)  # membrane carried over into the later call
        assert torch.equal(m(x), y1)  # reset on exit
        with m.persistent_state():
            m(x)
            m.reset_state()
            assert torch.equal(m(x), y1)


def test_ann_twin_runs_with_T1() -> None:
    m = create("spike_resnet20", T=1, activation="relu").eval()
    assert not any(isinstance(mod, neuron.BaseNode) for mod in m.modules())
    assert any(isinstance(mod, nn.ReLU) for mod in m.modules())
    assert m.num_params() == _model("spike_resnet20").num_params()
    with torch.no_grad():
        out = m(_input("spike_resnet20"))
    assert out.shape == (1, 2, 10)
    # a ReLU network is a continuous function of its input (LIF outputs are not)
    m2 = create("spike_convnet", T=1, activation="relu").eval()
    x = _input("spike_convnet")
    with torch.no_grad():
        d = (m2(x + 1e-4) - m2(x)).abs().max()
    assert 0 < d < 1e-2


def test_factory_arguments_and_model_name() -> None:
    m = create("spike_convnet", num_classes=3, T=5, width=4, in_channels=2)
    assert (m.num_classes, m.T, m.model_name) == (3, 5, "spike_convnet")
    assert m(torch.rand(2, 2, 8, 8)).shape == (5, 2, 3)
    v = create("spike_vgg11", T=1)
    assert v.T == 1 and v.num_classes == 11
    with torch.no_grad():  # adaptive pooling: 64x64 frames give the same layout
        assert v.eval()(torch.rand(1, 2, 64, 64)).shape == (1, 1, 11)


def test_errors() -> None:
    with pytest.raises(ValueError, match="spike_resnet20"):
        create("resnet_does_not_exist")
    with pytest.raises(ValueError, match="relu"):
        create("spike_convnet", activation="tanh")
    with pytest.raises(ValueError, match="T must be a positive int"):
        create("spike_convnet", T=0)
    with pytest.raises(ValueError, match="num_classes"):
        create("spike_convnet", num_classes=-1)
    with pytest.raises(ValueError, match="valid"):
        create("spike_convnet", depth=3)
    m = _model("spike_convnet")
    with pytest.raises(ValueError, match=r"\[N, C, H, W\].*\[T, N, C, H, W\]"):
        m(torch.rand(8, 8))
    with pytest.raises(ValueError, match="got shape"):
        m(torch.rand(1, 2, 2, 1, 8, 8))
    with pytest.raises(ValueError, match="valid"):
        make_neuron("sigmoid")
    with pytest.raises(ValueError, match="tau"):
        make_neuron("lif", taus=2.0)
    with pytest.raises(ValueError, match="no overrides"):
        make_neuron("relu", inplace=True)


@pytest.mark.parametrize("name", ["spike_convnet", "spike_resnet20", "spike_vgg11"])
@pytest.mark.parametrize("bad", [0, -1, 2.7, True, "3"])
def test_in_channels_must_be_a_positive_int(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match="in_channels must be a positive int"):
        create(name, in_channels=bad)


def test_register_model_rejects_duplicates() -> None:
    def spike_resnet20() -> SpikingModel:  # same name as a registered model
        raise RuntimeError("never called")

    with pytest.raises(ValueError, match="already registered"):
        register_model(spike_resnet20)


def test_make_neuron_is_paper_lif() -> None:
    sn = make_neuron()
    assert isinstance(sn, neuron.LIFNode)
    assert sn.tau == TAU == 1.1 and sn.v_threshold == V_TH == 1.0
    assert sn.v_reset is None and sn.decay_input is False and sn.detach_reset is False
    assert sn.step_mode == "m"
    assert isinstance(sn.surrogate_function, surrogate.PiecewiseQuadratic)


def test_lif_follows_eq_1_2_by_hand() -> None:
    """Eq. (1): u[t] = (1-1/tau)(u[t-1] - V_th s[t-1]) + I[t]; eq. (2): s[t] = [u[t] > V_th]."""
    sn = make_neuron("lif", store_v_seq=True)
    # constant input 0.6: never fires, u1 = 0.6, u2 = 0.6/11 + 0.6, u3 = u2/11 + 0.6
    s = sn(torch.full((3, 1), 0.6))
    u2 = 0.6 / 11 + 0.6  # (1 - 1/1.1) = 1/11
    assert u2 == pytest.approx(0.654545, abs=1e-6)
    expected_v = [0.6, u2, u2 / 11 + 0.6]
    assert torch.equal(s.flatten(), torch.zeros(3))
    assert sn.v_seq.flatten().tolist() == pytest.approx(expected_v, abs=1e-6)
    sn.reset()
    # input 1.5, 0.3, 0.99: fires at t1 (soft reset to 0.5), u2 = 0.5/11 + 0.3 = 0.345454..
    # (no spike), u3 = 0.345454/11 + 0.99 = 1.021405 (spike, v -> 0.021405)
    s = sn(torch.tensor([[1.5], [0.3], [0.99]]))
    assert s.flatten().tolist() == [1.0, 0.0, 1.0]
    u2 = 0.5 / 11 + 0.3
    u3 = u2 / 11 + 0.99
    assert u3 == pytest.approx(1.021405, abs=1e-6)
    # v_seq holds the membrane after the soft reset (u - V_th s)
    assert sn.v_seq.flatten().tolist() == pytest.approx([0.5, u2, u3 - 1.0], abs=1e-6)
