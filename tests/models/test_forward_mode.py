"""Forward-mode AD through the SpikingJelly LIF: same spikes, JVP = autograd's directional derivative."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from spikingjelly.activation_based import surrogate
from torch.func import functional_call

import szo.models as M
from szo.losses import tet_loss
from szo.models.forward_mode import jvp_neurons, surrogate_spike
from szo.models.neurons import make_neuron


def _model(seed=0):
    torch.manual_seed(seed)
    return M.create("spike_convnet", num_classes=10, T=4).double().train()


def _batch(seed=1, n=16):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


def test_pure_torch_lif_spikes_and_state_equal_spikingjelly():
    node = make_neuron("lif")
    x = 1.5 * torch.randn(6, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = node(x)
    v_ref = node.v.clone()
    node.reset()
    with jvp_neurons(node):
        got = node(x)
    assert torch.equal(got, ref) and ref.sum() > 0
    assert torch.allclose(node.v, v_ref, atol=1e-12)
    assert "multi_step_forward" not in node.__dict__  # the override is gone after the block


def test_surrogate_spike_derivative_is_spikingjelly_backward():
    x = torch.linspace(-2, 2, 41, dtype=torch.float64, requires_grad=True)
    sg = surrogate.PiecewiseQuadratic()
    sg(x).sum().backward()
    ref = x.grad.clone()
    with fwAD.dual_level():
        out = surrogate_spike(fwAD.make_dual(x.detach(), torch.ones_like(x)), sg)
        val, tan = fwAD.unpack_dual(out)
    assert torch.equal(val, (x.detach() >= 0).double())
    assert torch.allclose(tan, ref, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_jvp_equals_autograd_directional_derivative_through_the_surrogate(seed):
    """The issue's oracle: forward-mode grad.v == autograd grad (SpikingJelly's LIF op + surrogate) . v, 1e-5."""
    model = _model(seed)
    x, y = _batch(seed + 10)
    g = torch.Generator().manual_seed(seed)
    tang = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    loss = tet_loss(model(x), y)
    loss.backward()
    oracle = sum((p.grad * tang[n]).sum() for n, p in model.named_parameters())
    model.load_state_dict(state)
    with torch.no_grad(), jvp_neurons(model), fwAD.dual_level():
        duals = {n: fwAD.make_dual(p.detach(), tang[n]) for n, p in model.named_parameters()}
        val, jvp = fwAD.unpack_dual(tet_loss(functional_call(model, duals, (x,)), y))
    assert abs(float(val) - float(loss.detach())) < 1e-12
    assert abs(float(oracle)) > 1e-3  # a real, non-vanishing derivative
    assert abs(float(jvp) - float(oracle)) < 1e-5


def test_non_spiking_surrogate_is_rejected():
    node = make_neuron("lif", surrogate_function=surrogate.PiecewiseQuadratic(spiking=False))
    with pytest.raises(ValueError, match="spiking mode"):
        with jvp_neurons(node):
            pass
