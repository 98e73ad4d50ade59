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
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from szo.config import FEDERATED_SPACES, FederatedConfig, RecipeConfig, resolve, write_config
from szo.data import get_dataset, make_loader
from szo.distributed import RankFailure
from szo.federated import baffle as B
from szo.io import atomic_write_json
from szo.rundir import check_pins, run_pins
from szo.runs import build_model, loss_for, subspace_store_for
from szo.stages import bptt_stage, metric_sinks, run_dir_guard
from szo.train import (
    DIVERGE_FACTOR,
    Callback,
    MetricsLogger,
    TrainingDiverged,
    checkpoint_from_bytes,
    checkpoint_path,
    evaluate,
    read_checkpoint_bytes,
    save_checkpoint,
)
from szo.zo import bn_layers, heavy_ball_

try:  # optional (extra "federated"): run_federated says how to install it
    import flwr as fl
    from flwr.common import FitIns, GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.serde import fit_ins_to_proto, fit_res_to_proto, get_properties_res_to_proto
except ImportError:  # pragma: no cover - exercised where flwr is missing
    fl = None

__all__ = ["FederatedConfig", "run_federated", "SPACES"]  # FederatedConfig: the schema's (szo.config)

SPACES: tuple[str, ...] = FEDERATED_SPACES


# ----------------------------------------------------------------------------- shared setup
class _Task:
    """What server and clients both build from the recipe: model, loss, subspace (basis, reference)."""

    def __init__(self, cfg: Mapping[str, Any], space: str) -> None:
        self.model = build_model(cfg)
        store = subspace_store_for(cfg)
        sub = store.load(cfg["subspace"]["name"], model=self.model)
        self.digest = store.digest(cfg["subspace"]["name"])
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
    d = cfg["data"]
    return get_dataset(d["name"], split, augment=False if d["augment"] is not None else None,
                       data_dir=d["data_dir"], download=d["download"], **d["kwargs"])


def _targets(ds) -> np.ndarray:
    t = getattr(ds, "targets", None)
    if t is None:
        t = [int(ds[i][1]) for i in range(len(ds))]
    return np.asarray(t.numpy() if isinstance(t, torch.Tensor) else t, dtype=np.int64)


