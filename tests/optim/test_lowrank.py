"""SubZero / LOZO / LOZO-M (szo.optim.lowrank) against their papers' update equations, step by step.

The reference below draws U, V, S (SubZero) or V, U (LOZO) from a copy of the optimizer's generator in
the order the module documents, builds each layer's perturbation by the papers' formulas, measures the
two losses itself and applies the papers' updates; the optimizer must land on the same point.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from szo.methods import get_method
from szo.optim import LowRankZO, build_optimizer
from szo.zo.lowrank import LayerFactors


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3),      # 4-D 3x3 kernel: full space; its bias: full space
                         nn.Conv2d(3, 4, 1),      # 1x1 kernel [4, 3, 1, 1]: a 4 x 3 matrix, low rank
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5))  # a 5 x 64 matrix: low rank


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 1, 6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _matrix(p):
    dims = [s for s in p.shape if s != 1]
    return tuple(dims) if len(dims) == 2 else None


def _reference(form, model, steps, *, rank, refresh, mu, lr, beta=None, seed=5):
    """The papers' algorithms on ``model`` for ``steps`` steps (SubZero: Yu et al. 2024 eq. for
    Z = sqrt(mn/r^2) U S V^T and SGD on g Z; LOZO: Z = U V^T, theta -= lr g Z; LOZO-M: Algorithm 2)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = _batch()
    params = list(model.parameters())
    V, U_fixed, V_prev, N = {}, {}, {}, {}
    with torch.no_grad():
        for t in range(steps):
            if t % refresh == 0:
                for i, p in enumerate(params):
                    mn = _matrix(p)
                    if mn is None:
                        continue
                    if form == "subzero":
                        r = min(rank, *mn)
                        U_fixed[i] = torch.linalg.qr(torch.randn(mn[0], r, generator=gen))[0]
                        V[i] = torch.linalg.qr(torch.randn(mn[1], r, generator=gen))[0]
                    else:
                        V_prev[i] = V.get(i)
                        V[i] = torch.randn(mn[1], rank, generator=gen)
            Z, fresh = [], []
            for i, p in enumerate(params):
                mn = _matrix(p)
                if mn is None:
                    z = torch.randn(p.shape, generator=gen)
                    fresh.append(z)
                    Z.append(z)
                elif form == "subzero":
                    r = min(rank, *mn)
                    S = torch.randn(r, r, generator=gen)
                    Z.append((U_fixed[i] @ S @ V[i].t() * math.sqrt(mn[0] * mn[1] / r ** 2)).reshape(p.shape))
                    fresh.append(S)
                else:
                    U = torch.randn(mn[0], rank, generator=gen)
                    Z.append((U @ V[i].t()).reshape(p.shape))
                    fresh.append(U)
            theta = [p.detach().clone() for p in params]
            for p, th, z in zip(params, theta, Z):
                p.copy_(th + mu * z)
            lp = float(_loss(model, x, y))
            for p, th, z in zip(params, theta, Z):
                p.copy_(th - mu * z)
            lm = float(_loss(model, x, y))
            g = (lp - lm) / (2 * mu)
            for i, (p, th, z) in enumerate(zip(params, theta, Z)):
                if beta is None:  # SubZero's SGD (momentum 0) / LOZO
                    p.copy_(th - lr * g * z)
                    continue
                mn = _matrix(p)
                gu = g * fresh[i]
                if t == 0:
                    N[i] = gu
                elif mn is not None and t % refresh == 0:
                    N[i] = beta * N[i] @ V_prev[i].t() @ V[i] / V_prev[i].shape[0] + (1 - beta) * gu
                else:
                    N[i] = beta * N[i] + (1 - beta) * gu
                p.copy_(th - lr * (N[i] if mn is None else (N[i] @ V[i].t()).reshape(p.shape)))
    return torch.cat([p.detach().reshape(-1) for p in params])


def _run(opt, model, steps):
    x, y = _batch()
    for _ in range(steps):
        opt.step(lambda: _loss(model, x, y))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


