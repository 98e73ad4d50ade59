"""SZO(model, Refreshed(sub, every=T0)): a random subspace redrawn every T0 steps (SubZero's lazy refresh; LOZO's kept-V /
fresh-U sampling with RGE), re-based at the current point, reproducible from the generator and resumable."""
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from subspace_store import random_subspace
from szo.evaluators import Batch
from szo.functional.basis import haar_basis
from szo.losses import tet_loss
from szo.models import create
from szo.optim import SZO, BPSubspace, ProbePath, Refreshed, build_optimizer

from .test_szo import Tiny, data, flat


def _sub(model, k, seed=0, variance=None):
    d = sum(p.numel() for p in model.parameters())
    s = random_subspace(torch.zeros(d), k, seed, layout=[(n, tuple(p.shape)) for n, p in model.named_parameters()],
                        variance=variance)
    return SimpleNamespace(basis=s.basis, layout=s.layout, eigenvalues=s.eigenvalues)


def _opt(model, sub, refresh=3, seed=7, **kw):
    kw = {"mu": 0.05, "lr": 0.2, "momentum": 0.9, "estimator": "cge", "scale": "absolute", **kw}
    sub = sub if refresh is None else Refreshed(sub, every=refresh)
    return SZO(model.parameters(), sub, model=model, generator=torch.Generator().manual_seed(seed), **kw)


def _orthonormal(p):
    p = p.to(torch.float64)
    return torch.allclose(p.t() @ p, torch.eye(p.shape[1], dtype=torch.float64), atol=1e-6)


def test_haar_basis_is_orthonormal_and_redrawn_from_a_saved_generator_state():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    p = haar_basis(40, 5, g)
    assert p.shape == (40, 5) and p.dtype == torch.float64 and _orthonormal(p)
    assert torch.equal(haar_basis(40, 5, torch.Generator().set_state(state)), p)
    assert not torch.allclose(haar_basis(40, 5, g), p)  # the generator moved on: a new basis
    # the store's fixed random variant is the same draw from its seed
    assert torch.equal(random_subspace(torch.zeros(40), 5, seed=3, dtype=torch.float64).basis, p)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="k must be a positive int"):
            haar_basis(4, bad, g)
    with pytest.raises(ValueError, match="k must be <= d = 3"):
        haar_basis(3, 4, g)


def test_random_subspace_borrows_a_total_variance_as_flat_units():
    s = random_subspace(torch.zeros(30), 4, seed=0, variance=2.0)
    assert torch.equal(s.eigenvalues, torch.full((4,), 0.5, dtype=torch.float64))
    assert s.provenance["variance"] == 2.0
    assert torch.equal(random_subspace(torch.zeros(30), 4, seed=0).eigenvalues, torch.zeros(4, dtype=torch.float64))
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="variance must be a finite number > 0"):
            random_subspace(torch.zeros(30), 4, seed=0, variance=bad)


def test_the_basis_changes_before_every_t0th_step_and_stays_orthonormal():
    torch.manual_seed(0)
    model = Tiny()
    sub = _sub(model, 3)
    x, y = data()
    opt = _opt(model, sub, refresh=3)
    closure = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    bases = []
    for _ in range(7):
        opt.step(closure)
        bases.append(opt.space.basis_t.clone())
    # steps 0-2 on the given basis, 3-5 on the first redraw, 6 on the second
    first = sub.basis.t().to(torch.float32)
    assert all(torch.equal(b, first) for b in bases[:3])
    assert torch.equal(bases[3], bases[5]) and not torch.allclose(bases[3], first)
    assert not torch.allclose(bases[6], bases[3])
    assert all(_orthonormal(b.t()) for b in (bases[3], bases[6]))
    assert opt.refresh_state["count"] == 2 and opt.subspace_state["step"] == 7
    assert opt.forward_passes == 7 * 2 * 3  # the redraw costs no forward


def test_a_refresh_rebases_the_coordinates_and_projects_the_momentum():
    torch.manual_seed(0)
    model = Tiny().double()
    sub = _sub(model, 4)
    x, y = data()
    x = x.double()
    opt = _opt(model, sub, refresh=2)
    closure = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    for _ in range(2):
        opt.step(closure)
    theta = flat(model)
    velocity = opt.subspace_state["delta"] @ opt.space.basis_t.double()  # P delta, parameter space
    state = opt.generator.get_state()
    opt.refresh_basis()
    new = haar_basis(opt.space.d, 4, torch.Generator().set_state(state))
    assert torch.equal(opt.space.basis_t.double(), new.t())  # the draw, from the generator, as it stood
    assert torch.equal(flat(model), theta)  # no parameter moves
    assert torch.equal(opt.coordinates, torch.zeros(4, dtype=torch.float64))  # re-based here
    # the momentum is the old velocity's projection onto the new basis (LOZO's reprojection)
    torch.testing.assert_close(opt.subspace_state["delta"], new.t() @ velocity, rtol=0, atol=1e-12)


