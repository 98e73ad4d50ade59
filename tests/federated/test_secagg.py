"""Flower's SecAgg+ as szo runs it: a ServerApp (DefaultWorkflow + SecAggPlusWorkflow, the ranges
``szo.federated.flower.server_app`` uses) over the loopback grid, ClientApps with ``secaggplus_mod``
answering from threads of this process (the protocol, without the model's start-up cost)."""
import threading

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flwr")

from flwr.app import Context  # noqa: E402
from flwr.client import NumPyClient  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import FitIns, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.server import LegacyContext, ServerConfig  # noqa: E402
from flwr.server.strategy import Strategy  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from szo.federated import baffle as B  # noqa: E402
from szo.federated.grid import LoopbackGrid, node_id_of, run_server_app, serve_node  # noqa: E402

CLIP = 4.0


class _Fixed(NumPyClient):
    """Uploads ``vectors[round]`` with weight ``n``."""

    def __init__(self, cid, vectors, n):
        self.cid, self.vectors, self.n = cid, vectors, n

    def fit(self, parameters, config):
        return [self.vectors[int(config["round"])]], self.n, {"cid": self.cid}


class _Keep(Strategy):
    """Every node every round; keeps what SecAgg+ hands to aggregate_fit."""

    def __init__(self):
        self.got = {}

    def initialize_parameters(self, client_manager):
        return ndarrays_to_parameters([np.zeros(1)])

    def configure_fit(self, server_round, parameters, client_manager):
        return [(p, FitIns(parameters, {"round": server_round})) for p in client_manager.all().values()]

    def aggregate_fit(self, server_round, results, failures):
        self.got[server_round] = (parameters_to_ndarrays(results[0][1].parameters)[0],
                                  sorted(r.metrics["cid"] for _, r in results))
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class _Recording(LoopbackGrid):
    """A server that keeps every reply it receives (what an honest-but-curious server sees)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def pull_messages(self, message_ids):
        out = list(super().pull_messages(message_ids))
        self.seen.extend(out)
        return out


def _federate(client_vectors, weights, rounds=1, grid=None, mods=None):
    """Run SecAgg+ over the clients' per-round vectors; returns {round: (aggregate, cids)} and the grid."""
    n = len(client_vectors)
    grid = grid or LoopbackGrid()
    for c, (vectors, w) in enumerate(zip(client_vectors, weights)):
        def client_fn(context: Context, c=c, vectors=vectors, w=w):
            return _Fixed(c, vectors, w).to_client()
        app = ClientApp(client_fn=_one_arg(client_fn), mods=[*((mods or {}).get(c, [])), secaggplus_mod])
        threading.Thread(target=serve_node, args=(grid.address, c, app, grid.client_key(c)), daemon=True).start()
    grid.wait_for_nodes(n, 30)
    strategy = _Keep()
    q, m = B.secagg_ranges(n)
    server = ServerApp()

    @server.main()
    def main(g, context):
        legacy = LegacyContext(context=context, strategy=strategy, config=ServerConfig(num_rounds=rounds))
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
            num_shares=1.0, reconstruction_threshold=0.75, max_weight=float(sum(weights)), clipping_range=CLIP,
            quantization_range=q, modulus_range=m, timeout=60))(g, legacy)

    try:
        run_server_app(server, grid)
    finally:
        grid.close()
    return strategy.got, grid


def _one_arg(fn):
    def client_fn(context: Context):
        return fn(context)
    return client_fn


def test_secagg_ranges_leave_the_sum_room_in_the_field():
    for n in (2, 3, 4, 7, 8, 9, 100):
        q, m = B.secagg_ranges(n)
        assert m == 2 ** 32 and n * q < m <= 2 * n * q and q & (q - 1) == 0  # the largest power of 2 that fits
    with pytest.raises(ValueError, match="needs an int >= 2 clients"):
        B.secagg_ranges(1)
    assert B.secagg_error_bound(4, 16.0, 2 ** 29, 1.0) == pytest.approx(4 * 3 * 16 / 2 ** 29)