CASES = {"subzero": dict(form="subzero", rank=2, refresh=2, momentum=0.0),
         "lozo": dict(form="lozo", rank=2, refresh=2, momentum=0.0),
         "lozo-m": dict(form="lozo", rank=2, refresh=2, momentum=0.9, lozo_momentum=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_steps_follow_the_papers_equations(case):
    """Five steps (redraws at steps 0, 2 and 4: SubZero's U, V and LOZO's V; LOZO-M's momentum
    re-projected at 2 and 4) equal the papers' algorithms computed by hand from the same draws."""
    kw = CASES[case]
    mu, lr = 1e-2, 0.05
    model = _model()
    want = _reference(kw["form"], _model(), 5, rank=kw["rank"], refresh=kw["refresh"], mu=mu, lr=lr,
                      beta=kw["momentum"] if kw.get("lozo_momentum") else None)
    opt = LowRankZO(model, mu=mu, lr=lr, generator=torch.Generator().manual_seed(5), **kw)
    got = _run(opt, model, 5)
    start = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    assert (got - start).abs().max() > 1e-2  # it moved
    # float32 rounding of the two points, amplified by 1 / 2mu in g, is ~1e-5 after five steps; a wrong
    # factor, draw or re-projection moves entries by O(lr g) = O(1e-2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    assert opt.forward_passes == 10  # one two-point probe per step, no BN forward (no BN layer)


def test_one_subzero_step_by_hand():
    """One SubZero step spelled out: theta_1 = theta_0 - lr (L(theta_0 + mu Z) - L(theta_0 - mu Z)) / 2mu Z,
    Z_l = sqrt(mn / r^2) U_l S_l V_l^T for the matrices, Gaussian blocks for the rest; the two losses
    are the optimizer's probes."""
    mu, lr, r = 1e-2, 0.1, 2
    model = _model()
    gen = torch.Generator().manual_seed(7)
    opt = LowRankZO(model, form="subzero", rank=r, refresh=10, mu=mu, lr=lr, generator=gen)
    copy = torch.Generator().manual_seed(7)
    params = list(model.parameters())
    theta0 = [p.detach().clone() for p in params]
    bases = {}
    for i, p in enumerate(params):
        if _matrix(p):
            m, n = _matrix(p)
            bases[i] = (torch.linalg.qr(torch.randn(m, min(r, m, n), generator=copy))[0],
                        torch.linalg.qr(torch.randn(n, min(r, m, n), generator=copy))[0])
    Z = []
    for i, p in enumerate(params):
        if i in bases:
            U, V = bases[i]
            m, n = _matrix(p)
            S = torch.randn(U.shape[1], U.shape[1], generator=copy)
            Z.append((U @ S @ V.t()).reshape(p.shape) * math.sqrt(m * n / U.shape[1] ** 2))
        else:
            Z.append(torch.randn(p.shape, generator=copy))
    assert [i for i in bases] == [2, 4]  # the 1x1 conv's kernel and the linear weight; not the 3x3 kernel
    x, y = _batch()
    _run(opt, model, 1)
    lp, lm = (float(v) for v in opt.last_step.losses)
    probe = _model()
    with torch.no_grad():
        for sign, want in ((1.0, lp), (-1.0, lm)):
            for q, th, z in zip(probe.parameters(), theta0, Z):
                q.copy_(th + sign * mu * z)
            assert float(_loss(probe, x, y)) == pytest.approx(want, rel=1e-6)
    g = (lp - lm) / (2 * mu)
    for p, th, z in zip(params, theta0, Z):
        torch.testing.assert_close(p.detach(), th - lr * g * z, rtol=1e-5, atol=1e-7)
    assert opt.state[params[2]]["U"].shape == (4, 2) and opt.state[params[4]]["V"].shape == (64, 2)
    U = opt.state[params[4]]["U"]
    torch.testing.assert_close(U.t() @ U, torch.eye(2), atol=1e-5, rtol=0)  # QR'd: orthonormal columns


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_resumes_across_a_redraw(case):
    """Two steps, a state_dict into a fresh model and optimizer, three more (across the redraws at 2
    and 4, LOZO-M's re-projection reading the stored V) = five uninterrupted steps, bit for bit."""
    kw = CASES[case]
    model = _model()
    opt = LowRankZO(model, mu=1e-2, lr=0.05, generator=torch.Generator().manual_seed(5), **kw)
    want = _run(opt, model, 5)
    m1 = _model()
    o1 = LowRankZO(m1, mu=1e-2, lr=0.05, generator=torch.Generator().manual_seed(5), **kw)
    _run(o1, m1, 2)
    sd, weights = o1.state_dict(), {k: v.clone() for k, v in m1.state_dict().items()}
    m2 = _model(seed=1)
    m2.load_state_dict(weights)
    o2 = LowRankZO(m2, mu=1e-2, lr=0.05, generator=torch.Generator().manual_seed(99), **kw)
    o2.load_state_dict(sd)
    assert o2.steps == 2
    got = _run(o2, m2, 3)
    assert torch.equal(got, want)


def test_factors_follow_subzeros_rule_for_kernels_and_clamp_the_rank():
    """SubZero's code: a parameter that squeezes to 2-D is low rank (a 1x1 kernel), a 3x3 kernel and a
    bias are not; its QR cannot give more columns than rows, so r is clamped (LOZO's Gaussian V is not)."""
    params = list(_model().parameters())
    sub = LayerFactors(params, 8, "subzero")
    assert sub.low_rank == [False, False, True, False, True, False]
    assert [sub.ranks[2], sub.ranks[4]] == [3, 5]
    assert LayerFactors(params, 8, "lozo").ranks[2] == 8


def test_registry_records_and_builder():
    """The registry builds the three from a recipe's settings: rank and refresh (T0 / nu), the codes' mu."""
    for name, form in (("subzero", "subzero"), ("lozo", "lozo"), ("lozo-m", "lozo")):
        spec = get_method(name)
        assert set(spec.options) == {"rank", "refresh"} and spec.default_mu("absolute") == 1e-3
        opt = build_optimizer(name, _model(), rank=3, refresh=7, momentum=0.9 if spec.momentum else 0.0,
                              generator=torch.Generator().manual_seed(0))
        assert (opt.form, opt.rank, opt.refresh, opt.lozo_momentum) == (form, 3, 7, name == "lozo-m")
        assert opt.param_groups[0]["mu"] == 1e-3
    with pytest.raises(ValueError, match="takes no momentum"):
        build_optimizer("lozo", _model(), momentum=0.9)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        LowRankZO(_model(), rank=0)
    with pytest.raises(ValueError, match="'szo.rank'.*applies to methods 'subzero', 'lozo', 'lozo-m'"):
        get_method("szo-cge").check_options({"rank": 4}, prefix="szo.")
