"""The seed papers' variants, checked against the papers' equations transcribed here (not against
the implementation): SZO's one-point CGE (seed 003, Table 13)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from subspace_store import Subspace
from szo.optim import SZO, build_optimizer


def _setup(seed=0, d_in=5, d_out=3, k=4):
    torch.manual_seed(seed)
    model = nn.Linear(d_in, d_out)
    d = sum(p.numel() for p in model.parameters())
    P, _ = torch.linalg.qr(torch.randn(d, k, dtype=torch.float64))
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    sub = Subspace(basis=P.float(), mean=theta0.clone(), reference=theta0.clone(), eigenvalues=torch.ones(k),
                   explained_variance_ratio=torch.full((k,), 1.0 / k), layout=None, fingerprint=None, model=None,
                   provenance={})
    x, y = torch.randn(8, d_in), torch.randn(8, d_out)
    return model, sub, theta0, P, x, y


def _loss_at(model, theta, x, y):
    w_n = model.weight.numel()
    W = theta[:w_n].reshape(model.weight.shape).float()
    b = theta[w_n:].float()
    return float(torch.nn.functional.mse_loss(x @ W.T + b, y))


def test_szo_cge_one_point_is_table_13s_estimate():
    """g_i = (f(theta + mu p_i) - f(theta)) / mu for i = 1..k, k + 1 forwards; c_1 = -lr g (heavy
    ball from rest), theta_1 = theta_0 + P c_1."""
    model, sub, theta0, P, x, y = _setup()
    mu, lr = 0.1, 0.5
    f0 = _loss_at(model, theta0.double(), x, y)
    g = torch.tensor([(_loss_at(model, theta0.double() + mu * P[:, i], x, y) - f0) / mu for i in range(P.shape[1])],
                     dtype=torch.float64)
    opt = build_optimizer("szo-cge-1pt", model, subspace=sub, lr=lr, mu=mu, momentum=0.9, scale="absolute")
    calls = []

    def closure():
        calls.append(1)
        return torch.nn.functional.mse_loss(model(x), y)

    opt.step(closure)
    assert isinstance(opt, SZO) and opt.estimator == "coord-one-point"
    assert len(calls) == P.shape[1] + 1 == opt.forwards_per_step  # no BN: no recompute forward
    theta1 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    torch.testing.assert_close(theta1, theta0.double() + P @ (-lr * g), rtol=1e-5, atol=1e-6)


def test_asyncfgd_adam_is_adam_on_the_forward_gradient():
    """Seed 001 Algorithm 2 with K = 1 (no staleness): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
    w <- w - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eta), g = (grad L . u) u, over 3 steps."""
    from szo.asyncfgd import stage_tangent
    from szo.optim import AsyncFGD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    lr, b1, b2, eta = 0.05, 0.9, 0.999, 1e-8
    opt = AsyncFGD(model, stages=1, lr=lr, update="adam", seed=7)
    m = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for t in range(1, 4):
        u = stage_tangent(ref, 7, t - 1, 0)  # the tangent of micro-batch t - 1, stage 0
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        d = sum(float((g * u[n]).sum()) for (n, _), g in zip(ref.named_parameters(), grads))
        with torch.no_grad():
            for n, p in ref.named_parameters():
                g = d * u[n]
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                p -= lr * (m[n] / (1 - b1 ** t)) / ((v[n] / (1 - b2 ** t)).sqrt() + eta)
        opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y))
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


def test_asyncfgd_adam_checkpoint_resumes_exactly():
    from szo.optim import AsyncFGD

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    twin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    twin.load_state_dict(net.state_dict())
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    a = AsyncFGD(net, stages=2, lr=0.05, update="adam", seed=3)
    for _ in range(2):
        a.step(lambda: torch.nn.functional.cross_entropy(net(x), y))
    b = AsyncFGD(twin, stages=2, lr=0.05, update="adam", seed=3)
    twin.load_state_dict(net.state_dict())
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        a.step(lambda: torch.nn.functional.cross_entropy(net(x), y))
        b.step(lambda: torch.nn.functional.cross_entropy(twin(x), y))
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_tt_zo_cge_phase_is_seed_000_eq_2_one_sided():
    """Seed 000's CGE is eq. (2) with N = d and xi_i = e_i: g_i = (L(theta + mu e_i) - L(theta)) / mu,
    d + 1 forwards; the first momentum step is theta - lr g. 'central' keeps szo's earlier 2d."""
    from szo.optim import HybridZO

    model, _, theta0, _, x, y = _setup(seed=1)
    d, mu, lr = theta0.numel(), 0.01, 0.3
    f0 = _loss_at(model, theta0.double(), x, y)
    eye = torch.eye(d, dtype=torch.float64)
    g = torch.tensor([(_loss_at(model, theta0.double() + mu * eye[i], x, y) - f0) / mu for i in range(d)])
    opt = HybridZO(list(model.parameters()), model=model, lr=lr, mu=mu, momentum=0.9, switch_step=0)
    calls = []

    def closure():
        calls.append(1)
        return torch.nn.functional.mse_loss(model(x), y)

    opt.step(closure)
    assert opt.phase == "cge" and len(calls) == d + 1 == opt.forwards_per_step
    theta1 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    torch.testing.assert_close(theta1, theta0.double() - lr * g, rtol=1e-4, atol=1e-5)
    central = HybridZO(list(model.parameters()), model=model, lr=lr, mu=mu, switch_step=0, cge="central")
    assert central.forwards_per_step == 2 * d


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def test_node_perturbation_is_algorithm_1s_per_sample_estimate():
    """Seed 004 Algorithm 1, node perturbation of layer 0 (lines 19-29) transcribed: xi_{q,n} per
    sample, g_{z_n} = (1/Q) sum_q xi_{q,n} (l_{q,n} - l_n) / mu, dW = sum_n a_n^T g_{z_n} / N (the
    batch mean's 1/N), then W <- W - lr dW (momentum 0)."""
    from szo.optim import LayerwiseZO

    model, N, Q, mu, lr = _mlp(), 16, 8, 0.05, 0.2
    x, y = torch.randn(N, 10), torch.randint(0, 4, (N,))
    W0, b0 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    gen = torch.Generator().manual_seed(5)
    xi = torch.stack([torch.randn(N, 32, generator=gen) for _ in range(Q)])  # the optimizer's draws, in order
    with torch.no_grad():
        z = x @ W0.T + b0
        head = lambda h: torch.nn.functional.cross_entropy(model[2](model[1](h)), y, reduction="none")  # noqa: E731
        l_n = head(z)
        gz = sum(xi[q] * ((head(z + mu * xi[q]) - l_n) / mu)[:, None] for q in range(Q)) / Q
    dW, db = (gz / N).T @ x, (gz / N).sum(0)
    opt = LayerwiseZO(model, perturbation="node", layers=["0"], q=Q, mu=mu, lr=lr, momentum=0.0,
                      generator=torch.Generator().manual_seed(5))
    assert opt.loss_reduction == "none"
    opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
    torch.testing.assert_close(model[0].weight, W0 - lr * dW, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model[0].bias, b0 - lr * db, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"must return one loss per sample \(a 1-D tensor \[N\]"):
        opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("N", [32, 128])
