"""NIR export / import of zoo models: round trip through a .nir file, metadata, bad input."""
import dataclasses
import re

import h5py
import numpy as np
import pytest
import torch
from spikingjelly.activation_based import layer

pytest.importorskip("nir")
pytest.importorskip("nirtorch")

import nir  # noqa: E402

from szo.export import from_nir, read_nir, to_nir, write_nir  # noqa: E402
from szo.models import create  # noqa: E402


def _randomize_bn(model, seed=0):
    """Non-trivial running statistics and affine BN parameters (so folding is exercised), with
    gains that keep every layer of a deep random network spiking (see test_every_layer_spikes)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) * 2 + 1)
            m.bias.data.copy_(torch.rand(n, generator=g) * 0.6 + 0.2)
    return model.eval()


def _spike_rates(model, x):
    from spikingjelly.activation_based import neuron

    rates = []
    hooks = [m.register_forward_hook(lambda m, i, o: rates.append(float(o.float().mean()))) for m in model.modules()
             if isinstance(m, neuron.LIFNode)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return rates


CASES = [("spike_convnet", (1, 8, 8), {}), ("spike_resnet20", (3, 8, 8), {"num_classes": 5})]


@pytest.mark.parametrize("name,shape,kw", CASES)
def test_file_round_trip_is_bit_exact_in_float64(tmp_path, name, shape, kw):
    torch.manual_seed(0)
    model = _randomize_bn(create(name, **kw))
    write_nir(to_nir(model, shape), tmp_path / "m.nir")
    back = from_nir(tmp_path / "m.nir").eval()
    assert back.T == model.T and back.num_classes == model.num_classes and back.model_name == name
    x = torch.rand(6, *shape, generator=torch.Generator().manual_seed(1)) * 3
    rates = _spike_rates(model, x)
    assert min(rates) > 0.05 and max(rates) < 0.95  # every layer spikes: the comparison is not trivial
    with torch.no_grad():
        a, b = model.double()(x.double()), back.double()(x.double())
    # BN folded into the conv changes membrane values by float rounding only; the spikes, and
    # hence the logits (a Linear of the spikes), are identical
    assert torch.equal(a, b)


def test_resnet_graph_holds_the_residual_add():
    g = to_nir(create("spike_resnet20", num_classes=3), (3, 8, 8))
    into = {}
    for s, d in g.edges:
        into.setdefault(d, []).append(s)
    # the identity shortcut: the block's input spikes and its second conv both feed sn2
    assert sorted(into["stages_0_0_sn2"]) == ["stages_0_0_conv2_0", "stem_1"]
    lif = g.nodes["stages_0_0_sn2"]
    assert isinstance(lif, nir.LIF) and lif.metadata["reset"] == "subtract"
    assert not any(isinstance(n, nir.NIRGraph) for n in g.nodes.values())


def test_lif_fields_encode_the_paper_neuron(tmp_path):
    g = to_nir(create("spike_convnet"), (1, 8, 8), dt=1e-3)
    write_nir(g, tmp_path / "c.nir")
    lif = read_nir(tmp_path / "c.nir").nodes["sn1"]
    # tau_m = tau * dt, r = tau (input not decayed), v_leak = 0, threshold 1
    np.testing.assert_allclose(lif.tau, 1.1e-3, rtol=1e-6)
    np.testing.assert_allclose(lif.r, 1.1, rtol=1e-6)
    assert np.all(lif.v_leak == 0) and np.all(lif.v_threshold == 1.0)
    assert lif.tau.shape == (16, 8, 8)


def test_vgg_maxpool_of_spikes_and_7x7_pool_of_a_2x2_map():
    """VGG11: max pools of spikes -> SumPool2d + Threshold; the adaptive 7x7 pool of a 2x2 map
    (64x64 input) is no AvgPool2d: it is folded into the classifier (2048 inputs, not 25088)."""
    torch.manual_seed(0)
    model = _randomize_bn(create("spike_vgg11", num_classes=4, T=2))
    g = to_nir(model, (2, 64, 64))
    kinds = {type(n).__name__ for n in g.nodes.values()}
    assert {"SumPool2d", "Threshold"} <= kinds and "AvgPool2d" not in kinds
    assert g.nodes["fc"].weight.shape == (4, 512 * 2 * 2)
    back = from_nir(g).eval()
    x = torch.rand(2, 2, 64, 64, generator=torch.Generator().manual_seed(2)) * 3
    rates = _spike_rates(model, x)
    assert len(rates) == 8 and min(rates) > 0.05
    with torch.no_grad():
        a, b = model.double()(x.double()), back.double()(x.double())
    # same spikes; the classifier's folded weight W P is rounded to float32 once: ~1e-7 relative
    assert a.abs().max() > 0.1
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_unsupported_layer_is_named():
    relu = create("spike_convnet", activation="relu")
    with pytest.raises(ValueError, match=r"layer 'sn1' \(torch.nn.modules.activation.ReLU\)"):
        to_nir(relu, (1, 8, 8))
    with pytest.raises(ValueError, match="grouped"):
        m = create("spike_convnet")
        m.conv2 = layer.Conv2d(16, 16, 3, padding=1, groups=2, bias=False, step_mode="m")
        to_nir(m, (1, 8, 8))


def test_bad_arguments():
    m = create("spike_convnet")
    with pytest.raises(ValueError, match="input_shape"):
        to_nir(m, (8, 8))
    with pytest.raises(ValueError, match="dt"):
        to_nir(m, (1, 8, 8), dt=0)
    with pytest.raises(ValueError, match="SpikingModel"):
        to_nir(torch.nn.Linear(2, 2), (1, 8, 8))


def test_malformed_files_raise_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        from_nir(tmp_path / "missing.nir")
    junk = tmp_path / "junk.nir"
    junk.write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match="junk.nir is not a valid NIR file"):
        from_nir(junk)
    good = tmp_path / "good.nir"
    write_nir(to_nir(create("spike_convnet"), (1, 8, 8)), good)
    with h5py.File(good, "r+") as f:
        del f["node/nodes/conv1/weight"]
    with pytest.raises(ValueError, match=r"node 'conv1' \(Conv2d\): .*'weight'"):
        from_nir(good)


@dataclasses.dataclass(eq=False)
class _Mystery(nir.NIRNode):
    input_type: dict


def test_unknown_node_and_bad_lif_fields_are_named():
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.nodes["sn1"].r = np.full_like(g.nodes["sn1"].r, 0.5)
    with pytest.raises(ValueError, match=r"NIR node 'sn1': LIF field 'r'"):
        from_nir(g)
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.nodes["sn2"] = _Mystery(input_type={"input": np.array([16, 8, 8])})  # a node type NIR may add later
    every = ["Affine", "AvgPool2d", "Conv1d", "Conv2d", "CubaLI", "CubaLIF", "Delay", "Flatten", "I", "IF", "Input", "LI",
             "LIF", "Linear", "Output", "Scale", "SumPool2d", "Threshold"]  # NIR 1.0's 16 primitives, Input, Output
    with pytest.raises(ValueError, match=re.escape(f"NIR node 'sn2' has type _Mystery, which szo cannot run; "
                                                   f"supported: {every}")):
        from_nir(g)
    g = to_nir(create("spike_convnet"), (1, 8, 8))  # a CubaLIF of 3 neurons where 16x8x8 arrive
    g.nodes["sn2"] = nir.CubaLIF(tau_syn=np.ones(3), tau_mem=np.ones(3), r=np.ones(3), v_leak=np.zeros(3),
                                 v_threshold=np.ones(3))
    with pytest.raises(ValueError, match=r"^NIR node 'sn2' cannot take its input of shape \[16, 8, 8\] \(per sample\)"):
        from_nir(g)
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.nodes["sn1"].metadata["reset"] = "bounce"
    with pytest.raises(ValueError, match=r"metadata 'reset'"):
        from_nir(g)


def test_write_is_atomic_and_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.nir"
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    write_nir(g, path)
    before = path.read_bytes()
    import nir as nir_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(nir_mod, "write", boom)
    with pytest.raises(OSError):
        write_nir(g, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.nir"]


def test_fixed_point_network_exports_integer_weights_and_exponents(tmp_path):
    from szo.hw.convert import to_fixed
    from szo.hw.fixed import STATE_SHIFT, decay_to_int

    torch.manual_seed(0)
    net = to_fixed(_randomize_bn(create("spike_convnet")))
    write_nir(to_nir(net, (1, 8, 8)), tmp_path / "f.nir")
    g = read_nir(tmp_path / "f.nir")
    q = net.quantized_layers()
    assert int(g.metadata["fixed_point"]) == 1 and int(g.metadata["precision_weight_bits"]) == 8
    for path in ("conv1", "conv2", "fc"):
        node, ql = g.nodes[path], q[path]
        assert np.array_equal(node.metadata["w_int"], ql["w_int"].numpy())
        assert int(node.metadata["exp"]) == ql["exp"]
        # the float weight NIR carries is exactly w_int * 2**exp (BN and the pool factor folded in)
        assert np.array_equal(node.weight, (ql["w_int"].double() * 2.0 ** ql["exp"]).float().numpy())
        np.testing.assert_array_equal(node.bias * (1 << STATE_SHIFT), ql["bias_int"].numpy())
    assert type(g.nodes["pool"]).__name__ == "SumPool2d"  # the chip's sum pool; 1/4 is in fc's w_int
    d = decay_to_int(1 / 1.1)
    assert int(g.nodes["sn1"].metadata["voltage_decay_int"]) == d
    np.testing.assert_allclose(g.nodes["sn1"].tau, 1e-4 * 4096 / d, rtol=1e-6)
    back = from_nir(g)
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert back(x).shape == (4, 3, 10)


SIZES = {"spike_convnet": 8, "spike_vgg11": 64}


@pytest.mark.parametrize("name", __import__("szo.models", fromlist=["names"]).names())
def test_every_registered_model_round_trips(name):
    """Every model of the zoo exports, and its import computes the same logits (float64, T = 1)."""
    torch.manual_seed(0)
    model = _randomize_bn(create(name, num_classes=3, T=1))
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    if first is None:  # the fully connected SHD networks: a frame of 700 channel values
        shape = (1, 1, model.in_features)
        with torch.no_grad():
            model.hidden[0].weight.mul_(20.0) if name == "snn_mlp" else model.hidden[0].fc.weight.mul_(20.0)
    else:
        shape = (first.in_channels, SIZES.get(name, 32), SIZES.get(name, 32))
    if name == "snn_rlif":  # a per-step recurrence: not traced, refused in one line
        with pytest.raises(ValueError, match="cannot export snn_rlif to NIR: its forward does not trace"):
            to_nir(model, shape)
        return
    back = from_nir(to_nir(model, shape)).eval()
    x = torch.rand(1, *shape, generator=torch.Generator().manual_seed(3)) * 3
    assert min(_spike_rates(model, x)) > 0.1  # every layer spikes
    with torch.no_grad():
        a, b = model.double()(x.double()), back.double()(x.double())
    # same spikes; only VGG's folded 7x7 classifier weight is rounded to float32 (~1e-7 relative)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_graphs_szo_cannot_run_faithfully_are_refused(tmp_path):
    """A node the Input does not reach, an edge into the Input, T = 1e9 (an allocator error),
    all-NaN weights: each one line, also through a .nir file.
    (Recurrent edges and cycles run: tests/export/test_nir_recurrent.py.)"""
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.nodes["stray"] = nir.Affine(np.ones((10, 10), dtype=np.float32), np.zeros(10, dtype=np.float32))
    inp, out = (next(k for k, v in g.nodes.items() if isinstance(v, t)) for t in (nir.Input, nir.Output))
    g.edges.append(("stray", out))
    with pytest.raises(ValueError, match=rf"node\(s\) 'stray' cannot be reached from the Input node '{inp}'"):
        from_nir(g)
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.edges.append(("sn1", inp))
    with pytest.raises(ValueError, match=rf"edge \('sn1', '{inp}'\) leads into the Input node"):
        from_nir(g)
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    g.metadata["T"] = 1_000_000_000
    write_nir(g, tmp_path / "bigT.nir")
    with pytest.raises(ValueError, match=r"T = 1000000000 time steps is out of range; szo runs 1 <= T <= 10000"):
        from_nir(tmp_path / "bigT.nir")
    g = to_nir(create("spike_convnet"), (1, 8, 8))
    conv = next(n for n, v in g.nodes.items() if hasattr(v, "weight"))
    g.nodes[conv].weight = np.full_like(g.nodes[conv].weight, np.nan)
    with pytest.raises(ValueError, match=rf"NIR node '{conv}': weight holds \d+ non-finite value"):
        from_nir(g)


CSNN = "spikingjelly:conv_fashion_mnist.CSNN"


def _spiking_csnn(channels=8):
    """SpikingJelly's Fashion-MNIST tutorial network (the fmnist recipes' model) with folded BN
    statistics and classifier gains that make every IF layer spike."""
    from szo.models import create

    torch.manual_seed(0)
    model = _randomize_bn(create(CSNN, T=4, channels=channels, num_classes=10))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data.mul_(6)
    return model.eval()


def test_spikingjelly_tutorial_csnn_exports_and_imports_exactly(tmp_path):
    """The CSNN (direct encoding over T, IF neurons, max pools of spikes, firing-rate readout) was a
    NotImplementedError traceback ("ForeignModel must implement forward_seq")."""
    from spikingjelly.activation_based import neuron

    model = _spiking_csnn()
    g = to_nir(model, (1, 28, 28))
    assert g.metadata["output"] == "rate" and int(g.metadata["T"]) == 4
    kinds = sorted(type(v).__name__ for v in g.nodes.values())
    assert kinds.count("IF") == 4 and kinds.count("SumPool2d") == 2 and "LIF" not in kinds
    if_node = g.nodes["net_conv_fc_2"]
    assert np.allclose(if_node.r, 1e4) and np.all(if_node.v_reset == 0) and if_node.metadata["reset"] == "value"
    write_nir(g, tmp_path / "csnn.nir")
    back = from_nir(tmp_path / "csnn.nir").eval()
    x = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    rates = []
    hooks = [m.register_forward_hook(lambda m, i, o: rates.append(float(o.float().mean()))) for m in model.modules()
             if isinstance(m, neuron.IFNode)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    assert len(rates) == 4 and min(rates) > 0.05 and max(rates) < 0.95  # every layer spikes: not a trivial match
    with torch.no_grad():
        a, b = model.double()(x.double()), back.double()(x.double())
    assert a.shape == b.shape == (1, 8, 10)  # the firing rate, as the foreign model gives it
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_foreign_network_of_another_form_is_one_line():
    from szo.models.foreign import ForeignModel

    class NoEncoding(torch.nn.Module):  # expects [T, N, ...] already: nothing says how a frame becomes T steps
        def __init__(self):
            super().__init__()
            self.fc = layer.Linear(4, 3, step_mode="m")

        def forward(self, x):
            return self.fc(x.flatten(2)).mean(0)

    model = ForeignModel(NoEncoding(), num_classes=3, T=2, model_name="custom")
    with pytest.raises(ValueError, match=r"^cannot export custom to NIR: its input encoding is not a repetition of the "
                                         r"frame over T = 2 steps; .*tutorial form"):
        to_nir(model, (1, 2, 2))


def _fixed_graph():
    from szo.hw.convert import to_fixed

    torch.manual_seed(0)
    return to_nir(to_fixed(_randomize_bn(create("spike_convnet"))), (1, 8, 8))


def test_fixed_point_graph_whose_integers_disagree_with_its_floats_is_refused(tmp_path):
    """What a chip loads (w_int, bias_int, threshold_int, voltage_decay_int) and what a float
    simulator runs must be one network; an edited mantissa was imported without a word."""
    g = _fixed_graph()
    from_nir(g)  # as exported: consistent
    g.nodes["conv2"].metadata["w_int"][0, 0, 0, 0] += 1
    write_nir(g, tmp_path / "w.nir")
    with pytest.raises(ValueError, match=r"^NIR node 'conv2': its integer weights w_int \* 2\*\*exp disagree\(s\) with "
                                         r"its float field at 1 of 2304 entries .*a chip loads the integers"):
        from_nir(tmp_path / "w.nir")
    g = _fixed_graph()
    g.nodes["fc"].metadata["bias_int"][3] -= 7
    with pytest.raises(ValueError, match=r"'fc': its integer bias bias_int / 2\*\*12 disagree"):
        from_nir(g)
    g = _fixed_graph()  # int8 mantissas of 1000, weights edited to match: out of the graph's 8-bit range
    node = g.nodes["conv1"]
    node.metadata["w_int"][:] = 1000
    node.weight = np.full_like(node.weight, 1000 * 2.0 ** int(node.metadata["exp"]))
    with pytest.raises(ValueError, match=r"'conv1': 144 integer weight\(s\) \(metadata w_int\) outside the graph's "
                                         r"8-bit range \[-128, 127\]"):
        from_nir(g)
    g = _fixed_graph()
    g.nodes["sn1"].metadata["threshold_int"] = 5000
    with pytest.raises(ValueError, match=r"'sn1': metadata threshold_int = 5000 is not the float threshold 1"):
        from_nir(g)
    g = _fixed_graph()
    g.nodes["sn2"].metadata["voltage_decay_int"] = 2048
    with pytest.raises(ValueError, match=r"'sn2': metadata voltage_decay_int = 2048 is not the float tau"):
        from_nir(g)
    g = _fixed_graph()
    del g.nodes["fc"].metadata["w_int"]
    with pytest.raises(ValueError, match=r"'fc': the graph is fixed-point .* has no integer weights"):
        from_nir(g)
