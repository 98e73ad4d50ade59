"""Forward-gradient optimizers (szo.optim.fg) against autograd: full space, subspace, BN, errors."""
import copy

import pytest
import torch

import szo.models as M
from szo.functional import zo as F
from szo.losses import tet_loss
from szo.optim import ForwardGradient, SubspaceForwardGradient, build_optimizer

from .test_szo import Tiny, data, flat, subspace_for


def _grad(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    model.zero_grad(set_to_none=True)
    return g


def test_full_space_step_is_the_forward_gradient_of_autograd():
    torch.manual_seed(0)
    model = Tiny().double()
    x, y = data()
    x = x.double()
    theta0, grad = flat(model), _grad(model, x, y)
    lr, q = 0.05, 3
    opt = ForwardGradient(model.parameters(), model=model, lr=lr, momentum=0.0, q=q,
                          generator=torch.Generator().manual_seed(7))
    opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y))
    z = F.sample_gaussian(q, theta0.numel(), torch.Generator().manual_seed(7), dtype=torch.float32).double()
    expected = theta0 - lr * ((z @ grad)[:, None] * z).mean(0)
    assert torch.allclose(flat(model), expected, atol=1e-6)
    assert opt.forward_passes == q and opt.forwards_per_step == q


def test_subspace_step_is_the_projected_forward_gradient():
    torch.manual_seed(1)
    model = Tiny().double()
    x, y = data(1)
    x = x.double()
    sub = subspace_for(model, 4)
    theta0, grad = flat(model), _grad(model, x, y)
    lr, q = 0.2, 2
    opt = SubspaceForwardGradient(model.parameters(), sub, model=model, lr=lr, momentum=0.0, q=q,
                                  generator=torch.Generator().manual_seed(3))
    opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y))
    z = F.sample_gaussian(q, 4, torch.Generator().manual_seed(3), dtype=torch.float64)
    P = sub.basis
    g_c = ((z @ (P.t() @ grad))[:, None] * z).mean(0)
    assert torch.allclose(flat(model), theta0 - lr * P @ g_c, atol=1e-10)
    assert torch.allclose(opt.coordinates, -lr * g_c, atol=1e-12)


def test_functional_forward_gradient_on_a_quadratic():
    A = torch.diag(torch.arange(1.0, 6.0, dtype=torch.float64))
    theta = torch.ones(5, dtype=torch.float64)
    directions = torch.eye(5, dtype=torch.float64)
    got = F.forward_gradient(lambda t: 0.5 * t @ A @ t, theta, directions, q=4,
                             generator=torch.Generator().manual_seed(0))
    z = F.sample_gaussian(4, 5, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(got, ((z @ (A @ theta))[:, None] * z).mean(0), atol=1e-12)


def test_spiking_model_bn_stats_and_loss_equal_a_plain_forward():
    torch.manual_seed(0)
    model = M.create("spike_convnet", num_classes=10, T=2).train()
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    ref = M.create("spike_convnet", num_classes=10, T=2).train()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain = float(tet_loss(ref(x), y))
    opt = build_optimizer("fg", model, lr=0.0, momentum=0.0, q=1)
    loss = opt.step(lambda: tet_loss(model(x), y))
    assert abs(float(loss) - plain) < 1e-5
    for name in ("bn1.running_mean", "bn2.running_var", "bn1.num_batches_tracked"):
        assert torch.allclose(model.state_dict()[name].float(), ref.state_dict()[name].float(), atol=1e-6), name
    assert torch.equal(flat(model), flat(ref))  # lr = 0: parameters untouched


def test_state_dict_resumes_bit_exactly():
    torch.manual_seed(0)
    x, y = data()
    closure_for = lambda m: (lambda: torch.nn.functional.cross_entropy(m(x), y))  # noqa: E731
    a = Tiny()
    opt_a = ForwardGradient(a.parameters(), model=a, lr=0.05, q=1)
    opt_a.step(closure_for(a))
    b = Tiny()
    b.load_state_dict(a.state_dict())
    opt_b = ForwardGradient(b.parameters(), model=b, lr=0.05, q=1, generator=torch.Generator().manual_seed(99))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through a checkpoint file
    for _ in range(2):
        opt_a.step(closure_for(a))
        opt_b.step(closure_for(b))
    assert torch.equal(flat(a), flat(b)) and opt_b.forward_passes == 3


def test_bad_input_gets_one_clear_error():
    model = Tiny()
    x, y = data()
    with pytest.raises(ValueError, match="needs model"):
        ForwardGradient(model.parameters(), model=None)
    with pytest.raises(ValueError, match="all of the model's parameters"):
        ForwardGradient(list(model.parameters())[:1], model=model)
    with pytest.raises(ValueError, match="q must be"):
        ForwardGradient(model.parameters(), model=model, q=0)
    opt = ForwardGradient(model.parameters(), model=model)
    before = flat(model)
    with pytest.raises(ValueError, match="does not depend on the parameters"):
        opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y).detach())
    with pytest.raises(ValueError, match="needs a closure"):
        opt.step()
    assert torch.equal(flat(model), before)
    with pytest.raises(ValueError, match="needs a subspace"):
        build_optimizer("fg-subspace", model, lr=0.1)


def test_streaming_forward_is_rejected_in_config_and_optimizer():
    from szo.config import load_recipe

    with pytest.raises(ValueError, match="method 'fg' takes forward-mode derivatives"):
        load_recipe("digits-scratch", ["method=fg", "szo.time_chunk=1"])
    model = M.create("spike_convnet", num_classes=10, T=2).set_streaming(1)
    with pytest.raises(ValueError, match="method 'fg' takes forward-mode derivatives"):  # the same rule
        build_optimizer("fg", model, lr=0.1)
    opt = ForwardGradient(model.parameters(), model=model, lr=0.1)  # built directly: its JVP refuses the chunked forward
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="multi-step forward"):
        opt.step(lambda: tet_loss(model(x), y))
