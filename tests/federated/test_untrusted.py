"""Untrusted clients and an untrusted loopback: the real ``run_federated`` (ServerApp, SecAgg+,
UploadCheck, the run contract) with every client's ``client_main`` in a thread of this process
instead of its own process (the protocol and the checks are the same; no start-up cost).

Each adversary is a Flower client mod (outermost, so it rewrites what ``secaggplus_mod`` sends):
nothing of it lives in the library."""
import json
import socket
import struct
import threading

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.compat.common.parameter import bytes_to_ndarray, ndarray_to_bytes  # noqa: E402

import szo.federated.flower as F  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny digits recipe with its subspace stored (the BPTT stage)."""
    from szo.config import load_recipe
    from szo.stages import bptt_stage

    root = tmp_path_factory.mktemp("untrusted")
    sets = ["progress=false", "model.kwargs={width: 2}", "model.T=2", "bptt.epochs=1", "bptt.max_steps_per_epoch=4",
            "trajectory.every=1", "subspace.k=2", f"subspace.root={root / 'store'}", "federated.K=2",
            "federated.eval_every=1", "federated.batch_size=16", "data.test_batch_size=360"]
    bptt_stage(load_recipe("digits-scratch", sets), root / "bptt")
    return sets


_ONE_AT_A_TIME = threading.Lock()


def _serial(msg, context, call_next):
    """Clients in threads answer one message at a time: a probe's module check (szo.zo.ProbeGuard)
    sees every forward of the process, so two clients' forwards must not overlap."""
    with _ONE_AT_A_TIME:
        return call_next(msg, context)


class _ThreadClient:
    """Stands in for ``subprocess.Popen([python, -m, szo.federated.flower])``: the spec written to
    its stdin starts ``client_main(spec, [_serial, *mods])`` in a thread; ``before(spec)`` runs first."""

    def __init__(self, mods, before=None):
        self.mods, self.before, self.thread, self.returncode = mods, before, None, None
        self.stdin = self
        self._data = b""

    def write(self, data):
        self._data += data

    def close(self):
        spec = json.loads(self._data)
        if self.before is not None:
            self.before(spec)
        self.thread = threading.Thread(target=F.client_main, args=(spec, [_serial, *self.mods.get(spec["cid"], [])]),
                                       daemon=True)
        self.thread.start()

    def poll(self):
        return None if self.thread is None or self.thread.is_alive() else 0

    def wait(self, timeout=None):
        self.thread.join(timeout)
        return 0

    def terminate(self):
        pass  # the grid closing its connection ends the thread


def _run(tiny, tmp_path, monkeypatch, sets=(), mods=None, before=None):
    from szo.cli import main

    monkeypatch.setattr(F.subprocess, "Popen", lambda cmd, **kw: _ThreadClient(mods or {}, before))
    out = tmp_path / "run"
    rc = main(["federated", "digits-scratch", *[a for s in [*tiny, *sets] for a in ("--set", s)], "--out", str(out)])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    res = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return rc, rows, res


def _tamper(rnd, change):
    """A mod that replaces this client's masked vector in Flower round ``rnd`` with ``change(words, store)``
    (``store``: what it kept from earlier rounds)."""
    store = {}

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        cfg = reply.content.config_records.get(RECORD_KEY_CONFIGS) if reply.has_content() else None
        if cfg is None or Key.MASKED_PARAMETERS not in cfg:
            return reply
        words = list(cfg[Key.MASKED_PARAMETERS])
        store.setdefault(msg.metadata.group_id, words)
        if msg.metadata.group_id == str(rnd):
            cfg[Key.MASKED_PARAMETERS] = change(words, store)
        return reply

    return mod


def _vector(words, f):
    return [words[0], ndarray_to_bytes(f(bytes_to_ndarray(words[1])))]


def _nan(v):
    v = v.astype(np.float64)
    v[0] = np.nan
    return v


