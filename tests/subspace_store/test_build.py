"""build_subspace against scikit-learn's PCA (the oracle), streaming, unions, validation."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch
from sklearn.decomposition import PCA
from torch import nn

from subspace_store import build_subspace
from szo.trajectory import Trajectory, TrajectoryMismatchError, TrajectoryRecorder

N, D, K = 40, 200_000, 6


class Flat(nn.Module):
    """A 'model' whose single parameter is the whole vector (plus a tiny second one)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d - 3))
        self.b = nn.Parameter(torch.zeros(3))


def low_rank_samples(n: int = N, d: int = D, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([10.0, 7.0, 5.0, 3.5, 2.5, 1.8, 1.2, 0.8])
    coeff = torch.randn(n, 8, generator=g, dtype=torch.float64) * scales
    dirs = torch.randn(8, d, generator=g, dtype=torch.float64) / d**0.5
    offset = torch.randn(d, generator=g, dtype=torch.float64)
    noise = 1e-3 * torch.randn(n, d, generator=g, dtype=torch.float64) / d**0.5
    return (offset + coeff @ dirs + noise).float()


def write_trajectory(path, X: torch.Tensor, first_epoch: int = 0) -> None:
    m = Flat(X.shape[1])
    rec = TrajectoryRecorder(path, m, model_name="flat")
    for i, x in enumerate(X):
        with torch.no_grad():
            m.w.copy_(x[:-3])
            m.b.copy_(x[-3:])
        rec.record(first_epoch + i, step=first_epoch + i)


@pytest.fixture(scope="module")
def data():
    X = low_rank_samples()
    pca = PCA(n_components=K, svd_solver="full").fit(X.double().numpy())
    return X, pca


def check_against_sklearn(sub, pca) -> None:
    P = sub.basis.double().numpy()
    C = pca.components_.T
    angles = scipy.linalg.subspace_angles(P, C)
    assert angles.max() < 1e-4
    # each direction on its own (eigenvalues are well separated), same sign convention as svd_flip
    for j in range(K):
        p = P[:, j] / np.linalg.norm(P[:, j])
        sin = np.linalg.norm(p - (p @ C[:, j]) * C[:, j])
        assert np.arcsin(min(sin, 1.0)) < 1e-4 and p @ C[:, j] > 0
    np.testing.assert_allclose(sub.explained_variance_ratio.numpy(), pca.explained_variance_ratio_, atol=1e-5, rtol=0)
    np.testing.assert_allclose(sub.eigenvalues.numpy(), pca.explained_variance_, rtol=1e-6)
    np.testing.assert_allclose(sub.mean.double().numpy(), pca.mean_, atol=1e-6)
    PtP = sub.basis.T.double() @ sub.basis.double()
    assert (PtP - torch.eye(K, dtype=torch.float64)).abs().max() < 1e-5


def test_trajectory_dir_matches_sklearn(tmp_path, data):
    X, pca = data
    write_trajectory(tmp_path / "t", X)
    sub = build_subspace(tmp_path / "t", K, progress=False, chunk_size=30_011)  # chunk not dividing d
    check_against_sklearn(sub, pca)
    assert sub.model == "flat" and sub.layout == [("w", (D - 3,)), ("b", (3,))]
    assert sub.provenance["N"] == N and sub.provenance["epochs"] == list(range(N))
    assert torch.equal(sub.reference, X[0])
    last = build_subspace(Trajectory(tmp_path / "t"), K, reference="last", progress=False)
    assert torch.equal(last.reference, X[-1])
    assert torch.allclose(last.basis, sub.basis, atol=1e-6)  # chunking does not change the result


def test_vectors_and_generator_match_sklearn(data):
    X, pca = data
    check_against_sklearn(build_subspace([x for x in X], K, progress=False), pca)
    check_against_sklearn(build_subspace((x.numpy() for x in X), K, progress=False), pca)  # spooled to disk
    sub = build_subspace(X, K, reference=torch.zeros(D), progress=False)  # [N, d] tensor = rows
    check_against_sklearn(sub, pca)
    assert sub.layout is None and sub.provenance["reference"] == "tensor"


def test_multi_trajectory_union_and_window(tmp_path):
    X = low_rank_samples(n=24, d=5_000, seed=1)
    write_trajectory(tmp_path / "a", X[:10])
    write_trajectory(tmp_path / "b", X[10:], first_epoch=10)
    sub = build_subspace([tmp_path / "a", str(tmp_path / "b")], 5, progress=False)
    assert sub.provenance["N"] == 24 and len(sub.provenance["trajectories"]) == 2
    ref = build_subspace(list(X), 5, progress=False)
    assert torch.allclose(sub.basis, ref.basis, atol=1e-5)
    w = build_subspace([tmp_path / "a", tmp_path / "b"], 3, window="5-14", progress=False)
    assert w.provenance["epochs"] == list(range(5, 15)) and w.provenance["N"] == 10
    assert torch.equal(w.reference, X[5])
    assert torch.allclose(w.basis.abs(), build_subspace(list(X[5:15]), 3, progress=False).basis.abs(), atol=1e-5)


def test_k_out_of_range_rejected():
    X = list(low_rank_samples(n=6, d=100))
    with pytest.raises(ValueError, match=r"k must be in \[1, N-1\] = \[1, 5\] for N = 6"):
        build_subspace(X, 6, progress=False)
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        build_subspace(X, 0, progress=False)
    with pytest.raises(ValueError, match="span only 1 directions"):
        build_subspace([torch.zeros(50), torch.ones(50), torch.zeros(50)], 2, progress=False)


def test_bad_inputs_rejected(tmp_path):
    X = low_rank_samples(n=5, d=100)
    with pytest.raises(ValueError, match="same length"):
        build_subspace([X[0], X[1][:50], X[2]], 1, progress=False)
    with pytest.raises(ValueError, match="window"):
        build_subspace(list(X), 2, window="1-3", progress=False)
    with pytest.raises(ValueError, match="reference must be"):
        build_subspace(list(X), 2, reference="middle", progress=False)
    write_trajectory(tmp_path / "a", X)
    write_trajectory(tmp_path / "b", low_rank_samples(n=5, d=101))
    with pytest.raises(TrajectoryMismatchError, match="differ in d"):
        build_subspace([tmp_path / "a", tmp_path / "b"], 2, progress=False)


def test_tampered_sample_detected(tmp_path):
    X = low_rank_samples(n=5, d=100)
    write_trajectory(tmp_path / "a", X)
    f = tmp_path / "a" / "sample_000003.safetensors"
    b = bytearray(f.read_bytes())
    b[-1] ^= 1
    f.write_bytes(bytes(b))
    with pytest.raises(ValueError, match="sha256"):
        build_subspace(tmp_path / "a", 2, progress=False)


def test_non_finite_sample_is_named_not_an_eigensolver_failure(tmp_path):
    """A sample holding NaN whose hash record is valid (recorded from a diverging run) names itself."""
    X = low_rank_samples(n=6, d=100)
    X[4, 17] = float("nan")
    write_trajectory(tmp_path / "a", X)  # the recorder hashes what it is given: the record is valid
    with pytest.raises(ValueError, match=r"sample_000004\.safetensors \(epoch 4, step 4\) holds non-finite"):
        build_subspace(tmp_path / "a", 2, progress=False)
    Y = low_rank_samples(n=6, d=100)
    Y[2, 0] = float("inf")
    with pytest.raises(ValueError, match="sample #2 holds non-finite"):
        build_subspace(list(Y), 2, progress=False)
