"""BAFFLE on Flower's ServerApp / ClientApp, aggregated with SecAgg+, clients in separate processes.

``run_federated(cfg, out_dir, FederatedConfig(...))`` splits the recipe's train set among the
clients (Dirichlet label skew, seeded), starts one process per client (``python -m
szo.federated.flower``, its spec on stdin; each builds the recipe's model, loads the stored
subspace once and serves a Flower ``ClientApp``), and runs a Flower ``ServerApp`` in this process
for ``rounds`` rounds: the legacy ``DefaultWorkflow`` around a :class:`BaffleStrategy`-like
strategy, with Flower's ``SecAggPlusWorkflow`` as its fit workflow (``secaggplus_mod`` on every
ClientApp). Messages travel on loopback sockets (:mod:`szo.federated.grid`: Flower 1.42's own
runtimes need Ray or start a process per message). Each round (batch-level BAFFLE = FedSGD):

* down: the current coordinates ``c`` (``k`` float32; ``d`` with ``space="full"``) and a config
  ``{seed, round}``;
* client: ``K`` central loss differences on one local batch
  (:func:`szo.federated.baffle.loss_differences`) and its BN batch statistics (averaged over its
  ``2K`` probes), then the check value (:func:`szo.federated.baffle.check_value`), one float64
  vector, its weight ``N_c`` (examples it holds);
* SecAgg+ (Bell et al. 2020, Flower's implementation): per round, setup (two key pairs per
  client), key sharing (Shamir shares of the mask seed and of a secret key, encrypted to each
  other client), masked upload (the vector times ``N_c / N``, clipped to ``clip_range`` and
  quantized, plus a private mask and pairwise masks, modulo 2**32), unmasking (shares of the
  answering clients' seeds and of the dropped clients' keys). The server learns only the
  weighted mean over the clients that answered, ``sum_c N_c v_c / sum_c N_c``: no single
  client's loss differences or BN statistics. A client that drops out after key sharing is
  recovered from the others' shares while at least ``secagg_threshold`` of them answer;
* server: regenerates the directions from the seed, Stein's estimate, heavy-ball step on ``c``;
  BN running statistics move by ``bn_momentum`` toward the aggregated mean.

Clients and the loopback are not trusted: a client process proves it holds its per-run key
before it becomes a node (:mod:`szo.federated.grid`); every upload passes :class:`UploadCheck`
(length, dtype, finiteness or field range, replay, stated weight / client / round) before it is
aggregated, and a refused one drops its sender in one line; the aggregate's check value must come
back or the round makes no step. Under SecAgg+ a federation needs :data:`MIN_SECURE_CLIENTS`
clients. A run in which no round aggregated fails (:class:`FederationFailed`).

Bytes per round are the serialized Flower ``Message`` protobufs of all four SecAgg+ stages (what
the loopback frames carry, without the 8-byte length prefix), summed over clients. The server
evaluates on the test set every ``eval_every`` rounds. Client processes are joined with a timeout
and terminated if they outlive the server.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from szo.build import build_model, loss_for, subspace_store_for
from szo.config import FEDERATED_SPACES, FederatedConfig, RecipeConfig, resolve, write_config
from szo.data import get_dataset, make_loader
from szo.distributed import RankFailure
from szo.federated import baffle as B
from szo.io import atomic_write_json
from szo.rundir import check_pins, run_pins
from szo.stages import bptt_source, bptt_stage, metric_sinks, run_dir_guard
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
    from flwr.app import Context, Message
    from flwr.app.message_type import MessageType
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.compat.common.parameter import bytes_to_ndarray
    from flwr.compat.common.recorddict_compat import recorddict_to_fitins, recorddict_to_fitres
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import ServerApp

    from szo.federated.grid import LoopbackGrid, cid_of, run_server_app, serve_node
except ImportError:  # pragma: no cover - exercised where flwr is missing
    fl = None

# the fields of a SecAgg+ key-exchange reply per stage, with their types (Flower indexes them
# unchecked); empty without flwr, so the module (and the CLI that registers it) imports anyway
KEY_FIELDS: dict = {} if fl is None else {
    Stage.SETUP: ((Key.PUBLIC_KEY_1, bytes), (Key.PUBLIC_KEY_2, bytes)),
    Stage.SHARE_KEYS: ((Key.DESTINATION_LIST, int), (Key.CIPHERTEXT_LIST, bytes)),
    Stage.UNMASK: ((Key.NODE_ID_LIST, int), (Key.SHARE_LIST, bytes))}

__all__ = ["FederatedConfig", "run_federated", "check_federated_settings", "FEDERATED_RUN", "SPACES", "MIN_SECURE_CLIENTS", "UploadCheck", "client_app",
           "client_main", "server_app"]

SPACES: tuple[str, ...] = FEDERATED_SPACES
ADAM_BETAS = (0.9, 0.99)
"""``server_optimizer: adam``: BAFFLE's experiments (Feng et al. Sec. 4: Adam, betas (0.9, 0.99))."""
MIN_SECURE_CLIENTS = 3
"""Secure aggregation with fewer clients hides nothing: every client gets the next model, from
which the aggregate follows, and with two clients the aggregate minus one's own upload is the
other's (docs/federated.md, privacy per client count). A federation starts with at least this
many, stops when fewer are connected, and a round that fewer answered makes no step."""


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
        """``[mean_1, var_1, mean_2, var_2, ...]`` of the BN layers' running statistics (float32)."""
        if not self.bn:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([torch.cat([m.running_mean, m.running_var]) for m in self.bn]).numpy().astype(np.float32)

    def bn_var_index(self) -> np.ndarray:
        """Where the running variances are in a flat :meth:`bn_stats` vector."""
        out, off = [], 0
        for m in self.bn:
            n = m.running_mean.numel()
            out.append(np.arange(off + n, off + 2 * n))
            off += 2 * n
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

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
    ds = _dataset(cfg, "train")
    xs = torch.stack([ds[int(i)][0] for i in indices])
    ys = torch.tensor([int(ds[int(i)][1]) for i in indices])
    n_local = len(indices)

    class BaffleClient(fl.client.NumPyClient):
        def fit(self, parameters, config):
            seed = int(config["seed"])
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
            upload = np.concatenate([delta.numpy(), task.bn_stats().astype(np.float64), [B.check_value(fc.clip_range)]])
            if not np.all(np.isfinite(upload)):
                raise ValueError(f"client {cid}: a loss difference or BN statistic is not finite; it sends nothing "
                                 "this round")
            if fc.secure:
                big = float(np.abs(upload).max(initial=0.0))
                if big > fc.clip_range:  # SecAgg+ would clip it silently: sit the round out instead
                    raise ValueError(f"client {cid}: |uploaded value| {big:.4g} > federated.clip_range = "
                                     f"{fc.clip_range:g}; it sends nothing this round (raise clip_range)")
                # SecAgg+ rounds stochastically with numpy's global generator right after fit():
                # seeded by round and client, a round's aggregate is reproducible (resume is bit-exact)
                np.random.seed((seed * 1009 + cid) % 2 ** 32)
            return [upload], n_local, {"cid": cid, "round": int(config["round"])}

    return BaffleClient()


