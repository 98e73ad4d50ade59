"""szo.zo, part by part: spaces move and restore exactly, plans combine losses as the paper's
estimators (written out here independently), the loop evaluator restores on errors, heavy ball is
eq. (6), the state codec round-trips."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from szo.evaluators import LoopEvaluator
from szo.functional.zo import NonFiniteLossError
from szo.zo import (
    Coordinates,
    Field,
    NodeSpace,
    ParamSpace,
    ProbeGuard,
    StateCodec,
    SubspaceSpace,
    cge_plan,
    coord_one_point_plan,
    heavy_ball_,
    one_point_plan,
    rge_plan,
)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def test_param_space_flat_split_load_round_trip():
    model = _net()
    sp = ParamSpace(list(model.parameters()))
    v = sp.flat()
    assert v.shape == (sp.d,) and torch.equal(v, _flat(model))
    sp.load(v * 2)
    assert torch.equal(_flat(model), v * 2)
    assert [t.shape for t in sp.split(v)] == [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=f"d = {sp.d}"):
        sp.split(torch.zeros(sp.d + 1))


@pytest.mark.parametrize("kind", ["dense", "coords"])
def test_param_space_probes_and_exact_restore(kind):
    model = _net()
    sp = ParamSpace(list(model.parameters()))
    theta = _flat(model)
    if kind == "dense":
        z = torch.randn(2, sp.d, generator=torch.Generator().manual_seed(1))
        plan = rge_plan(z, 0.1, interleaved=True)
        want = [theta + 0.1 * z[0], theta - 0.1 * z[0], theta + 0.1 * z[1], theta - 0.1 * z[1]]
    else:
        idx = torch.tensor([5, 0, sp.d - 1])
        plan = cge_plan(Coordinates(idx, sp.d), 0.1, interleaved=True)
        want = []
        for i in idx.tolist():
            for s in (1, -1):
                w = theta.clone()
                w[i] = theta[i] + s * 0.1
                want.append(w)
    mover = sp.mover(plan)
    for j in range(plan.m):
        mover.move(j)
        assert torch.equal(_flat(model), want[j]), j
    mover.restore()
    assert torch.equal(_flat(model), theta)


def test_subspace_space_probe_is_theta_plus_mu_P_u_and_coordinates_are_basis_rows():
    model = _net()
    d = sum(p.numel() for p in model.parameters())
    P = torch.linalg.qr(torch.randn(d, 3, generator=torch.Generator().manual_seed(2)))[0]
    sp = SubspaceSpace(list(model.parameters()), P)
    assert sp.basis_t.is_contiguous() and sp.basis_t.shape == (3, d) and sp.k == 3
    theta = _flat(model)
    mover = sp.mover(cge_plan(3, 0.5))  # +e_0 +e_1 +e_2 -e_0 -e_1 -e_2
    for j in range(6):
        mover.move(j)
        sign = 1 if j < 3 else -1
        torch.testing.assert_close(_flat(model), theta + sign * 0.5 * P[:, j % 3], rtol=0, atol=1e-6)
    mover.restore()
    assert torch.equal(_flat(model), theta)
    sp.add_coords(torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(_flat(model), theta + P[:, 0] - 2 * P[:, 2], rtol=0, atol=1e-6)
    g = [torch.ones_like(p) for p in model.parameters()]
    torch.testing.assert_close(sp.project(g), P.t() @ torch.ones(d), rtol=1e-6, atol=1e-6)


def test_node_space_adds_the_direction_to_the_layer_output():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    xi = torch.randn(1, 8)
    mover = NodeSpace(lin, torch.Size([4, 2])).mover(one_point_plan(xi, 0.25, centre=False))
    clean = lin(x)
    mover.move(0)
    torch.testing.assert_close(lin(x), clean + 0.25 * xi.view(4, 2))
    mover.restore()
    assert torch.equal(lin(x), clean)


def test_plans_combine_losses_as_the_papers_estimators():
    """Each estimate against the formula written out (paper eqs. 3-4; one-point and Table 13)."""
    mu = 0.2
    z = torch.randn(3, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    f = lambda v: float((v ** 2).sum() + v[0])  # noqa: E731 - a smooth loss in the plan's coordinates
    x0 = torch.tensor([0.3, -1.0, 0.5, 2.0], dtype=torch.float64)

    def losses(plan):
        U = plan.dense()
        return torch.tensor([f(x0 + plan.mu * U[j]) for j in range(plan.m)], dtype=torch.float64)

    p = cge_plan(4, mu)
    want = torch.tensor([(f(x0 + mu * e) - f(x0 - mu * e)) / (2 * mu) for e in torch.eye(4, dtype=torch.float64)],
                        dtype=torch.float64)
    torch.testing.assert_close(p.estimate(losses(p)), want)
    p = rge_plan(z, mu)
    want = sum((f(x0 + mu * zj) - f(x0 - mu * zj)) / (2 * mu) * zj for zj in z) / 3
    torch.testing.assert_close(p.estimate(losses(p)), want)
    p = one_point_plan(z, mu)
    want = sum((f(x0 + mu * zj) - f(x0)) / mu * zj for zj in z) / 3
    torch.testing.assert_close(p.estimate(losses(p)), want)
    p = coord_one_point_plan(4, mu)
    assert p.m == 5
    want = torch.tensor([(f(x0 + mu * e) - f(x0)) / mu for e in torch.eye(4, dtype=torch.float64)], dtype=torch.float64)
    torch.testing.assert_close(p.estimate(losses(p)), want)
    # a quadratic: central differences are exact, the gradient is 2 x + e_0
    torch.testing.assert_close(cge_plan(4, mu).estimate(losses(cge_plan(4, mu))),
                               2 * x0 + torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    # full-space RGE accumulates direction by direction, same value
    p = rge_plan(z, mu, interleaved=True, accumulate="sequential")
    torch.testing.assert_close(p.estimate(losses(p)), rge_plan(z, mu).estimate(losses(rge_plan(z, mu))))


def test_loop_evaluator_restores_parameters_and_bn_when_a_probe_fails():
    model = _net().train()
    guard = ProbeGuard(model, "test", bn_update="probe-mean")
    ev = LoopEvaluator(guard)
    sp = ParamSpace(list(model.parameters()))
    theta, bn0 = _flat(model), model[1].running_mean.clone()
    x = torch.randn(8, 3)
    calls = []

    def closure():
        calls.append(1)
        out = model(x).pow(2).mean()
        return out if len(calls) < 3 else out * float("nan")

    with pytest.raises(NonFiniteLossError, match=r"probe 3/4"):
        with ev.session():
            ev.run(closure, sp, rge_plan(torch.randn(2, sp.d), 0.1))
    assert torch.equal(_flat(model), theta) and torch.equal(model[1].running_mean, bn0)
    # a clean step: probe-mean BN = mean of the probes' statistics; parameters back at theta
    with ev.session():
        losses = ev.run(lambda: model(x).pow(2).mean(), sp, cge_plan(Coordinates(torch.tensor([0, 1]), sp.d), 0.1))
    assert losses.shape == (4,) and torch.equal(_flat(model), theta)
    assert not torch.equal(model[1].running_mean, bn0) and int(model[1].num_batches_tracked) == 1


def test_heavy_ball_is_eq6():
    """v <- beta v - lr g, theta <- theta + v  ==  theta - lr g + beta (theta_t - theta_{t-1})."""
    g = torch.Generator().manual_seed(4)
    theta, prev, v = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), torch.zeros(5,
                                                                                                      dtype=torch.float64)
    for _ in range(4):
        grad = torch.randn(5, generator=g, dtype=torch.float64)
        want = theta - 0.1 * grad + 0.9 * (theta - prev)
        prev = theta.clone()
        theta = theta + heavy_ball_(v, grad, lr=0.1, momentum=0.9)
        torch.testing.assert_close(theta, want)


def test_state_codec_round_trip_and_check():
    class Obj:
        def __init__(self):
            self.generator = torch.Generator().manual_seed(5)
            self.forward_passes = 7
            self.state = {"c": torch.arange(3, dtype=torch.float64), "step": 2}

    codec = StateCodec("x", (Field("generator_state", "generator", "generator"), Field("forward_passes", "int"),
                             Field("c", "float64", "state.c"), Field("step", "int", "state.step")),
                        check=lambda o, s: None if s["c"].shape == (3,) else (_ for _ in ()).throw(ValueError("k")))
    a = Obj()
    a.generator.manual_seed(9)
    torch.randn(4, generator=a.generator)
    sec = codec.encode(a)
    b = Obj()
    codec.decode(b, sec)
    assert b.forward_passes == 7 and b.state["step"] == 2 and torch.equal(b.state["c"], a.state["c"])
    assert torch.equal(torch.randn(3, generator=b.generator), torch.randn(3, generator=a.generator))
    with pytest.raises(ValueError, match="k"):
        codec.decode(b, dict(sec, c=torch.zeros(4)))
    with pytest.raises(ValueError, match="unknown state kind"):
        Field("y", "pickle")