def test_malformed_and_replayed_uploads_drop_their_sender_and_the_round_goes_on(tiny, tmp_path, monkeypatch, capsys):
    """Seven clients, four of them hostile: in round 1 client 3's masked vector is one value short and
    client 4's has a single value; in round 2 client 5's holds a NaN (a float array) and client 6
    replays its round-1 masked vector. Each is refused before aggregation and its sender dropped in
    one line; every round aggregates the others (its check value holds: the masks cancelled), and
    the run completes. Before the checks: a numpy broadcast error, a TypeError inside Flower, or a
    server stepping on noise and saying "completed"."""
    mods = {3: [_tamper(1, lambda w, s: _vector(w, lambda v: v[:-1]))],
            4: [_tamper(1, lambda w, s: _vector(w, lambda v: v[:1]))],
            5: [_tamper(2, lambda w, s: _vector(w, _nan))],
            6: [_tamper(2, lambda w, s: s["1"])]}
    rc, rows, res = _run(tiny, tmp_path, monkeypatch, ["federated.clients=7", "federated.rounds=3",
                                                       "federated.secagg_threshold=0.5"], mods)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [r["clients"] for r in rows] == [[0, 1, 2, 5, 6], [0, 1, 2], [0, 1, 2]]
    assert [r.get("dropped") for r in rows] == [[3, 4], [5, 6], None]
    assert not any("refused" in r for r in rows), rows
    assert res["status"] == "completed" and res["rounds_aggregated"] == 3 and res["clients_dropped"] == [3, 4, 5, 6]
    lines = [ln for ln in err.splitlines() if "dropped:" in ln]
    assert len(lines) == 4
    # 11 values: K = 2 loss differences, 8 BN statistics (width 2), the check value
    assert "client 3 dropped: a masked vector of shape (10,), expected (11,)" in err
    assert "client 4 dropped: a masked vector of shape (1,), expected (11,)" in err
    assert "client 5 dropped: a masked vector of dtype float64, not integer words" in err
    assert "client 6 dropped: its masked vector repeats one received before (a replay" in err
    assert "Traceback" not in err
    assert all(np.isfinite(r["test_loss"]) for r in rows)


def test_a_malformed_key_stage_reply_costs_its_sender_not_the_server(tiny, tmp_path, monkeypatch, capsys):
    """Client 3 answers round 1's SecAgg+ setup with a string for its second public key (Flower's
    workflow indexes the keys unchecked: a traceback of the server before). It is dropped in one
    line; Flower 1.42 cannot unmask around a client gone before key sharing (the others print its
    KeyError for the missing shares), so round 1 makes no step; round 2 aggregates the three others."""
    def bad_key(msg, context, call_next):
        reply = call_next(msg, context)
        cfg = reply.content.config_records.get(RECORD_KEY_CONFIGS) if reply.has_content() else None
        if msg.metadata.group_id == "1" and cfg is not None and Key.PUBLIC_KEY_2 in cfg:
            cfg[Key.PUBLIC_KEY_2] = "not a key"
        return reply

    rc, rows, res = _run(tiny, tmp_path, monkeypatch, ["federated.clients=4", "federated.rounds=2"], {3: [bad_key]})
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "client 3 dropped: a setup reply whose 'pk2' is str, not bytes" in err
    assert rows[0].get("dropped") == [3] and "refused" in rows[0]
    assert rows[1]["clients"] == [0, 1, 2] and "refused" not in rows[1] and res["rounds_aggregated"] == 1


def _plain(rnd, change):
    """A mod that rewrites this client's plain (--no-secure) FitRes in Flower round ``rnd``: ``change(fitres)``."""
    from flwr.app import Message
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitres

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.group_id != str(rnd) or not reply.has_content():
            return reply
        res = recorddict_to_fitres(reply.content, keep_input=True)
        change(res)
        return Message(fitres_to_recorddict(res, keep_input=True), reply_to=msg)

    return mod


