"""Round trip in someone else's simulator: szo -> NIR -> snnTorch's importer, same input, same output."""
import pytest
import torch

pytest.importorskip("snntorch")
pytest.importorskip("nirtorch")

from spikingjelly.activation_based import functional, neuron  # noqa: E402

from szo.export import from_nir, to_nir  # noqa: E402
from szo.export.simulators import run_snntorch, snntorch_from_nir  # noqa: E402
from szo.models import create, make_neuron  # noqa: E402
from tests.export.test_nir_exchange import _randomize_bn, _spike_rates  # noqa: E402


def _hard_reset(model):
    """The same network with reset-to-0 LIFs (v_reset = 0), which NIR's LIF states exactly."""
    for name, m in list(model.named_modules()):
        if isinstance(m, neuron.LIFNode):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, make_neuron("lif", v_reset=0.0))
    return model


def _seq(model, x):
    return x.unsqueeze(0).repeat(model.T, 1, 1, 1, 1)


CASES = [("spike_convnet", (1, 8, 8), {}), ("spike_resnet20", (3, 8, 8), {"num_classes": 5})]


@pytest.mark.parametrize("name,shape,kw", CASES)
def test_snntorch_reproduces_hard_reset_networks(name, shape, kw):
    """snnTorch's own NIR import, unmodified: same spikes, logits equal to float32 rounding."""
    torch.manual_seed(0)
    model = _randomize_bn(_hard_reset(create(name, **kw)))
    g = to_nir(model, shape)
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(3)) * 3
    assert min(_spike_rates(model, x)) > 0.05  # every layer spikes
    with torch.no_grad():
        ours = model(x)
    run = run_snntorch(snntorch_from_nir(g), _seq(model, x))
    assert not run.late_reset.any()  # a hard reset leaves the membrane at 0
    assert ours.abs().sum() > 0
    # snnTorch decays with beta * v (beta = 1 - dt/tau_m), SpikingJelly with v - v / tau: the
    # membranes differ in the last float32 bit; the spikes agree, so the logits agree to rounding
    torch.testing.assert_close(run.logits, ours, rtol=0, atol=1e-5)


def test_snntorch_soft_reset_neuron_matches_eq1_below_two_thresholds():
    """The paper's LIF (soft reset) vs snnTorch's Leaky(subtract) on the imported graph: equal
    spikes while the current stays below 2 thresholds (no 'late reset', snntorch issue #364)."""
    torch.manual_seed(0)
    model = create("spike_convnet").eval()
    g = to_nir(model, (1, 8, 8))
    sn = snntorch_from_nir(g).sn1
    assert sn.reset_mechanism == "subtract"
    lif = from_nir(g).graph_module.sn1
    cur = torch.rand(6, 3, 16, 8, 8, generator=torch.Generator().manual_seed(4)) * 1.8  # [T, N, C, H, W]
    with torch.no_grad():
        ours = lif(cur)
        functional.reset_net(lif)
        sn.mem = torch.zeros(0)
        theirs = torch.stack([sn(cur[t]) for t in range(cur.shape[0])])
    assert ours.sum() > 0
    assert torch.equal(ours, theirs)


def test_snntorch_late_reset_is_flagged():
    """A current above 2 thresholds makes snnTorch 1.0's subtractive reset depart from eq. (1)-(2):
    run_snntorch flags the sample instead of hiding the difference."""
    torch.manual_seed(0)
    model = create("spike_convnet").eval()
    g = to_nir(model, (1, 8, 8))
    sn = snntorch_from_nir(g).sn1
    lif = from_nir(g).graph_module.sn1
    cur = torch.full((2, 1, 16, 8, 8), 2.5)
    cur[1] = 1.2
    with torch.no_grad():
        ours = lif(cur)
        sn.mem = torch.zeros(0)
        theirs = torch.stack([sn(cur[t]) for t in range(2)])
    # eq. (1)-(2): u = 2.5 -> spike, v = 1.5; u = 0.0909 * 1.5 + 1.2 = 1.34 -> spike, v = 0.34
    assert ours[:, 0, 0, 0, 0].tolist() == [1.0, 1.0]
    # snnTorch: its reset term H(1.5 - 1) = 1 is subtracted first, 0.34 < 1: no spike, v = 1.34
    assert theirs[:, 0, 0, 0, 0].tolist() == [1.0, 0.0]
    net = snntorch_from_nir(g)
    x = torch.full((2, 1, 1, 8, 8), 5.0)  # a strong input: currents above 2 thresholds in sn1
    assert run_snntorch(net, x).late_reset.tolist() == [True]


@pytest.mark.parametrize("name,shape,kw", CASES)
def test_snntorch_with_the_late_reset_patched_reproduces_the_paper_lif(name, shape, kw):
    """The soft-reset (paper) networks: with snnTorch 1.0's carried-over reset term dropped
    (patch_late_reset, the one known departure) snnTorch's executor and layers give szo's
    spikes and logits to float32 rounding -- the graph itself holds eq. (1)-(2) exactly."""
    torch.manual_seed(0)
    model = _randomize_bn(create(name, **kw))
    g = to_nir(model, shape)
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():
        ours = model(x)
    plain = run_snntorch(snntorch_from_nir(g), _seq(model, x))
    patched = run_snntorch(snntorch_from_nir(g, patch_late_reset=True), _seq(model, x))
    torch.testing.assert_close(patched.logits, ours, rtol=0, atol=1e-5)
    assert plain.late_reset.any() and not patched.late_reset.any()