def client_app(spec: Mapping[str, Any], mods: Sequence[Callable] = ()) -> Any:
    """Client ``spec["cid"]`` 's Flower ``ClientApp``: a BAFFLE ``NumPyClient`` behind ``mods``
    (outermost first), then ``secaggplus_mod`` when ``federated.secure``."""
    fc = FederatedConfig(**spec["federated"])
    client = _make_client(spec["cfg"], fc, int(spec["cid"]), np.asarray(spec["indices"], dtype=np.int64))

    def client_fn(context: Context):
        return client.to_client()

    return ClientApp(client_fn=client_fn, mods=[*mods, *([secaggplus_mod] if fc.secure else [])])


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """A daemon thread that ends this process once its parent (the server) is no longer its parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="szo-server-watch").start()


def client_main(spec: Mapping[str, Any], mods: Sequence[Callable] = ()) -> None:
    """One client process: serve :func:`client_app` to the server at ``spec["address"]`` until it
    closes the connection. It exits when its server process is gone (killed, crashed)."""
    _exit_with_parent()
    torch.set_num_threads(1)  # many client processes share the cores
    serve_node(spec["address"], int(spec["cid"]), client_app(spec, mods), spec["key"])


# ----------------------------------------------------------------------------- server
@dataclasses.dataclass
class ServerState:
    """What the server keeps between rounds (its checkpoint): coordinates ``c``, heavy-ball
    velocity ``v``, BN running statistics, the metrics history, bytes and forwards so far; with
    ``server_optimizer: adam`` Adam's state (``torch.optim.Adam.state_dict()``), with ``ema > 0``
    the moving average of ``c`` that is evaluated."""

    c: np.ndarray
    v: np.ndarray
    bn: np.ndarray
    adam: dict[str, Any] | None = None
    ema: np.ndarray | None = None
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
                "bytes_up": self.bytes_up, "fp": self.fp, "wall_time_s": self.wall_time_s, "adam": self.adam,
                "ema": None if self.ema is None else torch.from_numpy(self.ema.copy())}

    @classmethod
    def from_checkpoint(cls, st: Mapping[str, Any], path: Any = "checkpoint") -> "ServerState":
        if st.get("kind") != "federated":
            what = f"a '{st['method']}' training run" if isinstance(st.get("method"), str) else "something else"
            raise ValueError(f"{path} is the checkpoint of {what}, not of a szo federated run: "
                             "choose another --out for the federation")
        return cls(c=st["c"].numpy().copy(), v=st["v"].numpy().copy(), bn=st["bn"].numpy().copy(),
                   history=list(st["history"]), bytes_down=list(st["bytes_down"]), bytes_up=list(st["bytes_up"]),
                   fp=int(st["fp"]), wall_time_s=float(st["wall_time_s"]), adam=st.get("adam"),
                   ema=None if st.get("ema") is None else st["ema"].numpy().copy())


class BaffleServer:
    """The server's side of BAFFLE, whatever carries the messages: the round's config, the
    checks of the aggregate, the update (heavy-ball SGD or Adam, cosine learning rate, optional
    EMA), evaluation, and after every round the run contract's bookkeeping (checkpoint with its
    sha256 record, metrics.jsonl and the other sinks, callbacks)."""

    def __init__(self, cfg: RecipeConfig, task: _Task, n_total: int, run_dir: Path, test_loader: Any,
                 state: ServerState | None, sinks: list[Callback], callbacks: Sequence[Callback]):
        self.cfg, self.fc, self.task, self.n_total, self.run_dir = cfg, cfg.federated, task, n_total, run_dir
        self.test_loader = test_loader
        self.seeds = B.RoundSeeds(int(cfg["seed"]))  # drawn as the rounds come (no table sized by fc.rounds)
        self.state = state if state is not None else ServerState(
            c=np.zeros(task.dim, dtype=np.float64) if task.basis is not None else task.reference.numpy().copy(),
            v=np.zeros(task.dim, dtype=np.float64), bn=task.bn_stats().astype(np.float64))
        if self.fc.ema > 0 and self.state.ema is None:
            self.state.ema = self.state.c.copy()
        self.adam = None
        if self.fc.server_optimizer == "adam":  # torch's Adam on the coordinates, its state checkpointed
            self._point = torch.nn.Parameter(torch.from_numpy(self.state.c.copy()))
            self.adam = torch.optim.Adam([self._point], lr=self.fc.lr, betas=ADAM_BETAS)
            if self.state.adam is not None:
                self.adam.load_state_dict(self.state.adam)
        self.logger = MetricsLogger(run_dir / "metrics.jsonl")
        self.logger.reset(self.state.history)
        self.sinks, self.callbacks = sinks, list(callbacks)
        self.ckpt_sha: str | None = None
        self.t0 = time.perf_counter()

    def round_config(self, rnd: int) -> dict[str, Any]:
        """What every client gets with the coordinates in round ``rnd`` (1-based, absolute)."""
        return {"round": rnd, "seed": int(self.seeds[rnd])}

    def step(self, rnd: int, mean: np.ndarray | None, clients: Sequence[int], bytes_down: int, bytes_up: int,
             why: str | None = None, weight_sum: float | None = None, dropped: Sequence[int] = ()) -> None:
        """Round ``rnd``: check the aggregate ``mean`` (``[K loss differences, BN statistics, check
        value]``, the weighted mean over the answering ``clients``; None when there is none,
        ``why``) and step.

        Clients are not trusted (every upload passed :class:`UploadCheck` before it was
        aggregated), but under SecAgg+ only the aggregate is visible. If it is malformed, its
        check value is not :func:`~szo.federated.baffle.check_value` (within SecAgg+'s bound: an
        upload was corrupted, forged or replayed), it is not finite or a loss difference is beyond
        ``federated.max_loss_difference``, the round makes no step and its BN statistics are not
        used either (``refused``); aggregated BN statistics that
        are not finite or have a variance below ``-tolerance`` (``weight_sum`` given: SecAgg+'s
        quantization bound) are not used (``dropped_bn``), slightly negative variances within it
        are set to 0. Both are logged in
        the round's metrics and on stderr. A test loss that stops being finite or grows
        ``DIVERGE_FACTOR`` times the first one ends the run with one :class:`TrainingDiverged` line."""
        fc, st, task = self.fc, self.state, self.task
        st.bytes_down.append(bytes_down)
        st.bytes_up.append(bytes_up)
        lr = fc.lr * 0.5 * (1 + math.cos(math.pi * (rnd - 1) / fc.rounds))  # cosine, as the recipes
        row: dict[str, Any] = {"round": rnd, "lr": lr, "clients": sorted(int(c) for c in clients),
                               "bytes_down": bytes_down, "bytes_up": bytes_up}
        if dropped:  # clients whose upload UploadCheck refused this round (gone for the rest of the run)
            row["dropped"] = sorted(int(c) for c in dropped)
        grad, bn = None, None
        K, n_bn = fc.K, st.bn.size
        check = B.check_value(fc.clip_range)
        tol = (1e-9 * check if weight_sum is None else
               B.secagg_error_bound(max(len(clients), 1), fc.clip_range, B.secagg_ranges(max(fc.clients, 2))[0],
                                    weight_sum))
        if mean is not None:
            mean = np.asarray(mean)
            if mean.shape != (K + n_bn + 1,) or mean.dtype.kind != "f":
                why = (f"the aggregate has shape {mean.shape} ({mean.dtype}), expected [{K} loss differences + "
                       f"{n_bn} BN statistics + 1 check value]: a client sent a malformed upload")
            elif not abs(float(mean[-1]) - check) <= tol:
                why = (f"the aggregate's check value is {float(mean[-1]):.6g}, not {check:g} (+-{tol:.2g}): an upload "
                       "was corrupted, forged or replayed (its masks do not cancel)")
            else:
                delta, bn = mean[:K].astype(np.float64), mean[K:-1].astype(np.float64)
                if not np.all(np.isfinite(delta)) or float(np.abs(delta).max(initial=0.0)) > fc.max_loss_difference:
                    why = (f"aggregated loss differences out of range (max |dL| = {float(np.abs(delta).max()):.3g} > "
                           f"federated.max_loss_difference = {fc.max_loss_difference:g}): a client sent bad values")
                else:
                    z = B.round_directions(int(self.seeds[rnd]), K, task.dim)
                    grad = B.stein_coordinates(torch.from_numpy(delta), z, fc.sigma).numpy()
        if grad is not None:
            self._update(grad, lr)
        else:
            row["refused"] = why or "no aggregate"
            print(f"warning: round {rnd}: no step: {row['refused']}", file=sys.stderr, flush=True)
        if n_bn and grad is not None:  # a refused aggregate moves nothing, BN statistics included
            tol = 0.0 if weight_sum is None else tol
            var = task.bn_var_index()
            if np.all(np.isfinite(bn)) and np.all(bn[var] >= -tol):
                bn[var] = np.maximum(bn[var], 0.0)
                st.bn = (1 - fc.bn_momentum) * st.bn + fc.bn_momentum * bn
            else:
                row["dropped_bn"] = "aggregated BN statistics not finite or with a negative variance"
                print(f"warning: round {rnd}: {row['dropped_bn']}: the server's running statistics stay",
                      file=sys.stderr, flush=True)
        st.fp += 2 * fc.K * len(clients)
        wall = st.wall_time_s + time.perf_counter() - self.t0
        row.update(fp=st.fp, wall_time_s=wall)
        if rnd % fc.eval_every == 0 or rnd == fc.rounds:
            row["test_loss"], row["test_acc"] = self.evaluate()
        st.history.append(row)
        self._after_round(rnd, row, wall)
        self._check_divergence(rnd, row)

    def _update(self, grad: np.ndarray, lr: float) -> None:
        """``c`` one step along ``-grad``: heavy ball (``c <- c + v``, ``v <- m v - lr g``) or Adam;
        then the EMA ``e <- ema e + (1 - ema) c`` (BYOL's, as BAFFLE's guideline)."""
        st = self.state
        if self.adam is not None:
            self._point.grad = torch.from_numpy(grad.astype(np.float64))
            self.adam.param_groups[0]["lr"] = lr
            self.adam.step()
            st.c = self._point.detach().numpy().copy()
            st.adam = self.adam.state_dict()
        else:
            heavy_ball_(torch.from_numpy(st.v), torch.from_numpy(grad), lr=lr, momentum=self.fc.momentum)  # in place
            st.c = st.c + st.v
        if st.ema is not None:
            st.ema = self.fc.ema * st.ema + (1 - self.fc.ema) * st.c

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
        """Test loss and accuracy of the coordinates (their EMA when ``federated.ema > 0``)."""
        c = self.state.ema if self.state.ema is not None else self.state.c
        self.task.model.load_flat_params(self.task.theta(c).float())
        self.task.set_bn_stats(self.state.bn.astype(np.float32))
        return evaluate(self.task.model, self.test_loader, self.task.loss_fn)

    def params(self) -> np.ndarray:
        return self.state.c.astype(np.float32)


def _make_strategy(server: BaffleServer, grid: LoopbackGrid) -> Any:
    """A Flower (legacy API) ``Strategy`` around ``server`` for ``DefaultWorkflow``: every
    connected client every round. ``aggregate_fit`` gets what the fit workflow aggregated (with
    SecAgg+: every result carries the same unmasked weighted mean; without: each client's own
    upload, averaged here); ``evaluate`` (called after every round's fit workflow, also when
    SecAgg+ halted and nothing was aggregated) makes the server's step, with the round's bytes
    and dropped clients from ``grid``. Flower's round numbers count from 1 in this process, so
    they are offset by the rounds done before."""
    fc, offset = server.fc, server.state.rounds_done

    class BaffleStrategy(fl.server.strategy.Strategy):
        def __init__(self) -> None:
            self.fitted: dict[int, tuple[np.ndarray | None, list[int], str | None, float]] = {}

        def initialize_parameters(self, client_manager):
            return ndarrays_to_parameters([server.params()])

        def configure_fit(self, server_round, parameters, client_manager):
            proxies = [p for _, p in sorted(client_manager.all().items())]
            need = MIN_SECURE_CLIENTS if fc.secure else 1
            if len(proxies) < need:
                raise FederationError(f"round {offset + server_round}: {len(proxies)} client(s) left, "
                                      f"{f'secure aggregation needs {need}' if fc.secure else 'none left'}; "
                                      "the federation cannot go on")
            ins = FitIns(ndarrays_to_parameters([server.params()]), server.round_config(offset + server_round))
            return [(p, ins) for p in proxies]

        def aggregate_fit(self, server_round, results, failures):
            cids = [cid_of(p.node_id) for p, _ in results]  # the grid's authenticated node, not a claim
            weights = [r.num_examples for _, r in results]
            why = None
            if not results:
                mean = None
                why = f"no client answered ({len(failures)} failures)"
            elif fc.secure and len(results) < MIN_SECURE_CLIENTS:
                mean = None
                why = (f"only {len(results)} clients answered: with fewer than {MIN_SECURE_CLIENTS} the model sent "
                       "back would reveal each one's upload to the other")
            elif fc.secure:  # the workflow put the unmasked aggregate into every result
                mean = parameters_to_ndarrays(results[0][1].parameters)[0]
            else:
                try:
                    mean = B.weighted_mean([parameters_to_ndarrays(r.parameters)[0] for _, r in results], weights)
                except (ValueError, IndexError) as e:
                    mean, why = None, f"the uploads cannot be averaged: {e}"
            self.fitted[server_round] = (mean, cids, why, sum(weights) / server.n_total)
            return None, {}  # the server keeps the coordinates; the next round's FitIns carries them

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            if server_round == 0:  # before the first round
                return None
            mean, cids, why, weight_sum = self.fitted.pop(server_round, (
                None, [], "secure aggregation halted: fewer clients answered than its reconstruction threshold", 0.0))
            down, up = grid.bytes.get(str(server_round), (0, 0))
            dropped = [cid_of(n) for n, g, _ in grid.dropped if g == str(server_round)]
            server.step(offset + server_round, mean, cids, down, up, why=why,
                        weight_sum=weight_sum if fc.secure and weight_sum > 0 else None, dropped=dropped)
            row = server.state.history[-1]
            return (row["test_loss"], {"test_acc": row["test_acc"]}) if "test_loss" in row else None

    return BaffleStrategy()


class UploadCheck:
    """The server's check of every client upload before the workflow aggregates it (the
    :class:`~szo.federated.grid.LoopbackGrid` 's ``screen``): None, or why the upload is refused;
    the grid then drops its sender for the rest of the run (one warning line) and the workflow
    sees a dropout (SecAgg+ rebuilds the sender's pairwise masks from the others' shares).

    Checked, with ``n_values`` the length of a client's vector (K loss differences, BN statistics,
    the check value) and ``sizes[c]`` client ``c`` 's example count (the server made the split):

    * SecAgg+, the masked-vector stage: exactly two integer arrays, the weight factor ``[1]`` and
      the vector ``[n_values]``, every word in ``[0, 2**32)`` (a float, a NaN, a vector one value
      short or one value long is refused before it can be broadcast into the sum); a masked
      vector equal to one received before (from any client, in any round of this process) is a
      replay: fresh masks never repeat;
    * without SecAgg+: one float vector ``[n_values]``, every value finite, the check value exact;
    * both: the example count it states is its own, its metrics name its own client id and the
      round asked for (a reply from another round is stale);
    * SecAgg+'s key stages: the fields the workflow reads, of their types (two public keys; equal
      lists of destinations and ciphertexts; equal lists of node ids and shares), so that a
      malformed reply costs its sender, not the server (Flower indexes them unchecked).

    Error replies pass (they are the workflow's dropouts).
    """

    def __init__(self, n_values: int, sizes: Sequence[int], secure: bool, check: float) -> None:
        self.n_values, self.sizes, self.secure, self.check = int(n_values), [int(n) for n in sizes], secure, check
        self._seen: set[bytes] = set()

    def __call__(self, request: Message, reply: Message) -> str | None:
        if request.metadata.message_type != MessageType.TRAIN:
            return None
        configs = request.content.config_records.get(RECORD_KEY_CONFIGS)
        stage = configs.get(Key.STAGE) if configs is not None else None
        try:
            if self.secure and stage != Stage.COLLECT_MASKED_VECTORS:
                return self._key_stage(stage, reply)
            why = self._masked(reply) if self.secure else self._plain(reply)
            return why or self._stated(request, reply)
        except Exception as e:  # noqa: BLE001 - whatever an untrusted reply makes a parser raise
            return f"a malformed upload ({type(e).__name__}: {e})"

    def _key_stage(self, stage: str | None, reply: Message) -> str | None:
        fields = KEY_FIELDS.get(stage)
        if fields is None:
            return None
        got = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if got is None:
            return f"a {stage} reply without its SecAgg+ record"
        values = []
        for key, kind in fields:
            v = got.get(key)
            ok = isinstance(v, kind) if stage == Stage.SETUP else (
                isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v))
            if not ok:
                return f"a {stage} reply whose {key!r} is {type(v).__name__}, not {'' if stage == Stage.SETUP else 'a list of '}{kind.__name__}"
            values.append(v)
        if stage != Stage.SETUP and len(values[0]) != len(values[1]):
            return f"a {stage} reply with {len(values[0])} {fields[0][0]!r} for {len(values[1])} {fields[1][0]!r}"
        return None

    def _masked(self, reply: Message) -> str | None:
        words = reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
        if not isinstance(words, list) or len(words) != 2:
            return f"a masked upload of {len(words) if isinstance(words, list) else 'no'} arrays, not 2"
        arrays = [bytes_to_ndarray(b) for b in words]
        for a, shape, what in zip(arrays, [(1,), (self.n_values,)], ["weight factor", "vector"]):
            if a.shape != shape:
                return f"a masked {what} of shape {a.shape}, expected {shape}"
            if a.dtype.kind not in "iu":
                return f"a masked {what} of dtype {a.dtype}, not integer words"
            if a.size and (int(a.min()) < 0 or int(a.max()) >= B.MODULUS_RANGE):
                return f"a masked {what} with words outside [0, 2**32)"
        digest = hashlib.sha256(b"".join(words)).digest()
        if digest in self._seen:
            return "its masked vector repeats one received before (a replay: fresh masks never repeat)"
        self._seen.add(digest)
        return None

    def _plain(self, reply: Message) -> str | None:
        arrays = parameters_to_ndarrays(recorddict_to_fitres(reply.content, keep_input=True).parameters)
        if len(arrays) != 1 or arrays[0].shape != (self.n_values,) or arrays[0].dtype.kind != "f":
            got = [f"{a.shape} {a.dtype}" for a in arrays]
            return f"an upload of {got}, expected one float vector of {self.n_values} values"
        v = arrays[0]
        if not np.all(np.isfinite(v)):
            return "an upload with non-finite values"
        if float(v[-1]) != self.check:
            return f"an upload whose check value is {float(v[-1]):.6g}, not {self.check:g}"
        return None

    def _stated(self, request: Message, reply: Message) -> str | None:
        """What the upload states in plain text: its example count, client id and round."""
        res = recorddict_to_fitres(reply.content, keep_input=True)
        cid = cid_of(reply.metadata.src_node_id)
        want = int(recorddict_to_fitins(request.content, keep_input=True).config["round"])
        if not 0 <= cid < len(self.sizes) or res.num_examples != self.sizes[cid]:
            return f"it states {res.num_examples} examples; it holds {self.sizes[cid] if 0 <= cid < len(self.sizes) else '?'}"
        if res.metrics.get("cid") != cid:
            return f"its upload names client {res.metrics.get('cid')!r}"
        if res.metrics.get("round") != want:
            return f"its upload is for round {res.metrics.get('round')!r}, not round {want} (stale)"
        return None


def server_app(server: BaffleServer, rounds: int, grid: LoopbackGrid) -> Any:
    """The federation's Flower ``ServerApp`` on ``grid`` (its bytes and dropped clients go into
    the metrics): ``DefaultWorkflow`` for ``rounds`` rounds around
    :func:`_make_strategy`, with ``SecAggPlusWorkflow`` as its fit workflow when
    ``federated.secure`` (complete key-sharing graph, ``secagg_threshold`` of the clients to
    reconstruct, weights ``N_c / N``, values in ``[-clip_range, clip_range]`` on
    :func:`~szo.federated.baffle.secagg_ranges` levels)."""
    fc = server.fc
    app = ServerApp()

    @app.main()
    def main(driven, context) -> None:  # ``driven``: the Grid Flower hands the app (``grid`` in run_server_app)
        legacy = LegacyContext(context=context, strategy=_make_strategy(server, grid),
                               config=ServerConfig(num_rounds=rounds, round_timeout=fc.round_timeout_s))
        fit = None
        if fc.secure:
            q, m = B.secagg_ranges(fc.clients)
            fit = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=float(fc.secagg_threshold),
                                     max_weight=float(server.n_total), clipping_range=float(fc.clip_range),
                                     quantization_range=q, modulus_range=m, timeout=fc.round_timeout_s)
        DefaultWorkflow(fit_workflow=fit)(driven, legacy)

    return app


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
    check_federated_settings(cfg)
    if fl is None:
        raise ValueError("szo federated runs on Flower: pip install 'szo[federated]' (flwr)")
    if cfg.federated.secure and cfg.federated.clients < MIN_SECURE_CLIENTS:
        raise ValueError(f"secure aggregation (SecAgg+) needs at least {MIN_SECURE_CLIENTS} clients, got "
                         f"{cfg.federated.clients}: with 2 every client can recover the other's upload from the "
                         "model the server sends back (docs/federated.md); raise federated.clients or pass "
                         "--no-secure (the server then sees every upload)")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with run_dir_guard(out_dir, cfg, resume=resume, stage="federated"):
            return _run_federated(cfg, Path(out_dir), resume, callbacks)
    finally:
        torch.set_num_threads(prev)


FEDERATED_RUN = {"precision": ("auto", "fp32"), "device": ("cpu",), "compile": (False,), "cuda_graphs": (False,)}
"""The run settings a federation applies (key -> valid values): its server and clients run fp32 eager
forwards on the CPU (``auto`` is fp32 for forward-only and BPTT training alike, ``szo.precision.AUTO``);
results.json records them. Any other value is refused before anything runs (:func:`check_federated_settings`)."""


def check_federated_settings(cfg: RecipeConfig) -> None:
    """One ValueError for a run setting (precision, device, compile, cuda_graphs) that ``szo federated``
    would not apply: the recipe door applies it, so silently training without it would mean something else."""
    for key, valid in FEDERATED_RUN.items():
        v = cfg[key]
        if v not in valid or isinstance(v, bool) != isinstance(valid[0], bool):
            shown = " | ".join(str(x).lower() if isinstance(x, bool) else str(x) for x in valid)
            raise ValueError(f"{key} {v!r} is not applied by szo federated: its server and {cfg.federated.clients} "
                             f"client processes run fp32 eager forwards on the CPU; valid here: {key} {shown} "
                             "(train with it through szo recipe instead)")


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
        bptt_stage(bptt_source(cfg), run_dir / "bptt", resume=resume)  # the subspace the clients download once
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
    if summary["rounds_aggregated"] == 0:  # nothing was trained: a failure, whatever else went right
        first = next(r["refused"] for r in server.state.history if "refused" in r)
        e = FederationFailed(f"no round of {fc.rounds} aggregated (round 1: {first}); nothing was trained: see the "
                             "warnings above" + ("; raise federated.clip_range if the clients sat out for it"
                                                 if fc.secure else ""))
        atomic_write_json(run_dir / "results.json", {**summary, "status": "failed", "error": str(e)})
        raise e
    atomic_write_json(run_dir / "results.json", summary)
    return summary


def _serve(server: BaffleServer, splits: Sequence[np.ndarray], rounds: int) -> None:
    """Start the client processes and run the ServerApp for ``rounds`` rounds on loopback."""
    fc = server.fc
    grid = LoopbackGrid(screen=UploadCheck(fc.K + server.state.bn.size + 1, [len(s) for s in splits], fc.secure,
                                           B.check_value(fc.clip_range)))
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

    def check_started() -> None:  # a client process that exited will never connect
        for c, p in enumerate(procs):
            if p.poll() is not None:
                raise FederationError(f"client {c} exited with status {p.returncode} before the round started (see "
                                      f"its output above); the federation needs all {len(procs)} clients")

    try:
        for c in range(fc.clients):  # one OS process per client (its SecAgg+ keys are drawn there), spec on stdin
            p = subprocess.Popen([sys.executable, "-m", "szo.federated.flower"], stdin=subprocess.PIPE, env=env)
            spec = {"cfg": server.cfg.to_dict(), "federated": fc.to_dict(), "cid": c, "indices": splits[c].tolist(),
                    "address": grid.address, "key": grid.client_key(c)}  # on stdin: no other process sees the key
            p.stdin.write(json.dumps(spec).encode())
            p.stdin.close()
            procs.append(p)
        try:
            grid.wait_for_nodes(fc.clients, fc.startup_timeout_s, check_started)
        except TimeoutError as e:
            raise FederationError(f"{e} (federated.startup_timeout_s)") from None
        run_server_app(server_app(server, rounds, grid), grid)
    except BaseException:
        for p in procs:  # the server stops: its clients have nothing left to wait for
            if p.poll() is None:
                p.terminate()
        raise
    finally:
        grid.close()  # the clients see their connection close and stop
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(timeout=10)


class FederationError(RankFailure):
    """A federation that cannot go on (a client process gone, clients not connecting in time):
    one line and exit status 3, like a lost torchrun peer (rerun with --resume)."""


class FederationFailed(ValueError):
    """A federation that ran its rounds without aggregating any (every round refused: e.g. every
    client over ``clip_range``): one line, exit status 2, results.json ``"status": "failed"``."""


def _summary(cfg: RecipeConfig, server: BaffleServer, splits: Sequence[np.ndarray]) -> dict[str, Any]:
    fc, st, task = cfg.federated, server.state, server.task
    accs = [r["test_acc"] for r in st.history if "test_acc" in r]
    setup_bytes = 4 * (task.reference.numel() + (task.basis.numel() if task.basis is not None else 0))
    return {
        "method": "baffle", "recipe": cfg["name"], "space": fc.space, "clients": fc.clients, "rounds": fc.rounds,
        "K": fc.K, "d": int(task.reference.numel()), "dim": task.dim, "secure": fc.secure, "alpha": fc.alpha,
        "aggregation": "secagg+" if fc.secure else "plain",
        "client_sizes": [len(s) for s in splits],
        "best_test_acc": max(accs), "final_test_acc": accs[-1], "fp": st.fp, "bp": 0,
        "rounds_aggregated": sum("refused" not in r for r in st.history),
        "rounds_refused": sum("refused" in r for r in st.history),
        "clients_dropped": sorted({c for r in st.history for c in r.get("dropped", [])}),
        "fp_per_round": 2 * fc.K * fc.clients,
        "bytes_down_per_round": float(np.mean(st.bytes_down)),
        "bytes_up_per_round": float(np.mean(st.bytes_up)),
        "bytes_up_per_client_round": float(np.mean(st.bytes_up)) / fc.clients,
        "bytes_setup_per_client": int(setup_bytes),
        "wall_time_min": st.history[-1]["wall_time_s"] / 60,
        # what it ran in (FEDERATED_RUN: the only settings it applies)
        "precision": {"requested": cfg.precision, "effective": "fp32"}, "device": "cpu",
        "compile": False, "cuda_graphs": False,
        "status": "completed",
    }


if __name__ == "__main__":
    client_main(json.loads(sys.stdin.read()))
