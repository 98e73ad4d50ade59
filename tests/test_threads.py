"""The thread policy (szo.threads): torch's default, the user's explicit count, the measured choice,
its record in a run's results and its reuse on resume; fit puts the process's count back."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import szo.threads as T
from szo.cli import main
from szo.config import load_recipe
from szo.evaluators import Batch, BatchedProbeEvaluator
from szo.losses import tet_loss
from szo.models import create
from szo.optim import SZO
from szo.rundir import config_differences
from szo.train import fit
from szo.zo import ProbePath


@pytest.fixture
def threads_back():
    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)


def test_default_threads_is_what_torch_starts_with():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    code = "import torch, szo.threads as t; print(torch.get_num_threads(), t.default_threads())"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    torch_n, ours = map(int, got.stdout.split())
    assert ours == torch_n


def test_explicit_counts_are_respected(monkeypatch, threads_back):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert T.explicit_threads() == (1, "OMP_NUM_THREADS")
    c = T.choose_threads("auto", lambda: pytest.fail("an explicit count is not measured"))
    assert (c.threads, c.source) == (1, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    torch.set_num_threads(T.default_threads() + 1)
    assert T.explicit_threads() == (T.default_threads() + 1, "torch.set_num_threads")
    torch.set_num_threads(T.default_threads())
    assert T.explicit_threads() is None
    c = T.choose_threads(3, lambda: pytest.fail("a set count is not measured"))
    assert (c.threads, c.source, c.setting) == (3, "setting", 3)


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5, True])
def test_bad_setting_is_one_value_error(bad):
    with pytest.raises(ValueError, match="threads must be 'auto' or a positive int"):
        T.choose_threads(bad, None)
    with pytest.raises(ValueError, match="threads"):
        load_recipe("digits-bp", [("threads", bad)])


def test_candidates_and_pick():
    assert T.candidate_threads(1) == [1]
    assert T.candidate_threads(2) == [1, 2]
    assert T.candidate_threads(6) == [1, 2, 4, 6]
    assert T._pick({1: 1.0, 2: 0.97}) == 1  # within the margin: fewer threads
    assert T._pick({1: 1.0, 2: 0.5, 4: 0.49}) == 2
    assert T._pick({1: 0.2, 2: 0.5}) == 1


def test_measured_choice_times_every_candidate_and_restores(monkeypatch, threads_back):
    monkeypatch.setattr(T, "explicit_threads", lambda: None)
    seen = []

    def work():  # fastest at 2 threads, by construction (within DROP of the others: all are timed)
        seen.append(torch.get_num_threads())
        sum(range(100_000 if torch.get_num_threads() == 2 else 200_000))

    torch.set_num_threads(1)
    c = T.choose_threads("auto", work, candidates=[1, 2, 3], rounds=3)
    assert torch.get_num_threads() == 1  # measuring leaves the process's count
    assert (c.threads, c.source) == (2, "measured")
    assert sorted(set(seen)) == [1, 2, 3] and len(seen) == 1 + 3 * 4  # prime, then warm-up + 3 rounds per count
    assert set(c.record()["timings_ms"]) == {"1", "2", "3"}
    with c.scope():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_a_far_slower_count_is_timed_once(monkeypatch, threads_back):
    seen = []

    def work():
        seen.append(torch.get_num_threads())
        sum(range(400_000 if torch.get_num_threads() == 2 else 10_000))

    got = T.time_threads(work, [1, 2], rounds=3)
    assert seen.count(2) == 1 and seen.count(1) == 1 + 4  # prime + warm-up + 3 rounds
    assert got[2] > T.DROP * got[1]


def test_a_slow_first_call_does_not_drop_its_count(threads_back):
    """The first call of a run pays one-time costs (measured: 335 ms against 7 ms for the next ones on the
    digits net); it is not the first candidate's time."""
    calls = []

    def work():
        calls.append(torch.get_num_threads())
        sum(range(2_000_000 if len(calls) == 1 else 20_000))

    got = T.time_threads(work, [1, 2], rounds=3)
    assert calls.count(1) == 1 + 4 and calls.count(2) == 4  # both counts timed in every round
    assert got[1] < T.DROP * got[2]


def test_threads_is_harmless_on_resume():
    a = load_recipe("digits-bp").to_dict()
    b = load_recipe("digits-bp", ["threads=1"]).to_dict()
    assert config_differences(a, b) == []