def test_units_are_kept_across_a_refresh():
    """A random basis carrying a PCA's total variance has that PCA's trajectory unit, before and after."""
    model = Tiny()
    sub = _sub(model, 3, variance=9.0)
    x, y = data()
    opt = _opt(model, sub, refresh=1, scale="trajectory", mu=0.3, lr=0.03)
    assert opt.scale_info["units"] == [3.0, 3.0, 3.0]  # sqrt(sum lambda) = sqrt(9)
    for _ in range(2):
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
    norms = opt.space.basis_t.norm(dim=1)
    torch.testing.assert_close(norms, torch.full((3,), 3.0), rtol=1e-5, atol=0)  # rows of (P S)^T
    assert opt.refresh_state["count"] == 1


@pytest.mark.parametrize("estimator", ["cge", "rge"])
@pytest.mark.parametrize("resume_at", [2, 3, 4])  # before, at and after the first redraw (T0 = 3)
def test_same_run_from_the_seed_and_across_a_resume(estimator, resume_at):
    x, y = data()

    def run(steps, resume_at=None):
        torch.manual_seed(0)
        model = Tiny()
        sub = _sub(model, 3)
        opt = _opt(model, sub, refresh=3, estimator=estimator, q=2)
        for t in range(steps):
            if t == resume_at:  # a new process: the checkpoint through torch.save / weights_only load
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                ck = torch.load(buf, weights_only=True)
                model = Tiny()
                model.load_state_dict(ck["model"])
                opt = _opt(model, sub, refresh=3, estimator=estimator, q=2, seed=999)
                opt.load_state_dict(ck["opt"])
            opt.step(lambda: nn.functional.cross_entropy(model(x), y))
        return flat(model), opt

    a, oa = run(8)
    b, _ = run(8)
    c, oc = run(8, resume_at=resume_at)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(oa.space.basis_t, oc.space.basis_t) and oc.refresh_state["count"] == 2


def test_loading_a_state_from_before_any_redraw_restores_the_given_basis():
    torch.manual_seed(0)
    model = Tiny()
    sub = _sub(model, 3)
    x, y = data()
    opt = _opt(model, sub, refresh=2)
    early = opt.state_dict()
    for _ in range(3):
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
    assert not torch.equal(opt.space.basis_t, sub.basis.t().to(torch.float32))
    opt.load_state_dict(early)
    assert torch.equal(opt.space.basis_t, sub.basis.t().to(torch.float32)) and opt.refresh_state["count"] == 0


def test_without_refresh_the_state_keeps_its_keys():
    model = Tiny()
    opt = SZO(model.parameters(), _sub(model, 3), model=model, scale="absolute")
    assert "refresh" not in opt.state_dict()["subspace"]
    assert opt.refresh_state is None
    with pytest.raises(ValueError, match=r"refresh_basis needs an SZO built on Refreshed\(subspace, every=T0\)"):
        opt.refresh_basis()


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_refresh_is_one_line(bad):
    model = Tiny()
    with pytest.raises(ValueError, match="refresh must be None .* or a number of steps >= 1"):
        Refreshed(_sub(model, 3), every=bad)


def test_only_szo_takes_a_refreshed_subspace():
    model = Tiny()
    with pytest.raises(ValueError, match=r"^a subspace policy \(Refreshed\) is SZO's: only SZO trains under one"):
        BPSubspace(model.parameters(), Refreshed(_sub(model, 3), every=2), model=model, scale="absolute")
    assert "every=2" in repr(Refreshed(_sub(model, 3), every=2))


def test_build_optimizer_passes_refresh_and_refuses_it_elsewhere():
    model = Tiny()
    sub = _sub(model, 3)
    opt = build_optimizer("szo-rge", model, subspace=sub, scale="absolute", refresh=5, start="current")
    assert opt.refresh == 5
    with pytest.raises(ValueError, match="'refresh' .* applies to methods 'szo-cge', 'szo-rge', 'szo-1pt', "
                                         "'szo-cge-1pt', 'subzero', 'lozo', 'lozo-m'; method 'bp-subspace' does not use it"):
        build_optimizer("bp-subspace", model, subspace=sub, scale="absolute", refresh=5, start="current")


@pytest.mark.parametrize("estimator", ["cge", "rge"])
def test_the_batched_engine_follows_the_redrawn_basis(estimator):
    """The probe path is the evaluator's business, the basis the space's: after a redraw the batched engine
    folds its probes along the new basis, step for step what the loop does."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)

    def run(engine):
        torch.manual_seed(0)
        model = create("spike_convnet", num_classes=10, T=2, width=4).train()
        opt = _opt(model, _sub(model, 3), refresh=2, estimator=estimator, q=2, probes=ProbePath(engine=engine))
        for _ in range(5):
            opt.step(batch=Batch(x, y, tet_loss))
        return flat(model), opt

    (a, oa), (b, ob) = run("loop"), run("batched")
    assert oa.refresh_state["count"] == ob.refresh_state["count"] == 2
    assert torch.equal(oa.space.basis_t, ob.space.basis_t)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
