"""BAFFLE on Flower: a server ``Strategy`` and ``NumPyClient`` s in separate processes over gRPC (loopback).

``run_federated(cfg, out_dir, FederatedConfig(...))`` splits the recipe's train set among the
clients (Dirichlet label skew, seeded), starts one process per client (``python -m
szo.federated.flower``, its spec on stdin; each builds the recipe's model and loads the stored subspace once), and runs Flower's
server (``flwr.server.start_server``, legacy gRPC transport on ``127.0.0.1``, a free port) in
this process for ``rounds`` rounds. Each round (batch-level BAFFLE = FedSGD):

* down: the current coordinates ``c`` (``k`` float32; ``d`` float32 with ``space="full"``) and a
  config ``{seed, K, sigma, round, n_total}``;
* client: ``K`` central loss differences on one local batch (:func:`szo.federated.baffle.loss_differences`),
  weighted by ``N_c / N``, fixed point, plus its zero-sum mask; and its BN batch statistics
  (averaged over its ``2K`` probes; BN running statistics are not private losses and are not
  masked), so the server's model can be evaluated in eval mode;
* up: ``K`` uint64 words + the BN statistics;
* server: adds the words mod 2**64 (the masks cancel), regenerates the directions from the seed,
  Stein's estimate, heavy-ball step on ``c``; BN running statistics move by ``bn_momentum``
  toward the client-weighted mean.

Bytes per round are the serialized Flower messages (``FitIns`` / ``FitRes`` protobufs, what gRPC
carries before its own framing), summed over clients. The server evaluates on the test set every
``eval_every`` rounds. Every client must answer every round (secure aggregation without dropout
recovery): a failure stops the run with an error. Client processes are joined with a timeout and
terminated if they outlive the server.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from szo.config import FEDERATED_SPACES, FederatedConfig, RecipeConfig, resolve
from szo.federated import baffle as B
from szo.stages import bptt_stage
from szo.zo import bn_layers, heavy_ball_

__all__ = ["FederatedConfig", "run_federated", "SPACES"]  # FederatedConfig: the schema's (szo.config)

SPACES: tuple[str, ...] = FEDERATED_SPACES


# ----------------------------------------------------------------------------- shared setup
class _Task:
    """What server and clients both build from the recipe: model, loss, subspace (basis, reference)."""

    def __init__(self, cfg: Mapping[str, Any], space: str) -> None:
        from szo.runs import build_model, loss_for, subspace_store_for

        self.model = build_model(cfg)
        sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=self.model)
        self.reference = sub.reference.detach().to(torch.float64)
        self.basis = sub.basis.detach().to(torch.float64) if space == "subspace" else None
        self.dim = int(self.basis.shape[1]) if self.basis is not None else int(self.reference.numel())
        self.loss_fn = loss_for(cfg)
        self.bn = bn_layers(self.model)
        self.model.load_flat_params(self.reference.float())

    def theta(self, params: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The parameters (float64 ``[d]``) at the server's coordinates (the subspace's, or the full space's)."""
        p = params.to(torch.float64) if isinstance(params, torch.Tensor) \
            else torch.from_numpy(np.asarray(params, dtype=np.float64))
        return self.reference + self.basis @ p if self.basis is not None else p

    def bn_stats(self) -> np.ndarray:
        if not self.bn:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([torch.cat([m.running_mean, m.running_var]) for m in self.bn]).numpy().astype(np.float32)

    def set_bn_stats(self, flat: np.ndarray) -> None:
        off = 0
        for m in self.bn:
            n = m.running_mean.numel()
            m.running_mean.copy_(torch.from_numpy(flat[off:off + n]))
            m.running_var.copy_(torch.from_numpy(flat[off + n:off + 2 * n]))
            off += 2 * n


def _dataset(cfg: Mapping[str, Any], split: str):
    from szo.data import get_dataset

    d = cfg["data"]
    return get_dataset(d["name"], split, augment=False if d["augment"] is not None else None,
                       data_dir=d["data_dir"], download=d["download"], **d["kwargs"])


def _targets(ds) -> np.ndarray:
    t = getattr(ds, "targets", None)
    if t is None:
        t = [int(ds[i][1]) for i in range(len(ds))]
    return np.asarray(t.numpy() if isinstance(t, torch.Tensor) else t, dtype=np.int64)


