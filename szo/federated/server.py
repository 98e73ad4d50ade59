"""The server's side of BAFFLE on Flower (:mod:`szo.federated.flower` runs the federation): its state
between rounds (:class:`ServerState`), the update and bookkeeping (:class:`BaffleServer`), the check of every
upload (:class:`UploadCheck`) and the ``ServerApp`` with SecAgg+ (:func:`server_app`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from szo.config import RecipeConfig
from szo.distributed import RankFailure
from szo.federated import baffle as B
from szo.federated.task import FederatedTask
from szo.rundir import run_pins
from szo.train import (
    DIVERGE_FACTOR,
    Callback,
    MetricsLogger,
    TrainingDiverged,
    checkpoint_path,
    evaluate,
    save_checkpoint,
)
from szo.zo import heavy_ball_

try:  # optional (extra "federated"): run_federated says how to install it
    import flwr as fl
    from flwr.app import Message
    from flwr.app.message_type import MessageType
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.compat.common.parameter import bytes_to_ndarray
    from flwr.compat.common.recorddict_compat import recorddict_to_fitins, recorddict_to_fitres
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import ServerApp

    from szo.federated.grid import LoopbackGrid, cid_of
except ImportError:  # pragma: no cover - exercised where flwr is missing
    fl = None

# the fields of a SecAgg+ key-exchange reply per stage, with their types (Flower indexes them
# unchecked); empty without flwr, so the module (and the CLI that registers it) imports anyway
KEY_FIELDS: dict = {} if fl is None else {
    Stage.SETUP: ((Key.PUBLIC_KEY_1, bytes), (Key.PUBLIC_KEY_2, bytes)),
    Stage.SHARE_KEYS: ((Key.DESTINATION_LIST, int), (Key.CIPHERTEXT_LIST, bytes)),
    Stage.UNMASK: ((Key.NODE_ID_LIST, int), (Key.SHARE_LIST, bytes))}

__all__ = ["ADAM_BETAS", "MIN_SECURE_CLIENTS", "BaffleServer", "FederationError", "FederationFailed", "ServerState",
           "UploadCheck", "server_app"]

ADAM_BETAS = (0.9, 0.99)
"""``server_optimizer: adam``: BAFFLE's experiments (Feng et al. Sec. 4: Adam, betas (0.9, 0.99))."""
MIN_SECURE_CLIENTS = 3
"""Secure aggregation with fewer clients hides nothing: every client gets the next model, from
which the aggregate follows, and with two clients the aggregate minus one's own upload is the
other's (docs/federated.md, privacy per client count). A federation starts with at least this
many, stops when fewer are connected, and a round that fewer answered makes no step."""


class FederationError(RankFailure):
    """A federation that cannot go on (a client process gone, clients not connecting in time):
    one line and exit status 3, like a lost torchrun peer (rerun with --resume)."""


class FederationFailed(ValueError):
    """A federation that ran its rounds without aggregating any (every round refused: e.g. every
    client over ``clip_range``): one line, exit status 2, results.json ``"status": "failed"``."""


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

    def __init__(self, cfg: RecipeConfig, task: FederatedTask, n_total: int, run_dir: Path, test_loader: Any,
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
