"""szo.scale: mu and lr of the subspace methods in the subspace's own units (szo.zo.scale)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from szo.optim import SZO, BPSubspace, build_optimizer
from szo.zo import SubspaceSpace
from szo.zo.scale import SCALES, coordinate_scales, scale_record

from .test_szo import Tiny, data, flat, subspace_for


def scaled_subspace(model, k, seed=0):
    sub = subspace_for(model, k, seed)
    lam = torch.logspace(0, -3, k, dtype=torch.float64) * 4.0  # a trajectory's spread: 4 ... 4e-3
    return SimpleNamespace(basis=sub.basis, layout=sub.layout, eigenvalues=lam)


def test_absolute_is_the_identity_and_trajectory_comes_from_the_eigenvalues():
    lam = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)
    assert coordinate_scales(lam, "absolute") is None
    s = coordinate_scales(lam, "trajectory")
    assert s.dtype == torch.float64 and s.shape == (3,)
    assert bool((s > 0).all())
    assert scale_record("absolute", None) == {"rule": "absolute"}
    assert scale_record("trajectory", s)["units"] == [float(v) for v in s]


@pytest.mark.parametrize("lam", [torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")]), torch.tensor([])])
def test_bad_eigenvalues_are_refused_in_one_line(lam):
    with pytest.raises(ValueError, match="eigenvalues"):
        coordinate_scales(lam, "trajectory")


def test_unknown_scale_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="valid: " + ", ".join(SCALES)):
        coordinate_scales(torch.ones(2), "relative")
    model = Tiny().double()
    with pytest.raises(ValueError, match="unknown scale 'relative'"):
        SZO(model, scaled_subspace(model, 3), scale="relative")


@pytest.mark.parametrize("estimator", ["cge", "rge", "one-point", "coord-one-point"])
def test_scaled_szo_is_absolute_szo_on_the_basis_p_times_units(estimator):
    """Every estimator under a relative scale = the absolute optimizer on the basis P diag(s):
    probes of mu * s_i along direction i, updates lr * s_i**2 per unit gradient."""
    torch.manual_seed(0)
    model = Tiny().double()
    ref = Tiny().double()
    ref.load_state_dict(model.state_dict())
    sub = scaled_subspace(model, 4)
    s = coordinate_scales(sub.eigenvalues, "trajectory")
    explicit = SimpleNamespace(basis=sub.basis * s[None, :], layout=sub.layout)
    x, y = data()
    x = x.double()
    kw = dict(mu=0.3, lr=0.2, momentum=0.9, estimator=estimator, q=3, start="current")
    a = SZO(model, sub, scale="trajectory", generator=torch.Generator().manual_seed(1), **kw)
    b = SZO(ref, explicit, generator=torch.Generator().manual_seed(1), **kw)
    for _ in range(4):
        a.step(lambda: nn.functional.cross_entropy(model(x), y))
        b.step(lambda: nn.functional.cross_entropy(ref(x), y))
    assert not torch.equal(flat(model), flat(Tiny().double()))
    torch.testing.assert_close(flat(model), flat(ref), rtol=0, atol=1e-12)
    assert a.scale_info == {"rule": "trajectory", "units": [float(v) for v in s]}


def test_scaled_bp_subspace_steps_lr_times_units_squared():
    """BP-Subspace: g_u = S P^T grad, so theta moves by -lr P S^2 P^T grad (no momentum, one step)."""
    torch.manual_seed(0)
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    s = coordinate_scales(sub.eigenvalues, "trajectory")
    x, y = data()
    x = x.double()
    opt = BPSubspace(model, sub, lr=0.5, momentum=0.0, scale="trajectory", start="current")
    before = flat(model)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    P = sub.basis
    torch.testing.assert_close(flat(model) - before, -0.5 * P @ (s ** 2 * (P.t() @ grad)), rtol=0, atol=1e-12)


def test_absolute_leaves_the_space_bit_for_bit():
    model = Tiny()
    sub = subspace_for(model, 3, dtype=torch.float32)
    plain = SubspaceSpace(list(model.parameters()), sub.basis)
    opt = SZO(model, sub, scale="absolute", start="current")
    assert torch.equal(opt.space.basis_t, plain.basis_t)
    assert opt.units is None and opt.scale_info == {"rule": "absolute"}


def test_build_optimizer_passes_the_scale():
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    for method in ("szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt", "bp-subspace"):
        opt = build_optimizer(method, model, subspace=sub, lr=0.1, scale="trajectory", start="current")
        assert opt.scale == "trajectory", method
