"""BAFFLE on Flower end to end: a ServerApp with SecAgg+ and client processes over loopback (slow: process start-up)."""
import json

import pytest

pytestmark = pytest.mark.slow  # a Flower server and client processes

pytest.importorskip("flwr")


def test_three_client_processes_two_rounds_over_loopback(tmp_path):
    import torch

    from szo.config import load_recipe
    from szo.federated.flower import FederatedConfig, run_federated

    threads = torch.get_num_threads()

    cfg = load_recipe("digits-scratch", ["progress=false", "model.kwargs={width: 4}", "bptt.epochs=1",
                                         "subspace.k=2", f"subspace.root={tmp_path / 'store'}"])
    fc = FederatedConfig(clients=3, rounds=2, K=3, eval_every=1, batch_size=16)
    s = run_federated(cfg, tmp_path / "run", fc)
    # the server ran with one thread but gave the caller's back (it used to leave 1 set, which
    # made a later in-process float32 reference differ from 2-thread worker processes)
    assert torch.get_num_threads() == threads
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all("test_acc" in r for r in rows)
    assert s["fp"] == 2 * 3 * 3 * 2 and s["bp"] == 0 and s["dim"] == 2
    assert sum(s["client_sizes"]) == 1437  # the digits train split, partitioned
    assert s["aggregation"] == "secagg+" and all(r["clients"] == [0, 1, 2] for r in rows)
    assert s["rounds_aggregated"] == 2 and s["rounds_refused"] == 0 and s["clients_dropped"] == []
    # four SecAgg+ stages per round: keys, encrypted shares, the masked [K=3 + 16 BN statistics + check], shares
    assert 0 < s["bytes_down_per_round"] < 3 * 7000 and 0 < s["bytes_up_per_client_round"] < 7000
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["rounds"] == 2
    # what it ran in: the only run settings a federation applies (the recipe's precision auto is fp32 here)
    assert (res["precision"], res["device"], res["compile"], res["cuda_graphs"]) == \
        ({"requested": "auto", "effective": "fp32"}, "cpu", False, False)


def test_killed_federation_resumes_bit_exactly(tmp_path):
    """szo federated ... --out D, the server SIGKILLed right after round 2 (tests/fault_launcher.py),
    then --resume: the same coordinates, BN statistics and metrics as the uninterrupted 3 rounds."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from szo.cli import main
    from szo.config import load_recipe
    from szo.federated.flower import run_federated

    root = Path(__file__).resolve().parents[2]
    sets = ["progress=false", "model.kwargs={width: 4}", "bptt.epochs=1", "subspace.k=2",
            f"subspace.root={tmp_path / 'store'}", "federated.clients=3", "federated.rounds=3", "federated.K=2",
            "federated.batch_size=16", "federated.eval_every=1"]
    ref = run_federated(load_recipe("digits-scratch", sets), tmp_path / "ref")
    args = ["federated", "digits-scratch", *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path / "run")]
    p = subprocess.run([sys.executable, "-m", "tests.fault_launcher", "0:2", *args], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == -9, p.stderr  # killed right after round 2's checkpoint
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert len(ck["history"]) == 2
    assert main(args) == 2  # a directory with a checkpoint is not silently restarted
    assert main(args + ["--resume"]) == 0
    got = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    want = torch.load(tmp_path / "ref" / "checkpoints" / "last.pt", weights_only=True)
    assert torch.equal(got["c"], want["c"]) and torch.equal(got["bn"], want["bn"]) and torch.equal(got["v"], want["v"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    refs = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["test_acc"], r["fp"]) for r in rows] == [(r["round"], r["test_acc"], r["fp"]) for r in refs]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "completed" and res["final_test_acc"] == ref["final_test_acc"]


def test_federation_refuses_a_recipe_run_directory(tmp_path, capsys):
    """szo federated --out D on a directory holding another run's checkpoint: one line, before any
    compute, with or without --resume; the directory's files are left as they were."""
    import torch

    from szo.cli import main
    from szo.train.checkpoint import checkpoint_path, save_checkpoint

    run = tmp_path / "recipe-run"
    save_checkpoint(checkpoint_path(run), {"method": "szo-cge", "model": {"w": torch.zeros(2)}})
    (run / "results.json").write_text('{"status": "completed"}')
    def files():  # .lock: the run contract's lock file, empty when nobody holds it
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    args = ["federated", "digits-scratch", "--set", f"subspace.root={tmp_path / 'store'}", "--out", str(run)]
    assert main(args) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "a 'szo-cge' training run, not of a szo federated run" in err[-1]
    assert "Traceback" not in "".join(err)
    assert files() == before
    assert not (tmp_path / "store").exists()  # no BPTT stage ran


