"""Forward-mode AD through the SpikingJelly LIF: same spikes, JVP = autograd's directional derivative."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from spikingjelly.activation_based import functional, layer, neuron, surrogate
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


# ---------------------------------------------------------------------- SpikingJelly's other neurons (issue 40)
def _sj_net(node: str, step_mode: str):
    """A SpikingJelly network with the tutorial's IFNode or a ParametricLIFNode (its learnable ``w``
    is a parameter the tangent reaches), float64, multi- or single-step."""
    torch.manual_seed(3)
    make = {"if": lambda: neuron.IFNode(surrogate_function=surrogate.ATan()),
            "plif": lambda: neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.Sigmoid()),
            "lif": lambda: neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan())}[node]
    net = torch.nn.Sequential(layer.Conv2d(1, 4, 3, padding=1), layer.BatchNorm2d(4), make(), layer.Flatten(),
                              layer.Linear(4 * 6 * 6, 10), make())
    functional.set_step_mode(net, step_mode)
    with torch.no_grad():
        net[4].weight.mul_(6)  # the output neurons fire at this initialisation
    return net.double().train()


def _sj_forward(net, x):
    functional.reset_net(net)
    if net[2].step_mode == "m":
        return net(x)
    return torch.stack([net(xt) for xt in x])


@pytest.mark.parametrize("step_mode", ["m", "s"])
@pytest.mark.parametrize("node", ["if", "plif", "lif"])
def test_spikingjelly_neurons_jvp_equals_autograd_and_spikes_equal_its_ops(node, step_mode):
    """IFNode (the tutorial network's), ParametricLIFNode and a single-step LIFNode: inside
    jvp_neurons the spikes are SpikingJelly's custom ops' and grad.v is autograd's through them."""
    net = _sj_net(node, step_mode)
    g = torch.Generator().manual_seed(4)
    x = 3 * torch.rand(3, 5, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (5,), generator=g)
    tang = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in net.named_parameters()}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    out = _sj_forward(net, x)
    loss = torch.nn.functional.cross_entropy(out.mean(0) * 5, y)
    loss.backward()
    oracle = sum((p.grad * tang[n]).sum() for n, p in net.named_parameters())
    net.load_state_dict(state)
    surrogates = [m.surrogate_function for m in net.modules() if hasattr(m, "surrogate_function")]
    functional.reset_net(net)
    with torch.no_grad(), jvp_neurons(net), fwAD.dual_level():
        duals = {n: fwAD.make_dual(p.detach(), tang[n]) for n, p in net.named_parameters()}
        got = functional_call(net, duals, (x,)) if step_mode == "m" else None
        if got is None:
            functional.reset_net(net)
            got = torch.stack([functional_call(net, duals, (xt,)) for xt in x])
        spikes, _ = fwAD.unpack_dual(got)
        val, jvp = fwAD.unpack_dual(torch.nn.functional.cross_entropy(got.mean(0) * 5, y))
    assert torch.equal(spikes, out.detach()) and out.sum() > 0  # the custom ops' spikes
    assert abs(float(val) - float(loss.detach())) < 1e-12
    assert abs(float(oracle)) > 1e-3
    assert abs(float(jvp) - float(oracle)) < 1e-5 * max(1.0, abs(float(oracle)))
    # the neurons have their own surrogates back, and the parameter names never changed
    assert [m.surrogate_function for m in net.modules() if hasattr(m, "surrogate_function")] == surrogates
    assert [n for n, _ in net.named_parameters()] == list(tang)


def test_an_operation_without_a_forward_mode_rule_is_one_line():
    class Clip(torch.autograd.Function):  # a backward rule only, as SpikingJelly's surrogates have
        @staticmethod
        def forward(ctx, x):
            return x.clamp(0, 1)

        @staticmethod
        def backward(ctx, g):
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return Clip.apply(self.fc(x))

    from szo.optim import ForwardGradient

    net = Net()
    opt = ForwardGradient(net.parameters(), model=net)
    x, y = torch.rand(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="forward-mode AD through every operation") as e:
        opt.step(lambda: torch.nn.functional.cross_entropy(net(x), y))
    assert "\n" not in str(e.value) and "zeroth-order method" in str(e.value)


def _sj_surrogates() -> list[str]:
    """Every surrogate SpikingJelly ships that builds with its defaults in spiking mode."""
    base = surrogate.SurrogateFunctionBase
    out = []
    for name in sorted(dir(surrogate)):
        cls = getattr(surrogate, name)
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base:
            try:
                if cls().spiking:
                    out.append(name)
            except TypeError:  # needs arguments
                continue
    return out


PASS_THROUGH = ("DeterministicPass", "PoissonPass")  # straight-through encoders (PoissonPass draws Bernoulli spikes)


@pytest.mark.parametrize("name", [n for n in _sj_surrogates() if n not in PASS_THROUGH])
def test_every_spikingjelly_surrogate_has_a_forward_mode_spike(name):
    """Each surrogate a SpikingJelly network may use spikes under forward-mode AD (fg, fg-subspace,
    asyncfgd): the Heaviside step in value, and as tangent the derivative SpikingJelly's own backward
    gives -- through its backward rule where it has one, else its primitive function (S2NN)."""
    sg = getattr(surrogate, name)()
    x = torch.linspace(-2.05, 2.05, 83, dtype=torch.float64, requires_grad=True)  # 0 itself excluded (a kink)
    sg(x).sum().backward()
    with fwAD.dual_level():
        val, tan = fwAD.unpack_dual(surrogate_spike(fwAD.make_dual(x.detach(), torch.ones_like(x)), sg))
    assert torch.equal(val, (x.detach() >= 0).double())
    torch.testing.assert_close(tan, x.grad, rtol=1e-4, atol=1e-6)


def test_a_surrogate_with_neither_a_primitive_nor_a_rule_is_one_line():
    class Own(torch.nn.Module):  # a user's spike function: Heaviside with no forward-mode rule anywhere
        spiking = True

        def forward(self, x):
            return (x >= 0).to(x)

    for sg, name in ((Own(), "Own"), *((getattr(surrogate, n)(), n) for n in PASS_THROUGH)):
        with pytest.raises(ValueError, match="^forward-mode AD needs a SpikingJelly surrogate with a backward rule or "
                                             f"a primitive function named by its hyperparameters; {name} has neither$"):
            surrogate_spike(torch.zeros(3), sg)