def test_plain_uploads_are_checked_too(tiny, tmp_path, monkeypatch, capsys):
    """Without SecAgg+ the server sees each upload: client 1's with a NaN (round 1) and client 2's
    answering round 2 with its round-1 upload (stale) are refused, their senders dropped, the
    others aggregated."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

    def nan(res):
        v = parameters_to_ndarrays(res.parameters)[0]
        res.parameters = ndarrays_to_parameters([_nan(v)])

    kept = {}

    def stale(res):
        if res.metrics["round"] == 1:
            kept["res"] = (res.parameters, dict(res.metrics))
        else:
            res.parameters, res.metrics = kept["res"]

    mods = {1: [_plain(1, nan)], 2: [_plain(1, stale), _plain(2, stale)]}
    rc, rows, res = _run(tiny, tmp_path, monkeypatch, ["federated.clients=4", "federated.rounds=3",
                                                       "federated.secure=false"], mods)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [r["clients"] for r in rows] == [[0, 2, 3], [0, 3], [0, 3]]
    assert [r.get("dropped") for r in rows] == [[1], [2], None] and not any("refused" in r for r in rows)
    assert "client 1 dropped: an upload with non-finite values" in err
    assert "client 2 dropped: its upload is for round 1, not round 2 (stale)" in err
    assert res["aggregation"] == "plain" and res["rounds_aggregated"] == 3


def test_an_impostor_saying_hello_as_client_0_is_refused(tiny, tmp_path, monkeypatch, capsys):
    """A local process connects first and says hello as client 0, once without a key and once with
    the key of another run: both are refused in one line each, the real client 0 gets in, and
    every round aggregates all three clients (before: the impostor was admitted, client 0 turned
    away, every round stalled for round_timeout_s and the run exited 0)."""
    from szo.federated.grid import LoopbackGrid

    other_run = LoopbackGrid()
    other_run.close()

    def impostor(spec):
        if spec["cid"] != 0:
            return
        host, port = spec["address"].rsplit(":", 1)
        for hello in ({"cid": 0}, {"cid": 0, "mac": other_run.client_key(0)}):
            with socket.create_connection((host, int(port))) as s:
                s.settimeout(30)
                (n,) = struct.unpack("!Q", s.recv(8))
                json.loads(s.recv(n))  # the challenge
                data = json.dumps(hello).encode()
                s.sendall(struct.pack("!Q", len(data)) + data)
                assert s.recv(8) == b""  # the grid closes the connection

    rc, rows, res = _run(tiny, tmp_path, monkeypatch, ["federated.clients=3", "federated.rounds=2"], before=impostor)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.count("refused a peer that said hello as client 0 without its key") == 2
    assert [r["clients"] for r in rows] == [[0, 1, 2], [0, 1, 2]] and res["status"] == "completed"


def test_a_run_that_aggregated_no_round_fails(tiny, tmp_path, monkeypatch, capsys):
    """clip_range 0.0001: every client sits every round out (one line each, no traceback), no round
    aggregates: exit 2 with one error line, results.json says failed (it said completed, exit 0)."""
    rc, rows, res = _run(tiny, tmp_path, monkeypatch, ["federated.clients=3", "federated.rounds=2",
                                                       "federated.clip_range=0.0001"])
    err = capsys.readouterr().err
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: no round of 2 aggregated (round 1: ") and "raise federated.clip_range" in last
    assert "Traceback" not in err and "federated.clip_range = 0.0001; it sends nothing this round" in err
    assert [r.get("refused") is not None for r in rows] == [True, True]
    assert res["status"] == "failed" and res["rounds_aggregated"] == 0


def test_secure_aggregation_refuses_two_clients(tmp_path, capsys):
    """With two clients each recovers the other's upload from the model it gets back: refused before
    any compute, in one line that names the way out."""
    from szo.cli import main

    rc = main(["federated", "digits-scratch", "--clients", "2", "--set", f"subspace.root={tmp_path / 'store'}",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: secure aggregation (SecAgg+) needs at least 3 clients, got 2") and \
        "--no-secure" in err[0]
    assert not (tmp_path / "store").exists()


def test_a_billion_rounds_allocate_no_seed_table(tiny, tmp_path):
    """rounds = 10**9: the server draws its round seeds as the rounds come (it allocated a 7.45 GiB
    table before round 1), and they are the numbers the table held."""
    import tracemalloc

    from szo.config import load_recipe
    from szo.data import make_loader
    from szo.federated.server import BaffleServer
    from szo.federated.task import FederatedTask, task_dataset

    cfg = load_recipe("digits-scratch", [*tiny, "federated.clients=3", "federated.rounds=1000000000"])
    task = FederatedTask(cfg, "subspace")
    test = make_loader(task_dataset(cfg, "test"), 360, shuffle=False)
    tracemalloc.start()
    server = BaffleServer(cfg, task, 300, tmp_path / "run", test, None, [], [])
    seeds = [server.seeds[r] for r in (0, 1, 2, 5000)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20, peak
    table = np.random.default_rng(int(cfg["seed"])).integers(1, 2 ** 31 - 1, size=5001)  # what it allocated
    assert seeds == [int(table[r]) for r in (0, 1, 2, 5000)]
