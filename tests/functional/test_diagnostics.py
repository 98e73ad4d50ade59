"""ZO estimate statistics on smooth functions whose gradient is known in closed form."""
from __future__ import annotations

import pytest
import torch

from szo.functional.diagnostics import cosine, draw_estimates, estimate_statistics, rge_variance_closed_form

D, K = 30, 5


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(D, D, generator=g, dtype=torch.float64)
    h = a @ a.t() / D + torch.eye(D, dtype=torch.float64)  # SPD Hessian
    b = torch.randn(D, generator=g, dtype=torch.float64)
    theta = torch.randn(D, generator=g, dtype=torch.float64)
    p, _ = torch.linalg.qr(torch.randn(D, K, generator=g, dtype=torch.float64))
    return h, b, theta, p


def test_cge_in_subspace_is_the_projected_gradient_on_a_quadratic():
    h, b, theta, p = _setup()
    loss = lambda x: 0.5 * x @ h @ x + b @ x  # noqa: E731
    grad = h @ theta + b
    for mu in (1e-3, 1.0, 10.0):  # central differences are exact on a quadratic, for every mu
        est = draw_estimates(loss, theta, p, mu, estimator="cge")
        assert torch.allclose(est[0], p @ (p.t() @ grad), atol=1e-9)
    s = estimate_statistics(est, grad, p)
    assert s["variance"] == 0.0 and s["cosine_projected"] == pytest.approx(1.0)
    assert s["projected_fraction"] == pytest.approx(float((p.t() @ grad).norm() ** 2 / grad.norm() ** 2))
    assert s["cosine"] == pytest.approx(s["projected_fraction"] ** 0.5)  # cos(P P^T g, g) = |P^T g| / |g|


def test_cge_error_is_order_mu_squared_on_a_cubic():
    h, b, theta, p = _setup(1)
    c = torch.linspace(0.5, 1.5, D, dtype=torch.float64)
    loss = lambda x: 0.5 * x @ h @ x + b @ x + (c * x ** 3).sum() / 6  # noqa: E731
    grad = h @ theta + b + c * theta ** 2 / 2
    target = p @ (p.t() @ grad)
    errs = [float((draw_estimates(loss, theta, p, mu, estimator="cge")[0] - target).norm()) for mu in (0.2, 0.1)]
    assert errs[0] / errs[1] == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("q", [1, 4])
def test_rge_mean_and_variance_match_the_closed_form(q):
    h, b, theta, p = _setup(2)
    loss = lambda x: 0.5 * x @ h @ x + b @ x  # noqa: E731
    grad = h @ theta + b
    est = draw_estimates(loss, theta, p, 0.5, estimator="rge", q=q, repeats=4000,
                         generator=torch.Generator().manual_seed(q))
    s = estimate_statistics(est, grad, p)
    expected = rge_variance_closed_form(grad, p, q)
    assert expected == pytest.approx((K + 1) * float((p.t() @ grad).norm() ** 2) / q)
    assert s["variance"] == pytest.approx(expected, rel=0.08)
    # unbiased for P P^T g: the mean's error is within a few standard errors
    se = (expected / 4000) ** 0.5
    assert float((est.mean(0) - p @ (p.t() @ grad)).norm()) < 4 * se
    assert s["cosine_of_mean"] > 0.99 * s["projected_fraction"] ** 0.5


def test_full_space_rge_matches_the_closed_form():
    h, b, theta, _ = _setup(3)
    loss = lambda x: 0.5 * x @ h @ x + b @ x  # noqa: E731
    grad = h @ theta + b
    est = draw_estimates(loss, theta, None, 0.1, estimator="rge", q=2, repeats=3000,
                         generator=torch.Generator().manual_seed(0))
    s = estimate_statistics(est, grad)
    assert s["variance"] == pytest.approx(rge_variance_closed_form(grad, None, 2), rel=0.08)
    # full-space CGE recovers the gradient itself
    full = draw_estimates(loss, theta, None, 0.1, estimator="cge")
    assert torch.allclose(full[0], grad, atol=1e-9)


def test_full_space_closed_form_and_statistics_definitions():
    g = torch.tensor([3.0, 4.0])
    assert rge_variance_closed_form(g, None, 2) == pytest.approx(3 * 25 / 2)
    est = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 0.0]])
    s = estimate_statistics(est, g)
    assert s["variance"] == pytest.approx((0 + 25 + 25) / 2)  # mean (3, 4); deviations 0, (3, 4), (-3, -4)
    assert s["cosine"] == pytest.approx(2 / 3) and s["relative_error"] == pytest.approx((0 + 25 + 25) / 3 / 25)
    assert cosine(torch.zeros(2), g) == 0.0


def test_bad_input():
    g = torch.ones(4)
    with pytest.raises(ValueError, match="q must"):
        rge_variance_closed_form(g, None, 0)
    with pytest.raises(ValueError, match="directions must be"):
        estimate_statistics(torch.ones(2, 4), g, torch.ones(3, 2))
    with pytest.raises(ValueError, match="estimates must be"):
        estimate_statistics(torch.ones(2, 3), g)
    with pytest.raises(ValueError, match="estimator must"):
        draw_estimates(lambda x: x.sum(), g, torch.eye(4), 0.1, estimator="spsa")