@pytest.fixture(scope="module")
def tiny_fed(tmp_path_factory):
    """A tiny digits recipe with its subspace stored (the BPTT stage), for server-side tests."""
    from szo.config import load_recipe
    from szo.stages import bptt_stage

    root = tmp_path_factory.mktemp("fed")
    sets = ["progress=false", "model.kwargs={width: 2}", "model.T=2", "bptt.epochs=1", "bptt.max_steps_per_epoch=4",
            "trajectory.every=1", "subspace.k=2", f"subspace.root={root / 'store'}", "federated.clients=3",
            "federated.rounds=3", "federated.K=2", "federated.eval_every=1", "data.test_batch_size=360"]
    cfg = load_recipe("digits-scratch", sets)
    bptt_stage(cfg, root / "bptt")
    return root, cfg, sets


def _server(tiny_fed, tmp_path):
    from szo.data import make_loader
    from szo.federated.server import BaffleServer
    from szo.federated.task import FederatedTask, task_dataset

    _, cfg, _ = tiny_fed
    task = FederatedTask(cfg, "subspace")
    test = make_loader(task_dataset(cfg, "test"), 360, shuffle=False)
    return BaffleServer(cfg, task, 300, tmp_path / "run", test, None, [], []), task


def _mean(task, K=2, value=0.01, check=8.0):
    """An aggregate: K loss differences, the BN statistics, the check value (clip_range 16 / 2)."""
    import numpy as np

    return np.concatenate([np.full(K, value), task.bn_stats().astype(np.float64), [check]])


def test_server_checks_the_aggregate_it_cannot_trust(tiny_fed, tmp_path, capsys):
    """Clients are not trusted, and the server sees only their aggregate: NaN BN statistics in it
    are not used (the server's stay), a loss difference beyond max_loss_difference or a malformed
    aggregate makes the round step-less, no aggregate at all too (SecAgg+ halted); every case is
    in the round's metrics and on stderr."""
    import numpy as np

    server, task = _server(tiny_fed, tmp_path)
    bn0 = server.state.bn.copy()
    bad_bn = _mean(task)
    bad_bn[2:-1] = np.nan
    server.step(1, bad_bn, [0, 1, 2], 10, 10)
    row = server.state.history[-1]
    assert "dropped_bn" in row and "refused" not in row and np.array_equal(server.state.bn, bn0)
    assert not np.array_equal(server.state.c, np.zeros_like(server.state.c))  # the step was taken
    c1 = server.state.c.copy()
    bn1 = server.state.bn.copy()
    server.step(2, _mean(task, value=5e3), [0, 1, 2], 10, 10)
    assert "aggregated loss differences out of range" in server.state.history[-1]["refused"]
    np.testing.assert_array_equal(server.state.c, c1)  # no step at all this round
    np.testing.assert_array_equal(server.state.bn, bn1)  # nor a BN update from a suspect aggregate
    server.step(3, np.zeros(5), [0, 1, 2], 10, 10)
    assert "a client sent a malformed upload" in server.state.history[-1]["refused"]
    np.testing.assert_array_equal(server.state.c, c1)
    # masks that did not cancel (a replayed or forged upload UploadCheck could not see): the check value is noise
    server.step(3, _mean(task, check=8.0 + 1e-3), [0, 1, 2], 10, 10, weight_sum=1.0)
    assert "the aggregate's check value is 8.001, not 8" in server.state.history[-1]["refused"]
    np.testing.assert_array_equal(server.state.c, c1)
    assert np.isfinite(server.state.history[-1]["test_loss"]) and np.all(np.isfinite(server.state.bn))
    err = capsys.readouterr().err
    assert "BN statistics not finite" in err and "round 2: no step" in err


def test_server_clamps_variances_within_the_quantization_bound(tiny_fed, tmp_path):
    """SecAgg+ may put a zero variance a little below 0 (quantization); within the stated bound
    it is used as 0, beyond it the aggregate's BN statistics are not used."""

    from szo.federated import baffle as B

    server, task = _server(tiny_fed, tmp_path)
    var = task.bn_var_index()
    bound = B.secagg_error_bound(3, server.fc.clip_range, B.secagg_ranges(3)[0], 1.0)
    m = _mean(task)
    m[2 + var[0]] = -0.5 * bound
    server.step(1, m, [0, 1, 2], 1, 1, weight_sum=1.0)
    assert "dropped_bn" not in server.state.history[-1] and server.state.bn[var].min() >= 0
    m[2 + var[0]] = -2 * bound
    server.step(2, m, [0, 1, 2], 1, 1, weight_sum=1.0)
    assert "dropped_bn" in server.state.history[-1]