def _digits_run(tmp_path, resume=False, threads="auto"):
    d = load_digits()
    x = torch.tensor(d.images[:64], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target[:64], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    train = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)
    test = DataLoader(TensorDataset(x, y), batch_size=64)
    torch.manual_seed(0)  # test-only: a fixed initial model
    model = create("spike_convnet", T=2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return fit(model, train, test, opt, epochs=1, loss_fn=tet_loss, run_dir=tmp_path, generator=g, progress=False,
               plot=False, resume=resume, threads=threads)


def test_fit_records_the_choice_and_a_resume_reuses_it(tmp_path, monkeypatch, threads_back):
    monkeypatch.setattr(T, "explicit_threads", lambda: None)
    monkeypatch.setattr(T, "candidate_threads", lambda cores=None: [1, 2])
    torch.set_num_threads(1)
    summary = _digits_run(tmp_path)
    rec = summary["threads"]
    assert rec["source"] == "measured" and rec["threads"] in (1, 2) and set(rec["timings_ms"]) == {"1", "2"}
    assert json.loads((tmp_path / "results.json").read_text())["threads"] == rec
    assert json.loads((tmp_path / T.THREADS_FILE).read_text()) == rec
    assert torch.get_num_threads() == 1  # fit puts the caller's count back
    # a resumed run reads the recorded count instead of measuring again (here: a count it would not pick)
    (tmp_path / T.THREADS_FILE).write_text(json.dumps({**rec, "threads": 3}))
    monkeypatch.setattr(T, "time_threads", lambda *a, **k: pytest.fail("a resumed run does not measure"))
    again = _digits_run(tmp_path, resume=True)
    assert again["threads"]["threads"] == 3 and again["threads"]["source"] == "resumed"
    assert torch.get_num_threads() == 1


def test_fit_with_an_explicit_count(tmp_path, threads_back):
    torch.set_num_threads(1)
    summary = _digits_run(tmp_path, threads=2)
    assert summary["threads"] == {"threads": 2, "source": "setting", "setting": 2, "cores": T.physical_cores()}
    assert torch.get_num_threads() == 1


def test_szo_threads_command_prints_the_advice(capsys, threads_back):
    assert main(["threads", "digits-bp", "--set", "data.batch_size=8", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "torch.set_num_threads(" in out
    assert "1: " in out  # one thread is always a candidate


@pytest.mark.parametrize("threads", [1, 2])
def test_probes_folded_into_the_batch_equal_the_loop(threads, threads_back):
    """The probe-parallel path on the CPU (the batched engine: a step's probes folded into one forward, so
    intra-op threads have a wide tensor to share) gives the sequential loop's probe losses (one thread),
    to float rounding: grouped convolutions sum in another order (docs/performance.md, "Threads")."""
    torch.manual_seed(0)  # test-only: a fixed model and batch
    model = create("spike_convnet", T=4, width=16).train()
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(model.num_params(), 20, generator=g))[0]
    opt = SZO(model.parameters(), SimpleNamespace(basis=basis, layout=None), mu=0.05, model=model, estimator="cge",
              scale="absolute",
              generator=torch.Generator().manual_seed(0), probes=ProbePath(bn_update="probe-mean"))
    x, y = torch.rand(64, 1, 8, 8, generator=g) * 2, torch.randint(0, 10, (64,), generator=g)
    plan = opt.plan()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    torch.set_num_threads(1)
    loop = opt.evaluate(lambda: tet_loss(model(x), y), plan)
    model.load_state_dict(start)
    torch.set_num_threads(threads)
    ev = BatchedProbeEvaluator(opt.guard, model, ProbePath(engine="batched", bn_update="probe-mean"))
    with ev.session():
        b = Batch(x, y, tet_loss)
        folded = ev.run(b.closure(model), opt.space, plan, batch=b)
    assert folded.shape == loop.shape == (40,) and loop.unique().numel() > 1
    torch.testing.assert_close(folded, loop, rtol=1e-5, atol=0.0)


def test_one_slow_call_does_not_decide(threads_back):
    """One hiccup (a 40 ms call among 6 ms ones on a quiet machine) is not the count's time: the median."""
    calls = {1: 0, 2: 0}

    def work():
        n = torch.get_num_threads()
        calls[n] += 1
        slow = n == 2 and calls[n] == 4  # one of its timed rounds
        sum(range(3_000_000 if slow else (10_000 if n == 2 else 30_000)))

    got = T.time_threads(work, [1, 2], rounds=5)
    assert T._pick(got) == 2


def test_counts_beyond_the_free_cores_are_not_candidates(monkeypatch, threads_back):
    """Two other processes running on a 2-core machine leave one core: auto takes one thread without
    timing two (a short timing beside busy processes can see two threads win and the run then pay 28x)."""
    monkeypatch.setattr(T, "explicit_threads", lambda: None)
    monkeypatch.setattr(T, "physical_cores", lambda: 2)
    monkeypatch.setattr(T.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(T, "busy_threads", lambda *a, **k: 2)
    assert T.free_cores() == 1 and T.free_cores(0) == 2 and T.free_cores(1) == 1
    c = T.choose_threads("auto", lambda: pytest.fail("one candidate: nothing to time"))
    assert (c.threads, c.source) == (1, "measured: 1 core free") and c.record()["busy_threads"] == 2
    monkeypatch.setattr(T, "busy_threads", lambda *a, **k: 0)
    seen = []
    c = T.choose_threads("auto", lambda: seen.append(torch.get_num_threads()))
    assert sorted(set(seen)) == [1, 2] and c.source == "measured" and c.busy == 0


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads /proc (Linux)")
def test_busy_threads_sees_other_processes():
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        import time
        time.sleep(0.3)
        assert T.busy_threads() >= 1  # two busy loops, whatever else the machine runs
    finally:
        for p in spin:
            p.kill()
            p.wait()