def test_secagg_aggregate_equals_the_centralised_estimate():
    """Four clients' BAFFLE loss differences (a small model, their own data), through SecAgg+:
    the server's aggregate is the loss difference on the union of their data, and Stein's
    estimate from it the centralised one, within the stated quantization bound."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    x, y = torch.randn(40, 5, dtype=torch.float64), torch.randint(0, 3, (40,))
    splits = B.dirichlet_split(y.numpy(), 4, alpha=0.5, seed=1)
    seed, K, sigma = 1234, 16, 1e-2
    z = B.round_directions(seed, K, theta.numel())

    def loss_on(idx):
        return lambda: nn.functional.cross_entropy(model(x[idx]), y[idx])  # mean over the samples

    deltas = [B.loss_differences(model, loss_on(idx), theta, z, sigma).numpy() for idx in splits]
    weights = [len(idx) for idx in splits]
    got, _ = _federate([{1: d} for d in deltas], weights)
    agg, cids = got[1]
    assert cids == [0, 1, 2, 3]
    # centralised, transcribed independently: the union's mean loss at theta +- sigma z_k
    names, sizes = zip(*[(n, p.numel()) for n, p in model.named_parameters()])
    shapes = [p.shape for p in model.parameters()]

    def f(v):
        params = {n: t.view(s) for n, t, s in zip(names, v.split(sizes), shapes)}
        return float(nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y))

    central = np.array([f(theta + sigma * z[k]) - f(theta - sigma * z[k]) for k in range(K)])
    assert np.abs(central).max() > 1e-4  # a real signal, far above the bound
    bound = B.secagg_error_bound(4, CLIP, B.secagg_ranges(4)[0], 1.0)
    assert bound < 1e-6
    np.testing.assert_allclose(agg, central, atol=bound + 1e-12, rtol=0)
    g_fed = B.stein_coordinates(torch.from_numpy(agg), z, sigma)
    g_central = B.stein_coordinates(torch.from_numpy(central), z, sigma)
    torch.testing.assert_close(g_fed, g_central, atol=bound / (2 * sigma) * float(z.abs().max()), rtol=0)


def test_the_server_sees_uniform_words_not_a_clients_values():
    """What one client uploads, as the server receives it: integers uniform on the field and
    uncorrelated with the plaintext -- while the same client's quantized plaintext (what an
    unmasked upload would carry, the control) is neither."""
    K = 4096
    rng = np.random.default_rng(0)
    secret = np.linspace(-CLIP, CLIP, K)  # a ramp: maximally structured
    others = [rng.uniform(-1, 1, K) for _ in range(2)]
    grid = _Recording()
    _federate([{1: secret}, {1: others[0]}, {1: others[1]}], [10, 20, 30], grid=grid)
    mine = [m for m in grid.seen if m.metadata.src_node_id == node_id_of(0) and not m.has_error()
            and Key.MASKED_PARAMETERS in m.content.config_records[RECORD_KEY_CONFIGS]]
    assert len(mine) == 1
    words = bytes_to_ndarray(mine[0].content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS][1])
    assert words.shape == (K,) and words.min() >= 0 and words.max() < 2 ** 32
    bins = 64

    def uniform_p(v):
        counts = np.bincount((np.asarray(v, dtype=np.float64) / 2 ** 32 * bins).astype(int), minlength=bins)
        chi2 = float(((counts - len(v) / bins) ** 2).sum() / (len(v) / bins))  # Pearson, bins - 1 dof
        return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64),
                                             torch.tensor(chi2 / 2, dtype=torch.float64)))

    def corr(v):
        return abs(np.corrcoef(np.asarray(v, dtype=np.float64), secret)[0, 1])

    assert uniform_p(words) > 1e-4 and corr(words) < 5 / np.sqrt(K)
    q, _ = B.secagg_ranges(3)
    plain = np.round((secret * 10 / 60 + CLIP) * q / (2 * CLIP))  # the upload before masking (weight 10/60)
    assert uniform_p(plain) < 1e-12 and corr(plain) > 0.99  # the test can tell structure from masks


def test_a_client_that_dies_after_key_sharing_is_recovered():
    """Client 2 raises at the masked-upload stage of round 2 (after sharing its keys): SecAgg+
    reconstructs its pairwise masks from the others' shares and aggregates clients 0, 1, 3."""
    from flwr.app import Message

    def dies_in_round_2(msg: Message, context: Context, call_next):
        cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if msg.metadata.group_id == "2" and cfg is not None and cfg.get(Key.STAGE) == "collect_masked_vectors":
            raise RuntimeError("client 2 leaves")
        return call_next(msg, context)

    vec = [{r: np.full(3, float(c + r)) for r in (1, 2)} for c in range(4)]
    w = [10, 20, 30, 40]
    got, _ = _federate(vec, w, rounds=2, mods={2: [dies_in_round_2]})
    bound = B.secagg_error_bound(4, CLIP, B.secagg_ranges(4)[0], 0.6)
    assert got[1][1] == [0, 1, 2, 3]
    np.testing.assert_allclose(got[1][0], sum(wi * (c + 1) for c, wi in enumerate(w)) / 100, atol=bound)
    assert got[2][1] == [0, 1, 3]
    np.testing.assert_allclose(got[2][0], (10 * 2 + 20 * 3 + 40 * 5) / 70, atol=bound)
