"""SZO / BP-Subspace / full-space ZO optimizers."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from szo.functional import zo as F
from szo.optim import SZO, BPSubspace, FullSpaceZO, build_optimizer
from szo.zo import ProbePath


class Tiny(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3) if bn else nn.Identity()
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model, vec):
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vec[off : off + p.numel()].view_as(p))
            off += p.numel()


def subspace_for(model, k, seed=0, dtype=torch.float64):
    d = sum(p.numel() for p in model.parameters())
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    layout = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return SimpleNamespace(basis=q.to(dtype), layout=layout)


def data(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_update_equals_eq6_in_parameter_space():
    """Coordinates + momentum on c reproduce theta_{t+1} = theta_t - lr g + beta (theta_t - theta_{t-1})."""
    torch.manual_seed(0)
    model = Tiny().double()
    sub = subspace_for(model, 5)
    x, y = data()
    x = x.double()
    lr, beta, mu = 0.3, 0.9, 0.05
    opt = SZO(model.parameters(), sub, mu=mu, lr=lr, momentum=beta, estimator="cge", model=model, scale="absolute")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)

    ref = Tiny().double()
    ref.load_state_dict(model.state_dict())

    def loss_at(vec):
        load(ref, vec)
        return nn.functional.cross_entropy(ref(x), y)

    theta_prev = flat(ref)
    theta = theta_prev.clone()
    for t in range(6):
        cur_lr = opt.param_groups[0]["lr"]
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
        sched.step()
        g = F.cge(loss_at, theta, sub.basis, mu)
        theta_next = theta - cur_lr * g + beta * (theta - theta_prev)
        theta_prev, theta = theta, theta_next
        torch.testing.assert_close(flat(model), theta, rtol=0, atol=1e-12)


def test_probes_restore_parameters_bit_exactly_and_count_forwards():
    model = Tiny()
    sub = subspace_for(model, 3, dtype=torch.float32)
    x, y = data()
    before = flat(model)
    seen = []
    opt = SZO(model.parameters(), sub, mu=1.0, lr=0.0, momentum=0.0, estimator="cge", model=model, scale="absolute")

    def closure():
        seen.append(flat(model))
        return nn.functional.cross_entropy(model(x), y)

    opt.step(closure)
    assert opt.forward_passes == 6 == opt.forwards_per_step
    assert torch.equal(flat(model), before)  # lr = 0: no move, exact restore
    # probe j is theta + mu * (+/-) v_i
    for i in range(3):
        v = sub.basis[:, i].float()
        torch.testing.assert_close(seen[i], before + v)
        torch.testing.assert_close(seen[3 + i], before - v)


@pytest.mark.parametrize("bn_update", ["probe-mean", "recompute"])
def test_bn_running_stats_identical_for_all_probes_and_updated_once(bn_update):
    model = Tiny(bn=True)
    model.train()
    sub = subspace_for(model, 4, dtype=torch.float32)
    x, y = data(n=32)
    bn = model.bn
    rm0, rv0, n0 = bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)
    seen, after_probe = [], []

    def closure():
        seen.append((bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)))
        out = model(x)
        after_probe.append(bn.running_mean.clone())
        return nn.functional.cross_entropy(out, y)

    opt = SZO(model.parameters(), sub, mu=0.5, lr=0.1, momentum=0.9, model=model, probes=ProbePath(bn_update=bn_update), scale="absolute")
    opt.step(closure)
    assert len(seen) == opt.forwards_per_step == 8 + (bn_update == "recompute")
    for rm, rv, n in seen:  # every probe (and the BN forward) starts from the step's statistics
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0) and n == n0
    assert int(bn.num_batches_tracked) == n0 + 1
    if bn_update == "probe-mean":  # one BN update with the probes' mean statistics
        torch.testing.assert_close(bn.running_mean, torch.stack(after_probe).mean(0))
    else:  # exactly what the unperturbed forward of theta_{t+1} (the last call) produced
        assert opt.last_outputs_unperturbed
        assert torch.equal(bn.running_mean, after_probe[-1])
    assert not torch.equal(bn.running_mean, rm0)


def test_rge_reproducible_and_state_dict_resume():
    x, y = data()

    def run(steps, resume_at=None):
        torch.manual_seed(0)
        model = Tiny()
        sub = subspace_for(model, 6, dtype=torch.float32)
        opt = SZO(model.parameters(), sub, estimator="rge", q=2, lr=0.1, model=model,
                  generator=torch.Generator().manual_seed(42), scale="absolute")
        closure = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
        for t in range(steps):
            if resume_at is not None and t == resume_at:
                sd_model, sd_opt = model.state_dict(), opt.state_dict()
                model = Tiny()
                model.load_state_dict(sd_model)
                opt = SZO(model.parameters(), sub, estimator="rge", q=2, lr=0.1, model=model,
                          generator=torch.Generator().manual_seed(999), scale="absolute")
                opt.load_state_dict(sd_opt)
                closure = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
            opt.step(closure)
        return flat(model), opt

    a, oa = run(5)
    b, _ = run(5)
    c, oc = run(5, resume_at=2)
    assert torch.equal(a, b)
    assert torch.equal(a, c)
    assert oa.forward_passes == oc.forward_passes == 20


def test_szo_cge_decreases_loss():
    torch.manual_seed(1)
    model = Tiny()
    d = sum(p.numel() for p in model.parameters())
    sub = subspace_for(model, d, dtype=torch.float32)  # k = d: a rotated full space
    x, _ = data(n=64)
    y = (x[:, 0] > 0).long()  # learnable labels
    opt = SZO(model.parameters(), sub, mu=0.01, lr=0.5, momentum=0.9, model=model, scale="absolute")
    closure = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    with torch.no_grad():
        start = float(closure())
    for _ in range(40):
        opt.step(closure)
    with torch.no_grad():
        assert float(closure()) < 0.5 * start


def test_bp_subspace_projects_the_gradient():
    model = Tiny().double()
    sub = subspace_for(model, 4)
    x, y = data()
    x = x.double()
    theta0 = flat(model)
    opt = BPSubspace(model.parameters(), sub, lr=0.2, momentum=0.9, model=model, scale="absolute")
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    torch.testing.assert_close(flat(model), theta0 - 0.2 * sub.basis @ (sub.basis.T @ g))


def test_full_space_cge_all_coordinates_matches_autograd_on_linear_model():
    model = nn.Linear(3, 1).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    t = torch.randn(8, 1, dtype=torch.float64)
    closure = lambda: ((model(x) - t) ** 2).mean()  # noqa: E731
    loss = closure()
    loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    theta0 = flat(model)
    opt = FullSpaceZO(model.parameters(), estimator="cge", mu=1e-4, lr=0.1, momentum=0.0)
    opt.step(closure)
    assert opt.forward_passes == 8
    torch.testing.assert_close(flat(model), theta0 - 0.1 * g, rtol=1e-6, atol=1e-8)


def test_nan_closure_raises_and_leaves_parameters_untouched():
    model = Tiny(bn=True)
    sub = subspace_for(model, 3, dtype=torch.float32)
    before = flat(model)
    rm = model.bn.running_mean.clone()
    calls = []

    def closure():
        calls.append(1)
        model(torch.randn(8, 4))
        return torch.tensor(float("nan")) if len(calls) == 3 else torch.tensor(1.0)

    opt = SZO(model.parameters(), sub, model=model, scale="absolute")
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(closure)
    assert torch.equal(flat(model), before)
    assert torch.equal(model.bn.running_mean, rm)
    assert opt.subspace_state["step"] == 0

    opt2 = SZO(model.parameters(), sub, model=model, scale="absolute")
    with pytest.raises(ValueError, match="scalar"):
        opt2.step(lambda: torch.ones(2))
    assert torch.equal(flat(model), before)


def test_bad_arguments():
    model = Tiny()
    sub = subspace_for(model, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="mu must be > 0"):
        SZO(model.parameters(), sub, mu=0.0, scale="absolute")
    with pytest.raises(ValueError, match="k = 0"):
        SZO(model.parameters(), SimpleNamespace(basis=torch.zeros(sub.basis.shape[0], 0), layout=sub.layout), scale="absolute")
    with pytest.raises(ValueError, match="unknown estimator"):
        SZO(model.parameters(), sub, estimator="spsa", scale="absolute")
    with pytest.raises(ValueError, match="needs a closure"):
        SZO(model.parameters(), sub, scale="absolute").step()
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"parameter #0 is fc1.weight \[3, 4\] in the subspace but 0.weight"):
        SZO(other.parameters(), sub, model=other, scale="absolute")
    wrong = SimpleNamespace(basis=torch.zeros(7, 2), layout=None)
    with pytest.raises(ValueError, match="d = 7 does not match"):
        SZO(model.parameters(), wrong, scale="absolute")
    with pytest.raises(ValueError, match="unknown method 'adam'"):
        build_optimizer("adam", model, lr=1.0)
    with pytest.raises(ValueError, match="needs a subspace"):
        build_optimizer("szo-cge", model, lr=1.0)


def test_build_optimizer_zo_cge_matches_szo_forward_budget():
    model = Tiny()
    sub = subspace_for(model, 5, dtype=torch.float32)
    szo = build_optimizer("szo-cge", model, subspace=sub, lr=1.0, start="current", scale="absolute")
    zo = build_optimizer("zo-cge", model, subspace=sub, lr=0.1, mu=5e-3)
    assert szo.forwards_per_step == zo.forwards_per_step == 10