# ----------------------------------------------------------------------------- client
def _make_client(cfg: Mapping[str, Any], fc: FederatedConfig, cid: int, indices: np.ndarray):
    task = _Task(cfg, fc.space)
    keys = B.MaskKeys(cid) if fc.secure else None  # the private key never leaves this process
    ds = _dataset(cfg, "train")
    xs = torch.stack([ds[int(i)][0] for i in indices])
    ys = torch.tensor([int(ds[int(i)][1]) for i in indices])
    n_local = len(indices)

    class BaffleClient(fl.client.NumPyClient):
        def get_properties(self, config):  # the key agreement's upload: who I am, my public key
            return {"cid": cid, "public_key": keys.public if keys is not None else b""}

        def fit(self, parameters, config):
            rnd, seed = int(config["round"]), int(config["seed"])
            publics = {int(k[len(KEY_PREFIX):]): v for k, v in config.items() if k.startswith(KEY_PREFIX)}
            if keys is not None and publics:  # the first round after the clients started: agree
                keys.agree(publics)
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
                    words = words + B.pairwise_masks(cid, list(range(fc.clients)), rnd, fc.K, keys.pair)
            return [words, task.bn_stats()], n_local, {"cid": cid}

    return BaffleClient()


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """A daemon thread that ends this process once its parent (the server) is no longer its parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="szo-server-watch").start()


def _client_main(spec: Mapping[str, Any]) -> None:
    """One client process: ``python -m szo.federated.flower`` reads its spec (JSON) from stdin.
    It exits when its server process is gone (killed, crashed) instead of retrying for minutes."""
    _exit_with_parent()
    torch.set_num_threads(1)  # many client processes share the cores
    fc = FederatedConfig(**spec["federated"])
    client = _make_client(spec["cfg"], fc, int(spec["cid"]), np.asarray(spec["indices"], dtype=np.int64))
    fl.client.start_client(server_address=spec["address"], client=client.to_client(), insecure=True,
                           max_retries=30, max_wait_time=120.0)


# ----------------------------------------------------------------------------- server
@dataclasses.dataclass
class ServerState:
    """What the server keeps between rounds (its checkpoint): coordinates ``c``, heavy-ball
    velocity ``v``, BN running statistics, the metrics history, bytes and forwards so far."""

    c: np.ndarray
    v: np.ndarray
    bn: np.ndarray
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bytes_down: list[int] = dataclasses.field(default_factory=list)
    bytes_up: list[int] = dataclasses.field(default_factory=list)
    fp: int = 0
    wall_time_s: float = 0.0

    @property
    def rounds_done(self) -> int:
        return len(self.history)

    def to_checkpoint(self) -> dict[str, Any]:
        return {"kind": "federated", "c": torch.from_numpy(self.c.copy()), "v": torch.from_numpy(self.v.copy()),
                "bn": torch.from_numpy(self.bn.copy()), "history": self.history, "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "fp": self.fp, "wall_time_s": self.wall_time_s}

    @classmethod
    def from_checkpoint(cls, st: Mapping[str, Any], path: Any = "checkpoint") -> "ServerState":
        if st.get("kind") != "federated":
            what = f"a '{st['method']}' training run" if isinstance(st.get("method"), str) else "something else"
            raise ValueError(f"{path} is the checkpoint of {what}, not of a szo federated run: "
                             "choose another --out for the federation")
        return cls(c=st["c"].numpy().copy(), v=st["v"].numpy().copy(), bn=st["bn"].numpy().copy(),
                   history=list(st["history"]), bytes_down=list(st["bytes_down"]), bytes_up=list(st["bytes_up"]),
                   fp=int(st["fp"]), wall_time_s=float(st["wall_time_s"]))


class BaffleServer:
    """The server's side of BAFFLE, whatever carries the messages: the round's config, the
    aggregation and heavy-ball step, evaluation, and after every round the run contract's
    bookkeeping (checkpoint with its sha256 record, metrics.jsonl and the other sinks, callbacks)."""

    def __init__(self, cfg: RecipeConfig, task: _Task, n_total: int, run_dir: Path, test_loader: Any,
                 state: ServerState | None, sinks: list[Callback], callbacks: Sequence[Callback]):
        self.cfg, self.fc, self.task, self.n_total, self.run_dir = cfg, cfg.federated, task, n_total, run_dir
        self.test_loader = test_loader
        self.seeds = np.random.default_rng(int(cfg["seed"])).integers(1, 2 ** 31 - 1, size=self.fc.rounds + 1)
        self.state = state if state is not None else ServerState(
            c=np.zeros(task.dim, dtype=np.float64) if task.basis is not None else task.reference.numpy().copy(),
            v=np.zeros(task.dim, dtype=np.float64), bn=task.bn_stats().astype(np.float64))
        self.logger = MetricsLogger(run_dir / "metrics.jsonl")
        self.logger.reset(self.state.history)
        self.sinks, self.callbacks = sinks, list(callbacks)
        self.ckpt_sha: str | None = None
        self.t0 = time.perf_counter()

    def round_config(self, rnd: int) -> dict[str, Any]:
        """What every client gets with the coordinates in round ``rnd`` (1-based, absolute)."""
        return {"round": rnd, "seed": int(self.seeds[rnd]), "n_total": self.n_total}

    def step(self, rnd: int, uploads: Sequence[tuple[list[np.ndarray], int]], bytes_down: int, bytes_up: int,
             senders: Sequence[Any] | None = None) -> None:
        """Round ``rnd``: check, aggregate the clients' ``(arrays, n_examples)`` uploads and step.

        Clients are not trusted. Each upload must be ``[K uint64 words, BN statistics]`` with a
        plausible example count; a client's BN statistics are its own (not masked) and are dropped
        when not finite, of the wrong size or with a negative variance (the mean is over the
        others). The loss differences are masked, so only their aggregate can be checked: if it is
        not finite or beyond ``federated.max_loss_difference`` (or an upload's words are
        malformed, so the masks cannot cancel), the round makes no step. Both are logged in the
        round's metrics (``dropped_bn``, ``refused``). A test loss that stops being finite or grows
        ``DIVERGE_FACTOR`` times the first one ends the run with one :class:`TrainingDiverged` line."""
        fc, st, task = self.fc, self.state, self.task
        senders = list(senders) if senders is not None else list(range(len(uploads)))
        st.bytes_down.append(bytes_down)
        st.bytes_up.append(bytes_up)
        lr = fc.lr * 0.5 * (1 + math.cos(math.pi * (rnd - 1) / fc.rounds))  # cosine, as the recipes
        row: dict[str, Any] = {"round": rnd, "lr": lr, "bytes_down": bytes_down, "bytes_up": bytes_up}
        words, bn_ok, why = self._check_uploads(uploads, senders)
        grad = None
        if why is None:
            delta = B.aggregate(words)
            if not np.all(np.isfinite(delta)) or float(np.abs(delta).max(initial=0.0)) > fc.max_loss_difference:
                why = (f"aggregated loss differences out of range (max |dL| = {float(np.abs(delta).max()):.3g} > "
                       f"federated.max_loss_difference = {fc.max_loss_difference:g}): a client sent bad values")
            else:
                z = B.round_directions(int(self.seeds[rnd]), fc.K, task.dim)
                grad = B.stein_coordinates(torch.from_numpy(delta), z, fc.sigma).numpy()
        if grad is not None:
            heavy_ball_(torch.from_numpy(st.v), torch.from_numpy(grad), lr=lr, momentum=fc.momentum)  # in place
            st.c = st.c + st.v
        else:
            row["refused"] = why
            print(f"warning: round {rnd}: no step: {why}", file=sys.stderr, flush=True)
        if st.bn.size and bn_ok:
            n_ok = sum(uploads[i][1] for i in bn_ok)
            mean = sum(uploads[i][1] / n_ok * uploads[i][0][1].astype(np.float64) for i in bn_ok)
            st.bn = (1 - fc.bn_momentum) * st.bn + fc.bn_momentum * mean
        dropped = [senders[i] for i in range(len(uploads)) if i not in bn_ok]
        if dropped and st.bn.size:
            row["dropped_bn"] = dropped
            print(f"warning: round {rnd}: BN statistics of client(s) {dropped} dropped (not finite, wrong size or "
                  "negative variance)", file=sys.stderr, flush=True)
        st.fp += 2 * fc.K * fc.clients
        wall = st.wall_time_s + time.perf_counter() - self.t0
        row.update(fp=st.fp, wall_time_s=wall)
        if rnd % fc.eval_every == 0 or rnd == fc.rounds:
            row["test_loss"], row["test_acc"] = self.evaluate()
        st.history.append(row)
        self._after_round(rnd, row, wall)
        self._check_divergence(rnd, row)

    def _check_uploads(self, uploads: Sequence[tuple[list[np.ndarray], int]], senders: Sequence[Any]
                       ) -> tuple[list[np.ndarray], list[int], str | None]:
        """The masked words of every upload, the indices whose BN statistics are usable, and why
        the round cannot step (None: it can)."""
        K, n_bn = self.fc.K, self.state.bn.size
        words, bn_ok, why = [], [], None
        for i, (arrays, n) in enumerate(uploads):
            w = np.asarray(arrays[0]) if len(arrays) == 2 else None
            if w is None or w.shape != (K,) or w.dtype != np.uint64 or isinstance(n, bool) or not 0 < int(n) <= self.n_total:
                why = why or (f"client {senders[i]} sent a malformed upload (expected [{K} uint64 words, {n_bn} BN "
                              f"statistics] for 1..{self.n_total} examples): the masks cannot cancel without it")
                continue
            words.append(w)
            bn = np.asarray(arrays[1])
            half = n_bn // 2
            if (bn.shape == (n_bn,) and bn.dtype.kind == "f" and np.all(np.isfinite(bn))
                    and np.all(self._bn_var(bn, half) >= 0)):
                bn_ok.append(i)
        return words, bn_ok, why

    def _bn_var(self, flat: np.ndarray, half: int) -> np.ndarray:
        """The running variances inside a flat ``[mean_1, var_1, mean_2, var_2, ...]`` BN vector."""
        out, off = [], 0
        for m in self.task.bn:
            n = m.running_mean.numel()
            out.append(flat[off + n:off + 2 * n])
            off += 2 * n
        return np.concatenate(out) if out else np.zeros(0)

    def _check_divergence(self, rnd: int, row: dict[str, Any]) -> None:
        if "test_loss" not in row:
            return
        loss = float(row["test_loss"])
        first = next(float(r["test_loss"]) for r in self.state.history if "test_loss" in r)
        if not math.isfinite(loss) or loss > DIVERGE_FACTOR * max(abs(first), 1.0):
            raise TrainingDiverged(
                f"the federation diverged at round {rnd}: the test loss {loss:.4g} is "
                f"{'not finite' if not math.isfinite(loss) else f'more than {DIVERGE_FACTOR:g} times the first ({first:.4g})'}"
                "; lower federated.lr or federated.sigma, or look for a client sending bad values")

    def _after_round(self, rnd: int, row: dict[str, Any], wall: float) -> None:
        self.logger.append(row)
        for sink in self.sinks:
            sink.write(rnd, row)
        ckpt = {**self.state.to_checkpoint(), "wall_time_s": wall,
                "pins": json.dumps(run_pins(self.cfg, self.task.digest), sort_keys=True)}
        self.ckpt_sha = save_checkpoint(checkpoint_path(self.run_dir), ckpt, previous_sha256=self.ckpt_sha)
        for cb in self.callbacks:
            cb.on_step_end(rnd, rnd, float(row.get("test_loss", float("nan"))))

    def evaluate(self) -> tuple[float, float]:
        self.task.model.load_flat_params(self.task.theta(self.state.c).float())
        self.task.set_bn_stats(self.state.bn.astype(np.float32))
        return evaluate(self.task.model, self.test_loader, self.task.loss_fn)

    def params(self) -> np.ndarray:
        return self.state.c.astype(np.float32)


def _make_strategy(server: BaffleServer, fl: Any, wait_for_clients: Callable[[Any], None]) -> Any:
    """A Flower (legacy API) ``Strategy`` around ``server``: every client every round; Flower's
    round numbers count from 1 in this process, so they are offset by the rounds done before."""
    fc, offset = server.fc, server.state.rounds_done

    class BaffleStrategy(fl.server.strategy.Strategy):
        keys_sent = False

        def initialize_parameters(self, client_manager):
            return ndarrays_to_parameters([server.params()])

        def configure_fit(self, server_round, parameters, client_manager):
            wait_for_clients(client_manager)
            proxies = client_manager.sample(num_clients=fc.clients, min_num_clients=fc.clients)
            config = server.round_config(offset + server_round)
            self.key_bytes_up = 0
            if fc.secure and not self.keys_sent:  # relay the clients' public keys once per start
                publics, self.key_bytes_up = _collect_public_keys(proxies, fc, server_round)
                config.update({f"{KEY_PREFIX}{c}": pk for c, pk in publics.items()})
                self.keys_sent = True
            ins = FitIns(ndarrays_to_parameters([server.params()]), config)
            self.bytes_down = fit_ins_to_proto(ins).ByteSize() * len(proxies)
            return [(p, ins) for p in proxies]

        def aggregate_fit(self, server_round, results, failures):
            if failures or len(results) != fc.clients:
                raise RuntimeError(f"round {offset + server_round}: {len(results)} of {fc.clients} clients answered "
                                   f"({len(failures)} failures); the secure-aggregation masks only cancel when all do")
            up = sum(fit_res_to_proto(r).ByteSize() for _, r in results) + self.key_bytes_up
            uploads = [(parameters_to_ndarrays(r.parameters), r.num_examples) for _, r in results]
            senders = [r.metrics.get("cid", p.cid) for p, r in results]
            server.step(offset + server_round, uploads, self.bytes_down, up, senders)
            return ndarrays_to_parameters([server.params()]), {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return BaffleStrategy()


KEY_PREFIX = "pk_"
"""Round-config keys ``pk_<client id>``: the clients' X25519 public keys, relayed in the first round."""