# ----------------------------------------------------------------------------- client
def _make_client(cfg: Mapping[str, Any], fc: FederatedConfig, cid: int, indices: np.ndarray, secret: bytes):
    import flwr as fl

    task = _Task(cfg, fc.space)
    ds = _dataset(cfg, "train")
    xs = torch.stack([ds[int(i)][0] for i in indices])
    ys = torch.tensor([int(ds[int(i)][1]) for i in indices])
    n_local = len(indices)

    class BaffleClient(fl.client.NumPyClient):
        def fit(self, parameters, config):
            rnd, seed = int(config["round"]), int(config["seed"])
            g = torch.Generator().manual_seed(seed * 1009 + cid)  # this client's batch, reproducible
            pick = torch.randperm(n_local, generator=g)[: fc.batch_size]
            x, y = xs[pick], ys[pick]
            z = B.round_directions(seed, fc.K, task.dim)
            model = task.model
            model.train()
            for m in task.bn:  # running stats := mean of this round's batch statistics over the probes
                m.reset_running_stats()
                m.momentum = None

            point = torch.from_numpy(np.asarray(parameters[0], dtype=np.float64))
            delta = B.loss_differences(model, lambda: task.loss_fn(model(x), y), point, z, fc.sigma,
                                       to_params=task.theta, basis=task.basis)
            words = B.encode(delta.numpy() * n_local / int(config["n_total"]))
            if fc.secure:
                with np.errstate(over="ignore"):
                    words = words + B.pairwise_masks(cid, list(range(fc.clients)), rnd, fc.K, secret)
            return [words, task.bn_stats()], n_local, {}

    return BaffleClient()


def _client_main(spec: Mapping[str, Any]) -> None:
    """One client process: ``python -m szo.federated.flower`` reads its spec (JSON) from stdin."""
    import flwr as fl

    torch.set_num_threads(1)  # many client processes share the cores
    fc = FederatedConfig(**spec["federated"])
    client = _make_client(spec["cfg"], fc, int(spec["cid"]), np.asarray(spec["indices"], dtype=np.int64),
                          bytes.fromhex(spec["secret"]))
    fl.client.start_client(server_address=spec["address"], client=client.to_client(), insecure=True,
                           max_retries=30, max_wait_time=120.0)


if __name__ == "__main__":
    import sys

    _client_main(json.loads(sys.stdin.read()))


# ----------------------------------------------------------------------------- server
def _make_strategy(cfg: Mapping[str, Any], fc: FederatedConfig, task: _Task, n_total: int, run_dir: Path,
                   test_loader):
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.serde import fit_ins_to_proto, fit_res_to_proto
    from flwr.server.strategy import Strategy

    from szo.train import evaluate

    seeds = np.random.default_rng(int(cfg["seed"])).integers(1, 2 ** 31 - 1, size=fc.rounds + 1)

    class BaffleStrategy(Strategy):
        def __init__(self) -> None:
            self.c = np.zeros(task.dim, dtype=np.float64) if task.basis is not None \
                else task.reference.numpy().copy()
            self.v = np.zeros_like(self.c)
            self.bn = task.bn_stats().astype(np.float64)
            self.history: list[dict[str, Any]] = []
            self.bytes_down: list[int] = []
            self.bytes_up: list[int] = []
            self.t0 = time.perf_counter()
            self.fp = 0

        def _params(self):
            return ndarrays_to_parameters([self.c.astype(np.float32)])

        def initialize_parameters(self, client_manager):
            return self._params()

        def configure_fit(self, server_round, parameters, client_manager):
            if not client_manager.wait_for(fc.clients, timeout=int(fc.round_timeout_s)):
                raise RuntimeError(f"only {client_manager.num_available()} of {fc.clients} clients connected")
            proxies = client_manager.sample(num_clients=fc.clients, min_num_clients=fc.clients)
            ins = FitIns(self._params(), {"round": server_round, "seed": int(seeds[server_round]),
                                          "n_total": n_total})
            self.bytes_down.append(fit_ins_to_proto(ins).ByteSize() * len(proxies))
            return [(p, ins) for p in proxies]

        def aggregate_fit(self, server_round, results, failures):
            if failures or len(results) != fc.clients:
                raise RuntimeError(f"round {server_round}: {len(results)} of {fc.clients} clients answered "
                                   f"({len(failures)} failures); the secure-aggregation masks only cancel when all do")
            self.bytes_up.append(sum(fit_res_to_proto(r).ByteSize() for _, r in results))
            arrays = [parameters_to_ndarrays(r.parameters) for _, r in results]
            delta = torch.from_numpy(B.aggregate([a[0] for a in arrays]))
            z = B.round_directions(int(seeds[server_round]), fc.K, task.dim)
            grad = B.stein_coordinates(delta, z, fc.sigma).numpy()
            lr = fc.lr * 0.5 * (1 + math.cos(math.pi * (server_round - 1) / fc.rounds))  # cosine, as the recipes
            heavy_ball_(torch.from_numpy(self.v), torch.from_numpy(grad), lr=lr, momentum=fc.momentum)  # in place
            self.c = self.c + self.v
            if self.bn.size:
                weights = [r.num_examples / n_total for _, r in results]
                mean = sum(w * a[1].astype(np.float64) for w, a in zip(weights, arrays))
                self.bn = (1 - fc.bn_momentum) * self.bn + fc.bn_momentum * mean
            self.fp += 2 * fc.K * fc.clients
            row = {"round": server_round, "lr": lr, "bytes_down": self.bytes_down[-1], "bytes_up": self.bytes_up[-1],
                   "fp": self.fp, "wall_time_s": time.perf_counter() - self.t0}
            if server_round % fc.eval_every == 0 or server_round == fc.rounds:
                row["test_loss"], row["test_acc"] = self._evaluate()
            self.history.append(row)
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            return self._params(), {}

        def _evaluate(self) -> tuple[float, float]:
            task.model.load_flat_params(task.theta(self.c).float())
            task.set_bn_stats(self.bn.astype(np.float32))
            return evaluate(task.model, test_loader, task.loss_fn)

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return BaffleStrategy()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_federated(cfg: Mapping[str, Any], out_dir: str | os.PathLike, fc: FederatedConfig | None = None
                  ) -> dict[str, Any]:
    """Run BAFFLE for ``fc.rounds`` rounds with ``fc.clients`` client processes; write ``out_dir``
    (config.yaml, federated.json, metrics.jsonl, results.json); return the summary. ``fc``
    defaults to the recipe's ``federated`` section; given, it replaces that section (config.yaml
    records what ran).

    The server's own work (evaluation) runs with one torch thread while the clients share the
    cores; the caller's thread count is restored afterwards."""
    cfg = cfg if isinstance(cfg, RecipeConfig) else resolve(cfg)
    if fc is not None:
        cfg = dataclasses.replace(cfg, federated=fc)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_federated(cfg, out_dir, cfg.federated)
    finally:
        torch.set_num_threads(prev)