def test_server_stops_a_diverging_federation_in_one_line(tiny_fed, tmp_path, monkeypatch):
    from szo.train import TrainingDiverged

    server, task = _server(tiny_fed, tmp_path)
    losses = iter([(2.3, 0.1), (float("nan"), 0.1)])
    monkeypatch.setattr(server, "evaluate", lambda: next(losses))
    server.step(1, _mean(task), [0, 1, 2], 1, 1)
    with pytest.raises(TrainingDiverged, match="the federation diverged at round 2: the test loss nan is not finite"):
        server.step(2, _mean(task), [0, 1, 2], 1, 1)


def test_a_client_that_dies_mid_round_does_not_stop_the_federation(tiny_fed, tmp_path, monkeypatch):
    """Four clients; client 2's process exits when round 2 asks for its masked upload (after SecAgg+
    key sharing; tests/federated/dropout_client.py): round 2 still aggregates clients 0, 1 and 3
    (SecAgg+ rebuilds client 2's masks from their shares), round 3 runs with the three of them, the
    run completes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    import szo.federated.flower as F
    from szo.cli import main

    root = Path(__file__).resolve().parents[2]
    _, _, sets = tiny_fed
    real, calls = subprocess.Popen, []

    def popen(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 3:
            cmd = [sys.executable, "-m", "tests.federated.dropout_client", "2"]
        return real(cmd, cwd=root, **kw)

    monkeypatch.setattr(F.subprocess, "Popen", popen)
    out = tmp_path / "run"
    assert main(["federated", "digits-scratch", *[a for s in [*sets, "federated.clients=4"] for a in ("--set", s)],
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows] == [[0, 1, 2, 3], [0, 1, 3], [0, 1, 3]]
    assert not any("refused" in r or "dropped_bn" in r for r in rows)
    assert rows[-1]["fp"] == 2 * 2 * (4 + 3 + 3)
    assert json.loads((out / "results.json").read_text())["status"] == "completed"
    ck = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert np.all(np.isfinite(ck["c"].numpy())) and float(ck["v"].abs().max()) > 0  # it kept stepping


def test_a_client_that_dies_at_start_up_is_one_line_in_seconds(tiny_fed, tmp_path, capsys, monkeypatch):
    import subprocess
    import sys
    import time

    import szo.federated.flower as F
    from szo.cli import main

    _, _, sets = tiny_fed
    real, calls = subprocess.Popen, []

    def popen(cmd, **kw):  # the second client process exits at once
        calls.append(cmd)
        if len(calls) == 2:
            cmd = [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(7)"]
        return real(cmd, **kw)

    monkeypatch.setattr(F.subprocess, "Popen", popen)
    t0 = time.monotonic()
    rc = main(["federated", "digits-scratch", *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path / "run")])
    assert rc == 3 and time.monotonic() - t0 < 90
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: client 1 exited with status 7 before the round started (see its output above); " \
                      "the federation needs all 3 clients"


@pytest.mark.parametrize("setting, shown", [("precision=bf16", "precision 'bf16'"), ("precision=tf32", "precision 'tf32'"),
                                            ("device=cuda", "device 'cuda'"), ("compile=true", "compile True"),
                                            ("cuda_graphs=true", "cuda_graphs True")])
def test_a_run_setting_federated_does_not_apply_is_refused(tmp_path, capsys, setting, shown):
    """szo federated runs fp32 eager forwards on the CPU: a recipe's precision / device / compile /
    cuda_graphs that would mean something else is one line, before any directory or process."""
    from szo.cli import main

    assert main(["federated", "digits-scratch", "--set", setting, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {shown} is not applied by szo federated: its server and 8 "
                                               "client processes run fp32 eager forwards on the CPU; valid here:"), err
    assert not (tmp_path / "run").exists()


def test_non_finite_federated_settings_are_one_line(capsys):
    from szo.cli import main

    assert main(["federated", "digits-scratch", "--set", "federated.lr=inf"]) == 2
    assert "'federated.lr' must be a finite number" in capsys.readouterr().err


def _adam_server(tiny_fed, tmp_path, state=None, **kw):
    import dataclasses

    from szo.data import make_loader
    from szo.federated.server import BaffleServer
    from szo.federated.task import FederatedTask, task_dataset

    _, cfg, _ = tiny_fed
    cfg = dataclasses.replace(cfg, federated=dataclasses.replace(cfg.federated, **kw))
    task = FederatedTask(cfg, "subspace")
    test = make_loader(task_dataset(cfg, "test"), 360, shuffle=False)
    return BaffleServer(cfg, task, 300, tmp_path, test, state, [], []), task


def test_adam_server_update_with_ema_as_the_paper(tiny_fed, tmp_path):
    """server_optimizer adam (betas 0.9 / 0.99) and ema 0.995: Adam's first step is -lr g / (|g| + eps)
    (bias-corrected moments are g and g^2), the EMA moves 0.5 % of the way, and evaluation uses the EMA."""
    import numpy as np
    import torch

    from szo.federated import baffle as B
    from szo.train import evaluate

    server, task = _adam_server(tiny_fed, tmp_path / "a", server_optimizer="adam", ema=0.995, lr=0.01)
    mean = _mean(task, value=0.02)
    server.step(1, mean, [0, 1, 2], 1, 1)
    z = B.round_directions(int(server.seeds[1]), 2, task.dim)
    g = (z * (0.02 / (2 * server.fc.sigma))).mean(0).numpy()  # eq. 6, transcribed
    c1 = -0.01 * g / (np.abs(g) + 1e-8)  # round 1: the cosine schedule is still at lr
    np.testing.assert_allclose(server.state.c, c1, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(server.state.ema, 0.005 * c1, rtol=1e-12, atol=1e-18)
    row = server.state.history[-1]
    task.model.load_flat_params(task.theta(torch.from_numpy(0.005 * c1)).float())
    task.set_bn_stats(server.state.bn.astype(np.float32))
    assert (row["test_loss"], row["test_acc"]) == evaluate(task.model, server.test_loader, task.loss_fn)
    # round 2: the moments with betas (0.9, 0.99), bias-corrected (Kingma & Ba, Algorithm 1)
    server.step(2, _mean(task, value=-0.05), [0, 1, 2], 1, 1)
    z2 = B.round_directions(int(server.seeds[2]), 2, task.dim)
    g2 = (z2 * (-0.05 / (2 * server.fc.sigma))).mean(0).numpy()
    m = 0.9 * (0.1 * g) + 0.1 * g2
    v = 0.99 * (0.01 * g * g) + 0.01 * g2 * g2
    lr2 = 0.01 * 0.5 * (1 + np.cos(np.pi / server.fc.rounds))
    c2 = c1 - lr2 * (m / (1 - 0.9 ** 2)) / (np.sqrt(v / (1 - 0.99 ** 2)) + 1e-8)
    np.testing.assert_allclose(server.state.c, c2, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(server.state.ema, 0.995 * 0.005 * c1 + 0.005 * c2, rtol=1e-12, atol=1e-18)


def test_adam_and_ema_state_survive_the_checkpoint(tiny_fed, tmp_path):
    """Adam's moments, its step count and the EMA are in the checkpoint: a server rebuilt from it
    takes the same next step as the one that kept running."""
    import numpy as np
    import torch

    from szo.federated.server import ServerState
    from szo.train.checkpoint import checkpoint_path

    kw = dict(server_optimizer="adam", ema=0.9, lr=0.05)
    a, task = _adam_server(tiny_fed, tmp_path / "a", **kw)
    a.step(1, _mean(task, value=0.02), [0, 1, 2], 1, 1)
    a.step(2, _mean(task, value=-0.03), [0, 1, 2], 1, 1)
    st = torch.load(checkpoint_path(tmp_path / "a"), weights_only=True)
    b, _ = _adam_server(tiny_fed, tmp_path / "b", state=ServerState.from_checkpoint(st), **kw)
    for s in (a, b):
        s.step(3, _mean(task, value=0.01), [0, 1, 2], 1, 1)
    assert np.array_equal(a.state.c, b.state.c) and np.array_equal(a.state.ema, b.state.ema)
    assert int(b.state.adam["state"][0]["step"]) == 3


def test_groupnorm_clients_upload_only_their_loss_differences(tmp_path):
    """spike_convnet with norm=group (BAFFLE's guideline) has no running statistics: the masked upload
    is the K loss differences and the check value alone, and the server has no BN state to move."""
    import json

    import torch

    from szo.config import load_recipe
    from szo.federated.flower import FederatedConfig, run_federated

    cfg = load_recipe("digits-scratch", ["progress=false", "model.kwargs={width: 4, norm: group, groups: 2}",
                                         "model.T=2", "bptt.epochs=1", "bptt.max_steps_per_epoch=4",
                                         "trajectory.every=1", "subspace.k=2", f"subspace.root={tmp_path / 'store'}"])
    s = run_federated(cfg, tmp_path / "run", FederatedConfig(clients=3, rounds=1, K=3, eval_every=1, batch_size=16))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["clients"] == [0, 1, 2] and "refused" not in rows[0] and s["final_test_acc"] >= 0
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert ck["bn"].numel() == 0 and float(ck["c"].abs().max()) > 0