def _collect_public_keys(proxies: Sequence[Any], fc: FederatedConfig, group_id: int) -> tuple[dict[int, bytes], int]:
    """Every client's ``(id, public key)`` through Flower's ``get_properties``, checked: ids
    ``0..clients-1`` once each, 32-byte keys. Also the bytes those answers took (upload)."""
    answers = [p.get_properties(GetPropertiesIns(config={}), timeout=fc.round_timeout_s, group_id=group_id)
               for p in proxies]
    publics: dict[int, bytes] = {}
    for a in answers:
        cid, pk = a.properties.get("cid"), a.properties.get("public_key")
        if (isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < fc.clients or cid in publics
                or not isinstance(pk, bytes) or len(pk) != B.PUBLIC_KEY_BYTES):
            raise FederationError(f"a client answered the key agreement with client id {cid!r} and a "
                                  f"{len(pk) if isinstance(pk, bytes) else type(pk).__name__}-byte key; expected "
                                  f"ids 0..{fc.clients - 1} once each and {B.PUBLIC_KEY_BYTES}-byte X25519 keys")
        publics[cid] = pk
    return publics, sum(get_properties_res_to_proto(a).ByteSize() for a in answers)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_federated(cfg: Mapping[str, Any], out_dir: str | os.PathLike, fc: FederatedConfig | None = None, *,
                  resume: bool = False, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Run BAFFLE for ``fc.rounds`` rounds with ``fc.clients`` client processes; write ``out_dir``
    (config.yaml, federated.json, metrics.jsonl, checkpoints/last.pt, results.json); return the
    summary. ``fc`` defaults to the recipe's ``federated`` section; given, it replaces that
    section (config.yaml records what ran).

    The run contract of every szo run (docs/runs.md): the directory's lock; a directory that
    holds a checkpoint is refused unless ``resume``, which continues after the last completed
    round (bit-exactly: the server state is checkpointed every round, every client's round is a
    function of the round's seed) and refuses a config that changes what is trained;
    results.json says ``"status": "completed"``. ``callbacks``: ``on_step_end(round, round,
    test loss)`` after every round's checkpoint.

    The server's own work (evaluation) runs with one torch thread while the clients share the
    cores; the caller's thread count is restored afterwards."""
    cfg = cfg if isinstance(cfg, RecipeConfig) else resolve(cfg)
    if fc is not None:
        cfg = dataclasses.replace(cfg, federated=fc)
    if cfg.kind != "subspace":
        raise ValueError(f"szo federated trains in a stored subspace: use a 'kind: subspace' recipe "
                         f"(e.g. digits-scratch); {cfg.name!r} is kind {cfg.kind!r}")
    if fl is None:
        raise ValueError("szo federated runs on Flower: pip install 'szo[federated]' (flwr)")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with run_dir_guard(out_dir, cfg, resume=resume, stage="federated"):
            return _run_federated(cfg, Path(out_dir), resume, callbacks)
    finally:
        torch.set_num_threads(prev)


def _start_state(run_dir: Path, resume: bool, cfg: RecipeConfig) -> ServerState | None:
    """The checkpointed server state to continue from, or None for a fresh start; a checkpoint
    whose pinned config (or subspace) differs from now is refused in one line."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    if not resume:
        raise ValueError(f"{run_dir} already holds a checkpoint ({path}); pass --resume to continue it "
                         "or use another --out")
    blob, _ = read_checkpoint_bytes(path)
    st = checkpoint_from_bytes(blob, path)
    state = ServerState.from_checkpoint(st, path)
    if isinstance(st.get("pins"), str):
        store = subspace_store_for(cfg)
        name = cfg["subspace"]["name"]
        check_pins(run_dir, json.loads(st["pins"]), cfg, "federated", store.digest(name) if store.exists(name) else None)
    return state


def _run_federated(cfg: RecipeConfig, run_dir: Path, resume: bool, callbacks: Sequence[Callback]) -> dict[str, Any]:
    fc = cfg.federated
    run_dir.mkdir(parents=True, exist_ok=True)
    state = _start_state(run_dir, resume, cfg)  # a refused directory costs no compute
    if not subspace_store_for(cfg).exists(cfg["subspace"]["name"]):
        bptt_stage(cfg, run_dir / "bptt", resume=resume)  # the subspace the clients download once
    write_config(cfg, run_dir / "config.yaml")
    atomic_write_json(run_dir / "federated.json", fc.to_dict())
    train = _dataset(cfg, "train")
    splits = B.dirichlet_split(_targets(train), fc.clients, fc.alpha, seed=int(cfg["seed"]))
    n_total = int(sum(len(s) for s in splits))
    task = _Task(cfg, fc.space)
    test_loader = make_loader(_dataset(cfg, "test"), cfg["data"]["test_batch_size"], shuffle=False)
    sinks = metric_sinks(cfg, run_dir)
    for sink in sinks:
        sink.on_train_start(epoch=state.rounds_done if state else 0, step=0, resumed=state is not None)
    server = BaffleServer(cfg, task, n_total, run_dir, test_loader, state, sinks, callbacks)
    if state is not None:
        print(f"resuming {run_dir} after round {state.rounds_done} of {fc.rounds}", flush=True)
    if server.state.rounds_done < fc.rounds:
        try:
            _serve(server, splits, fc.rounds - server.state.rounds_done)
        except TrainingDiverged as e:
            atomic_write_json(run_dir / "results.json", {**_summary(cfg, server, splits), "status": "diverged",
                                                         "error": str(e)})
            raise
    for sink in sinks:
        sink.on_train_end({})
    if server.state.rounds_done != fc.rounds:
        raise RuntimeError(f"the federation stopped after {server.state.rounds_done} of {fc.rounds} rounds; "
                           "see the Flower log above")
    summary = _summary(cfg, server, splits)
    atomic_write_json(run_dir / "results.json", summary)
    return summary


def _serve(server: BaffleServer, splits: Sequence[np.ndarray], rounds: int) -> None:
    """Start the client processes and Flower's server for ``rounds`` rounds on loopback."""
    fc = server.fc
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        for c in range(fc.clients):  # one OS process per client (its key pair is drawn there), spec on stdin
            p = subprocess.Popen([sys.executable, "-m", "szo.federated.flower"], stdin=subprocess.PIPE, env=env)
            spec = {"cfg": server.cfg.to_dict(), "federated": fc.to_dict(), "cid": c, "indices": splits[c].tolist(),
                    "address": address}
            p.stdin.write(json.dumps(spec).encode())
            p.stdin.close()
            procs.append(p)
        strategy = _make_strategy(server, fl, lambda cm: _wait_for_clients(cm, procs, fc.startup_timeout_s))
        fl.server.start_server(server_address=address, strategy=strategy,
                               config=fl.server.ServerConfig(num_rounds=rounds, round_timeout=fc.round_timeout_s))
    except BaseException:
        for p in procs:  # the server stops: its clients have nothing left to wait for
            if p.poll() is None:
                p.terminate()
        raise
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(timeout=10)


class FederationError(RankFailure):
    """A federation that cannot go on (a client process gone, clients not connecting in time):
    one line and exit status 3, like a lost torchrun peer (rerun with --resume)."""


def _wait_for_clients(client_manager: Any, procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """Every client connected, or one line within ``timeout_s`` -- at once when a client process
    has exited (it will never connect; Flower alone would wait out the round timeout)."""
    deadline = time.monotonic() + timeout_s
    while client_manager.num_available() < len(procs):
        for c, p in enumerate(procs):
            if p.poll() is not None:
                for q in procs:  # the others would wait for a federation that will not happen
                    if q.poll() is None:
                        q.terminate()
                raise FederationError(f"client {c} exited with status {p.returncode} before the round started (see its "
                                      f"output above); the federation needs all {len(procs)} clients")
        if time.monotonic() > deadline:
            raise FederationError(f"only {client_manager.num_available()} of {len(procs)} clients connected within "
                                  f"federated.startup_timeout_s = {timeout_s:g} s")
        time.sleep(0.1)


def _summary(cfg: RecipeConfig, server: BaffleServer, splits: Sequence[np.ndarray]) -> dict[str, Any]:
    fc, st, task = cfg.federated, server.state, server.task
    accs = [r["test_acc"] for r in st.history if "test_acc" in r]
    setup_bytes = 4 * (task.reference.numel() + (task.basis.numel() if task.basis is not None else 0))
    return {
        "method": "baffle", "recipe": cfg["name"], "space": fc.space, "clients": fc.clients, "rounds": fc.rounds,
        "K": fc.K, "d": int(task.reference.numel()), "dim": task.dim, "secure": fc.secure, "alpha": fc.alpha,
        "client_sizes": [len(s) for s in splits],
        "best_test_acc": max(accs), "final_test_acc": accs[-1], "fp": st.fp, "bp": 0,
        "fp_per_round": 2 * fc.K * fc.clients,
        "bytes_down_per_round": float(np.mean(st.bytes_down)),
        "bytes_up_per_round": float(np.mean(st.bytes_up)),
        "bytes_up_per_client_round": float(np.mean(st.bytes_up)) / fc.clients,
        "bytes_setup_per_client": int(setup_bytes),
        "wall_time_min": st.history[-1]["wall_time_s"] / 60,
        "status": "completed",
    }


if __name__ == "__main__":
    _client_main(json.loads(sys.stdin.read()))