def _run_federated(cfg: Mapping[str, Any], out_dir: str | os.PathLike, fc: FederatedConfig) -> dict[str, Any]:
    if cfg.get("kind") != "subspace":
        raise ValueError(f"szo federated trains in a stored subspace: use a 'kind: subspace' recipe "
                         f"(e.g. digits-scratch); {cfg.get('name')!r} is kind {cfg.get('kind')!r}")
    try:
        import flwr as fl
    except ModuleNotFoundError as e:
        raise ValueError("szo federated runs on Flower: pip install 'szo[federated]' (flwr)") from e

    from szo.config import write_config
    from szo.data import make_loader
    from szo.io import atomic_write_json
    from szo.runs import subspace_store_for

    run_dir = Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if not subspace_store_for(cfg).exists(cfg["subspace"]["name"]):
        bptt_stage(cfg, run_dir / "bptt")  # the subspace the clients download once
    write_config(cfg, run_dir / "config.yaml")
    atomic_write_json(run_dir / "federated.json", fc.to_dict())
    train = _dataset(cfg, "train")
    splits = B.dirichlet_split(_targets(train), fc.clients, fc.alpha, seed=int(cfg["seed"]))
    n_total = int(sum(len(s) for s in splits))
    task = _Task(cfg, fc.space)
    test_loader = make_loader(_dataset(cfg, "test"), cfg["data"]["test_batch_size"], shuffle=False)
    strategy = _make_strategy(cfg, fc, task, n_total, run_dir, test_loader)
    secret = secrets.token_bytes(32)  # the clients' shared secret for the mask seeds; the server never sees it
    address = f"127.0.0.1:{_free_port()}"
    t0 = time.perf_counter()
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        for c in range(fc.clients):  # one OS process per client, spec on stdin (the secret never hits the disk)
            p = subprocess.Popen([sys.executable, "-m", "szo.federated.flower"], stdin=subprocess.PIPE, env=env)
            spec = {"cfg": cfg.to_dict(), "federated": fc.to_dict(), "cid": c, "indices": splits[c].tolist(),
                    "secret": secret.hex(), "address": address}
            p.stdin.write(json.dumps(spec).encode())
            p.stdin.close()
            procs.append(p)
        fl.server.start_server(server_address=address, strategy=strategy,
                               config=fl.server.ServerConfig(num_rounds=fc.rounds, round_timeout=fc.round_timeout_s))
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(timeout=10)
    wall = time.perf_counter() - t0
    if len(strategy.history) != fc.rounds:
        raise RuntimeError(f"the federation stopped after {len(strategy.history)} of {fc.rounds} rounds; "
                           "see the Flower log above")
    accs = [r["test_acc"] for r in strategy.history if "test_acc" in r]
    setup_bytes = 4 * (task.reference.numel() + (task.basis.numel() if task.basis is not None else 0))
    summary = {
        "method": "baffle", "recipe": cfg["name"], "space": fc.space, "clients": fc.clients, "rounds": fc.rounds,
        "K": fc.K, "d": int(task.reference.numel()), "dim": task.dim, "secure": fc.secure, "alpha": fc.alpha,
        "client_sizes": [len(s) for s in splits],
        "best_test_acc": max(accs), "final_test_acc": accs[-1], "fp": strategy.fp, "bp": 0,
        "fp_per_round": 2 * fc.K * fc.clients,
        "bytes_down_per_round": float(np.mean(strategy.bytes_down)),
        "bytes_up_per_round": float(np.mean(strategy.bytes_up)),
        "bytes_up_per_client_round": float(np.mean(strategy.bytes_up)) / fc.clients,
        "bytes_setup_per_client": int(setup_bytes),
        "wall_time_min": wall / 60,
    }
    atomic_write_json(run_dir / "results.json", summary)
    return summary
