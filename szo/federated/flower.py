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
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from szo.build import subspace_store_for
from szo.config import FEDERATED_SPACES, FederatedConfig, RecipeConfig, resolve, write_config
from szo.data import make_loader
from szo.federated import baffle as B
from szo.federated.server import (
    MIN_SECURE_CLIENTS,
    BaffleServer,
    FederationError,
    FederationFailed,
    ServerState,
    UploadCheck,
    server_app,
)
from szo.federated.task import FederatedTask, dataset_targets, task_dataset
from szo.io import atomic_write_json
from szo.rundir import check_pins
from szo.stages import bptt_source, bptt_stage, metric_sinks, run_dir_guard
from szo.train import (
    Callback,
    TrainingDiverged,
    checkpoint_from_bytes,
    checkpoint_path,
    read_checkpoint_bytes,
)

try:  # optional (extra "federated"): run_federated says how to install it
    import flwr as fl
    from flwr.app import Context
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp

    from szo.federated.grid import LoopbackGrid, run_server_app, serve_node
except ImportError:  # pragma: no cover - exercised where flwr is missing
    fl = None

__all__ = ["FederatedConfig", "run_federated", "check_federated_settings", "FEDERATED_RUN", "SPACES",
           "MIN_SECURE_CLIENTS", "UploadCheck", "client_app",
           "client_main", "server_app"]

SPACES: tuple[str, ...] = FEDERATED_SPACES


# ----------------------------------------------------------------------------- client
def _make_client(cfg: Mapping[str, Any], fc: FederatedConfig, cid: int, indices: np.ndarray):
    task = FederatedTask(cfg, fc.space)
    ds = task_dataset(cfg, "train")
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
    train = task_dataset(cfg, "train")
    splits = B.dirichlet_split(dataset_targets(train), fc.clients, fc.alpha, seed=int(cfg["seed"]))
    n_total = int(sum(len(s) for s in splits))
    task = FederatedTask(cfg, fc.space)
    test_loader = make_loader(task_dataset(cfg, "test"), cfg["data"]["test_batch_size"], shuffle=False)
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
