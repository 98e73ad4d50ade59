"""Pure estimators against autograd on smooth functions (the oracle is torch.autograd)."""
import math

import pytest
import torch

from szo.functional import zo as F


def smooth(theta):
    return torch.sin(theta).sum() + 0.1 * (theta**3).sum() + 0.5 * (theta[:-1] * theta[1:]).sum()


def quadratic(A, b):
    return lambda theta: 0.5 * theta @ A @ theta + b @ theta


def orthonormal(d, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q


def autograd_grad(f, theta):
    t = theta.clone().requires_grad_(True)
    f(t).backward()
    return t.grad


def test_cge_equals_projected_gradient_to_order_mu_squared():
    d, k = 50, 6
    P = orthonormal(d, k)
    theta = torch.linspace(-1, 1, d, dtype=torch.float64)
    target = P @ (P.T @ autograd_grad(smooth, theta))
    errs = []
    for mu in (1e-1, 5e-2, 2.5e-2):
        est = F.cge(smooth, theta, P, mu)
        errs.append((est - target).norm().item())
    # halving mu divides the error by ~4 (O(mu^2) truncation error of central differences)
    assert errs[0] < 1e-2
    assert 3.5 < errs[0] / errs[1] < 4.5
    assert 3.5 < errs[1] / errs[2] < 4.5


def test_cge_is_exact_on_quadratics():
    d, k = 30, 5
    g = torch.Generator().manual_seed(1)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = A @ A.T
    b = torch.randn(d, generator=g, dtype=torch.float64)
    f = quadratic(A, b)
    P = orthonormal(d, k, 2)
    theta = torch.randn(d, generator=g, dtype=torch.float64)
    est = F.cge(f, theta, P, 0.7)
    torch.testing.assert_close(est, P @ (P.T @ (A @ theta + b)), rtol=1e-10, atol=1e-10)


def test_rge_is_unbiased_in_the_subspace():
    # On a quadratic the central difference along z is exactly z^T P^T grad, so the
    # mean of M draws has standard error ||P^T g|| * sqrt((k+1)/M) per coordinate scale.
    d, k, M = 40, 4, 40000
    g = torch.Generator().manual_seed(3)
    A = torch.eye(d, dtype=torch.float64) * 2
    b = torch.randn(d, generator=g, dtype=torch.float64)
    f = quadratic(A, b)
    P = orthonormal(d, k, 4)
    theta = torch.randn(d, generator=g, dtype=torch.float64)
    target = P @ (P.T @ (A @ theta + b))
    est = F.rge(f, theta, P, 1.0, q=M, generator=torch.Generator().manual_seed(5))
    tol = 5 * target.norm().item() * math.sqrt((k + 1) / M)  # 5 standard errors
    assert (est - target).norm().item() < tol
    # and a single draw is clearly noisy (the test can fail if rge ignored z)
    one = F.rge(f, theta, P, 1.0, q=1, generator=torch.Generator().manual_seed(6))
    assert (one - target).norm().item() > tol


def test_one_point_estimate_matches_gradient_on_average():
    d, k, M = 20, 3, 40000
    A = torch.eye(d, dtype=torch.float64)
    b = torch.ones(d, dtype=torch.float64)
    f = quadratic(A, b)
    P = orthonormal(d, k, 7)
    theta = torch.zeros(d, dtype=torch.float64)
    target = P @ (P.T @ b)
    mu = 1e-3  # forward differences are biased by O(mu) on a quadratic
    est = F.one_point(f, theta, P, mu, q=M, generator=torch.Generator().manual_seed(8))
    assert (est - target).norm().item() < 5 * target.norm().item() * math.sqrt((k + 1) / M) + 1e-2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_is_rejected(bad):
    with pytest.raises(ValueError, match="non-finite"):
        F.check_loss(torch.tensor(bad))


def test_non_scalar_loss_is_rejected():
    with pytest.raises(ValueError, match="scalar"):
        F.check_loss(torch.ones(3))


def test_invalid_mu_and_empty_directions():
    theta = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="mu must be > 0"):
        F.cge(lambda t: t.sum(), theta, torch.eye(4, dtype=torch.float64), 0.0)
    with pytest.raises(ValueError, match="k >= 1"):
        F.cge(lambda t: t.sum(), theta, torch.zeros(4, 0, dtype=torch.float64), 1.0)
