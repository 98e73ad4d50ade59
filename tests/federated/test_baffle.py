"""BAFFLE math: the clients' weighted aggregate equals the centralised estimate; splits, seeds, config."""
import numpy as np
import pytest
import torch
from torch import nn

from szo.federated import baffle as B


def test_weighted_mean_is_the_union_of_the_clients_data():
    parts = [np.array([0.1, -0.2]), np.array([-0.3, 0.25]), np.array([1.0, 2.0])]
    np.testing.assert_allclose(B.weighted_mean(parts, [1, 2, 5]), (parts[0] + 2 * parts[1] + 5 * parts[2]) / 8)
    with pytest.raises(ValueError, match="zero clients"):
        B.weighted_mean([], [])
    with pytest.raises(ValueError, match="weights must be > 0"):
        B.weighted_mean(parts, [1, 0, 2])
    with pytest.raises(ValueError, match="different shapes"):
        B.weighted_mean([np.zeros(2), np.zeros(3)], [1, 1])


def test_weighted_aggregate_equals_centralised_estimate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    d = sum(p.numel() for p in model.parameters())
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    basis, _ = torch.linalg.qr(torch.randn(d, 6, dtype=torch.float64))
    x, y = torch.randn(30, 5, dtype=torch.float64), torch.randint(0, 3, (30,))
    splits = B.dirichlet_split(y.numpy(), 4, alpha=0.5, seed=1)

    def loss_on(idx):
        return lambda: nn.functional.cross_entropy(model(x[idx]), y[idx])  # mean over the samples

    seed, K, sigma = 1234, 8, 1e-2
    for basis_or_none, dim in ((basis, 6), (None, d)):
        z = B.round_directions(seed, K, dim)  # what every client and the server regenerate
        uploads = []
        for idx in splits:
            delta = B.loss_differences(model, loss_on(idx), theta, z, sigma, basis=basis_or_none)
            assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), theta)  # restored
            uploads.append(delta.numpy())
        mean = B.weighted_mean(uploads, [len(idx) for idx in splits])
        fed = B.stein_coordinates(torch.from_numpy(mean), z, sigma)
        central = B.stein_coordinates(
            B.loss_differences(model, loss_on(np.arange(len(y))), theta, z, sigma, basis=basis_or_none), z, sigma)
        # the mean loss of the union = the N_c-weighted mean of the clients' mean losses (float64 sums)
        torch.testing.assert_close(fed, central, atol=1e-10, rtol=0)
        assert central.abs().max() > 1e-3
        # an independent transcription of the two-sided difference (eq. 6 numerators), one direction
        u = (basis_or_none @ z[0]) if basis_or_none is not None else z[0]
        names, sizes = zip(*[(n, p.numel()) for n, p in model.named_parameters()])
        shapes = [p.shape for p in model.parameters()]
        f = lambda v: float(nn.functional.cross_entropy(torch.func.functional_call(  # noqa: E731
            model, {n: t.view(s) for n, t, s in zip(names, v.split(sizes), shapes)}, (x,)), y))
        full = B.loss_differences(model, loss_on(np.arange(len(y))), theta, z, sigma, basis=basis_or_none)
        assert abs(float(full[0]) - (f(theta + sigma * u) - f(theta - sigma * u))) < 1e-12


def test_dirichlet_split_partitions_and_skews():
    labels = np.repeat(np.arange(10), 50)
    parts = B.dirichlet_split(labels, 8, alpha=0.1, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    again = B.dirichlet_split(labels, 8, alpha=0.1, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # seeded
    classes = lambda ps: np.mean([len(np.unique(labels[p])) for p in ps])  # noqa: E731
    assert classes(parts) < classes(B.dirichlet_split(labels, 8, alpha=100.0, seed=0))
    with pytest.raises(ValueError, match="number of clients"):
        B.dirichlet_split(labels, 0, alpha=0.5, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        B.dirichlet_split(labels, 2, alpha=0.0, seed=0)


def test_round_directions_are_regenerated_from_the_seed():
    assert torch.equal(B.round_directions(7, 3, 4), B.round_directions(7, 3, 4))
    assert not torch.equal(B.round_directions(7, 3, 4), B.round_directions(8, 3, 4))
    with pytest.raises(ValueError, match="K"):
        B.round_directions(7, 0, 4)


def test_federated_config_rejects_zero_clients():
    from szo.federated.flower import FederatedConfig

    with pytest.raises(ValueError, match="'clients' must be >= 1, got 0"):
        FederatedConfig(clients=0)
    with pytest.raises(ValueError, match="valid: subspace, full"):
        FederatedConfig(space="tt")


def test_cli_zero_clients_is_one_clear_error(capsys):
    from szo.cli import main

    assert main(["federated", "digits-scratch", "--clients", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 'federated.clients' must be >= 1, got 0"]
    assert main(["federated", "digits-bp", "--clients", "2"]) == 2
    assert "kind: subspace" in capsys.readouterr().err
    assert main(["federated", "digits-scratch", "--clients", "1"]) == 2  # SecAgg+ needs three
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: secure aggregation (SecAgg+) needs at least 3 clients, got 1: ")
