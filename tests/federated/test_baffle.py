"""BAFFLE math: zero-sum masks cancel exactly; the secure aggregate equals the centralised estimate."""
import numpy as np
import pytest
import torch
from torch import nn

from szo.federated import baffle as B


def _pairs(clients):
    return {k.client: k.pair for k in B.agree_all(clients)}


@pytest.mark.parametrize("n_clients", [1, 2, 5, 8])
def test_masks_cancel_exactly(n_clients):
    clients = list(range(n_clients))
    pairs = _pairs(clients)
    masks = [B.pairwise_masks(c, clients, rnd=3, K=7, pair_secrets=pairs[c]) for c in clients]
    total = np.zeros(7, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for m in masks:
            total += m
    assert total.tolist() == [0] * 7  # exactly zero mod 2**64, not approximately
    if n_clients > 1:
        assert all(np.any(m != 0) for m in masks)  # every single upload is hidden
        other = B.pairwise_masks(0, clients, rnd=4, K=7, pair_secrets=pairs[0])
        assert not np.array_equal(other, masks[0])  # fresh masks every round


def test_no_one_but_the_pair_knows_a_pair_secret():
    """The defect the masks had (one secret every client held): client 1 could recompute client
    2's mask and unmask its upload. With Diffie-Hellman pair secrets it cannot: client 1 shares a
    secret with 2, but 2's mask also uses the secrets 2 shares with 0 and 3, and neither client 1
    nor the server (which sees only public keys) can derive those."""
    clients = [0, 1, 2, 3]
    keys = B.agree_all(clients)
    pub = {k.client: k.public for k in keys}
    assert keys[1].pair[2] == keys[2].pair[1] and keys[2].pair[3] == keys[3].pair[2]  # agreed
    assert len({keys[i].pair[j] for i in clients for j in clients if i < j}) == 6  # every pair its own
    true = B.pairwise_masks(2, clients, 5, 4, keys[2].pair)
    # what client 1 can compute for client 2: its own pair secret, plus secrets it would have to guess
    for guess in (keys[1].pair[0], keys[1].pair[3], b"\0" * 32):
        forged = {0: guess, 1: keys[1].pair[2], 3: guess}
        assert not np.array_equal(B.pairwise_masks(2, clients, 5, 4, forged), true)
    # a key pair made up under client 2's id (by the server, say) derives other secrets than the real one
    impostor = B.MaskKeys(2)
    assert impostor.agree(pub | {2: impostor.public}) != keys[2].pair
    with pytest.raises(ValueError, match="no pair secret with client"):
        B.pairwise_masks(2, clients, 5, 4, {0: keys[2].pair[0]})
    with pytest.raises(ValueError, match="32 raw bytes"):
        keys[0].agree({1: b"short"})
    with pytest.raises(ValueError, match="not this client's own public key"):
        keys[0].agree({0: keys[1].public})


def test_encode_decode_and_masked_sum():
    v = np.array([0.5, -1.25, 3e-6, -7.0])
    assert np.array_equal(B.decode(B.encode(v)), np.round(v * 2.0 ** 32) / 2.0 ** 32)
    parts = [np.array([0.1, -0.2]), np.array([-0.3, 0.25]), np.array([1.0, 2.0])]
    clients = [0, 1, 2]
    pairs = _pairs(clients)
    with np.errstate(over="ignore"):
        uploads = [B.encode(p) + B.pairwise_masks(c, clients, 0, 2, pairs[c]) for c, p in enumerate(parts)]
    unmasked = B.aggregate([B.encode(p) for p in parts])
    assert np.array_equal(B.aggregate(uploads), unmasked)  # bit-identical with and without masks
    np.testing.assert_allclose(unmasked, sum(parts), atol=3 * 2.0 ** -33)
    with pytest.raises(ValueError, match="zero clients"):
        B.aggregate([])
    with pytest.raises(ValueError, match="non-finite"):
        B.encode([float("nan")])


def test_secure_aggregate_equals_centralised_estimate():
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
    pairs = _pairs(list(range(len(splits))))
    for basis_or_none, dim in ((basis, 6), (None, d)):
        z = B.round_directions(seed, K, dim)  # what every client and the server regenerate
        uploads = []
        for c, idx in enumerate(splits):
            delta = B.loss_differences(model, loss_on(idx), theta, z, sigma, basis=basis_or_none)
            assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), theta)  # restored
            with np.errstate(over="ignore"):
                uploads.append(B.encode(delta.numpy() * len(idx) / len(y))
                               + B.pairwise_masks(c, list(range(len(splits))), 0, K, pairs[c]))
        fed = B.stein_coordinates(torch.from_numpy(B.aggregate(uploads)), z, sigma)
        central = B.stein_coordinates(
            B.loss_differences(model, loss_on(np.arange(len(y))), theta, z, sigma, basis=basis_or_none), z, sigma)
        # the only difference: 2**-32 fixed point per client upload, / (2 sigma), averaged over K
        torch.testing.assert_close(fed, central, atol=len(splits) * 2.0 ** -32 / (2 * sigma) * 4, rtol=0)
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
