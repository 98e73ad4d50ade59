"""Subspace variants of the ablation study: random orthonormal, coordinate, BN+head names,
the projected point; and the trajectory-based variants (first epochs, another seed) via
build_subspace."""
from __future__ import annotations

import pytest
import torch

from subspace_store import (
    SubspaceStore,
    bn_and_head_names,
    build_subspace,
    coordinate_subspace,
    project_point,
    random_subspace,
)
from szo.layout import param_layout
from szo.models import create
from szo.trajectory import TrajectoryRecorder


def _orthonormal(p: torch.Tensor) -> bool:
    p = p.to(torch.float64)
    return torch.allclose(p.t() @ p, torch.eye(p.shape[1], dtype=torch.float64), atol=1e-5)


def test_random_subspace_orthonormal_seeded_and_storable(tmp_path):
    ref = torch.randn(500)
    s = random_subspace(ref, 7, seed=3, layout=[("w", (500,))])
    assert s.basis.shape == (500, 7) and s.k == 7 and _orthonormal(s.basis)
    assert torch.equal(s.reference, ref) and torch.equal(s.mean, ref)
    assert torch.equal(random_subspace(ref, 7, seed=3).basis, s.basis)
    assert not torch.allclose(random_subspace(ref, 7, seed=4).basis, s.basis)
    store = SubspaceStore(tmp_path / "store")
    store.save("rand", s)
    assert torch.equal(store.load("rand").basis, s.basis)


def test_random_subspace_is_isotropic():
    # Haar: E[P P^T] = (k/d) I; the mean projector over seeds has a flat diagonal
    d, k = 20, 4
    acc = sum(random_subspace(torch.zeros(d), k, seed=i).basis.double() @
              random_subspace(torch.zeros(d), k, seed=i).basis.double().t() for i in range(400)) / 400
    assert torch.allclose(torch.diagonal(acc), torch.full((d,), k / d, dtype=torch.float64), atol=0.04)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_random_subspace_rejects_bad_k(bad):
    with pytest.raises(ValueError, match="k must"):
        random_subspace(torch.zeros(10), bad, seed=0)
    with pytest.raises(ValueError, match="k must be <= d"):
        random_subspace(torch.zeros(3), 4, seed=0)


def test_coordinate_subspace_layout_and_projection():
    model = create("spike_convnet", width=4)
    lay = param_layout(model)
    names = bn_and_head_names(model)
    assert names == ["bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias", "fc.weight", "fc.bias"]
    theta0 = model.flat_params().detach()
    s = coordinate_subspace(lay, names, theta0)
    sizes = dict((n, torch.Size(sh).numel()) for n, sh in lay)
    assert s.k == sum(sizes[n] for n in names) and _orthonormal(s.basis)
    # a step in the coordinates moves exactly those parameters
    model.load_flat_params(theta0 + s.basis @ torch.ones(s.k))
    after = model.flat_params().detach()
    assert torch.allclose(after - theta0, s.basis.sum(1))
    moved = {n for n, p0 in zip([n for n, _ in lay], torch.split(s.basis @ torch.ones(s.k),
                                                                    [sizes[n] for n, _ in lay])) if p0.any()}
    assert moved == set(names)
    with pytest.raises(ValueError, match="unknown: \\['nope'\\]"):
        coordinate_subspace(lay, ["nope"], theta0)
    with pytest.raises(ValueError, match="d = "):
        coordinate_subspace(lay, names, theta0[:-1])


def test_bn_and_head_names_on_resnet():
    names = bn_and_head_names(create("spike_resnet8"))
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert all(n.endswith((".1.weight", ".1.bias")) for n in names[:-2])  # conv_bn's BN is index 1


def test_project_point_toy_case():
    # d = 3, subspace = the x-y plane through ref: the projection zeroes the z offset
    ref = torch.tensor([1.0, 1.0, 1.0])
    s = coordinate_subspace([("w", (3,))], ["w"], ref)
    s2 = random_subspace(ref, 2, seed=0)
    basis = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    plane = type(s)(basis=basis, mean=ref, reference=ref, eigenvalues=torch.zeros(2),
                    explained_variance_ratio=torch.full((2,), 0.5))
    point, dist = project_point(plane, torch.tensor([4.0, -2.0, 5.0]))
    assert torch.allclose(point, torch.tensor([4.0, -2.0, 1.0])) and dist == pytest.approx(4.0)
    # the full coordinate subspace contains every point; a point on the subspace is its own projection
    assert project_point(s, torch.tensor([3.0, 2.0, 1.0]))[1] == pytest.approx(0.0, abs=1e-6)
    on = ref + s2.basis @ torch.tensor([0.5, -2.0])
    p, dist = project_point(s2, on)
    assert torch.allclose(p, on, atol=1e-6) and dist == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="theta must be"):
        project_point(plane, torch.zeros(4))


def test_first_epochs_and_other_seed_trajectories(tmp_path):
    """DLDR-style (first E epochs: window) and another seed's trajectory with this run's theta_0."""
    def record(path, seed, epochs=6):
        torch.manual_seed(seed)
        m = create("spike_convnet", width=2)
        rec = TrajectoryRecorder(path, m, model_name="spike_convnet")
        g = torch.Generator().manual_seed(seed)
        for e in range(epochs):
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            rec.record(e, step=e)
        return m

    record(tmp_path / "a", 0)
    record(tmp_path / "b", 1)
    early = build_subspace(tmp_path / "a", 2, window=(0, 2), progress=False)
    assert early.provenance["epochs"] == [0, 1, 2] and _orthonormal(early.basis)
    theta0 = torch.randn(early.d)
    other = build_subspace(tmp_path / "b", 3, reference=theta0, progress=False)
    assert torch.equal(other.reference, theta0) and other.k == 3 and _orthonormal(other.basis)