def test_per_sample_node_estimate_is_far_closer_to_the_gradient(N):
    """The issue's measurement, repeated: cosine of the layer-0 weight estimate to the BP gradient at
    q = 16, per-sample vs batch-mean node perturbation (mean over 10 draws). On this MLP (10-32-4,
    tanh): 0.59 vs 0.11 at N = 32, 0.54 vs 0.04 at N = 128 (the per-node noise of 16 directions in
    32 dimensions bounds the per-sample form; the batch-mean form adds every other sample's)."""
    from szo.optim import LayerwiseZO

    x, y = torch.randn(N, 10, generator=torch.Generator().manual_seed(1)), torch.arange(N) % 4
    ref = _mlp()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    g_bp = ref[0].weight.grad.reshape(-1)
    cos = {}
    for per_sample in (True, False):
        vals = []
        for s in range(10):
            model = _mlp()
            W0 = model[0].weight.detach().clone()
            opt = LayerwiseZO(model, perturbation="node", layers=["0"], q=16, mu=1e-3, lr=1.0, momentum=0.0,
                              generator=torch.Generator().manual_seed(s), per_sample=per_sample)
            red = "none" if per_sample else "mean"
            opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y, reduction=red))
            est = (W0 - model[0].weight.detach()).reshape(-1)
            vals.append(float(torch.nn.functional.cosine_similarity(est, g_bp, dim=0)))
        cos[per_sample] = sum(vals) / len(vals)
    assert cos[True] > 0.45 and cos[False] < 0.2 and cos[True] > cos[False] + 0.3, cos
