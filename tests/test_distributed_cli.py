"""``torchrun --nproc_per_node=2 -m szo recipe digits-scratch``: the real CLI path on 2 gloo processes.

* 3 data-parallel SZO-CGE steps with global batch 32 equal the one-process run with batch 32
  (parameters, BN buffers and subspace coordinates to 1e-5); only rank 0 writes files (an audit
  hook on every rank lists its writes) and the bytes communicated per step are reported.
* a rank that dies (SIGKILL after step 2) makes the other exit with one clear error line within a
  bounded time; ``--resume`` then finishes the run from rank 0's checkpoint, again equal to the
  one-process run; a ``--resume`` with an override that changes the run is refused on every rank.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from szo.config import load_recipe
from szo.pipeline import run_recipe

pytestmark = pytest.mark.slow  # torchrun with 2 processes

REPO = Path(__file__).resolve().parents[1]
K, WIDTH, BATCH, STEPS = 4, 4, 32, 3
TINY = ["model.T=2", f"model.kwargs={{width: {WIDTH}}}", "progress=false", f"data.batch_size={BATCH}",
        "data.test_batch_size=120", "bptt.epochs=1", "bptt.max_steps_per_epoch=5", "trajectory.every=1",
        f"subspace.k={K}", "bptt.lr=0.5"]
SZO = ["train.epochs=1", f"train.max_steps_per_epoch={STEPS}", "train.checkpoint_every_steps=1",
       "distributed.timeout_s=30"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The subspace (tiny one-process BPTT run) and the one-process SZO reference run."""
    root = tmp_path_factory.mktemp("dist_cli")
    sets = TINY + [f"subspace.root={root / 'subspaces'}"]
    run_recipe(load_recipe("digits-scratch", sets + ["kind=bp"]), root / "bp")
    run_recipe(load_recipe("digits-scratch", sets + SZO), root / "single")
    ref = torch.load(root / "single" / "checkpoints" / "last.pt", weights_only=True)
    return root, sets + SZO, ref


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(module: str, sets, out: Path, *extra: str, env_extra=None, fault: str | None = None
              ) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", *((module,) if fault is None else ("tests.fault_launcher", fault)),
           "recipe", "digits-scratch",
           *[a for s in sets for a in ("--set", s)], "--out", str(out), *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return p, time.perf_counter() - t0


def _assert_same_as_single(ckpt: dict, ref: dict) -> None:
    assert ckpt["step"] == ref["step"] == STEPS
    for k, v in ref["model"].items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    torch.testing.assert_close(ckpt["optimizer"]["subspace"]["c"], ref["optimizer"]["subspace"]["c"],
                               rtol=1e-5, atol=1e-5)


def test_torchrun_data_parallel_equals_single_process(setup):
    root, sets, ref = setup
    out = root / "data2"
    p, _ = _torchrun("tests._szo_audited", sets, out, env_extra={"SZO_AUDIT_ROOT": str(root)})
    assert p.returncode == 0, p.stdout + p.stderr
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    _assert_same_as_single(ckpt, ref)
    # only rank 0 wrote (the audit hook sees rank 0's writes, so it works) and printed
    writes = re.findall(r"^AUDIT rank (\d+) (\S+) (.*)$", p.stderr, re.M)
    assert any(r == "0" and path.endswith("results.json") for r, _, path in writes), p.stderr
    assert [w for w in writes if w[0] != "0"] == []
    assert p.stdout.count("done in") == 1
    # bytes per step: 2k probe losses (float64) + per probe and BN layer the batch statistics
    # (2C + 1 float64) + the unperturbed BN forward (bn_update=recompute): its batch statistics
    # per BN layer and its loss (float64)
    m = 2 * K
    expected = m * 8 + (m + 1) * 2 * (2 * WIDTH + 1) * 8 + 8
    res = json.loads((out / "results.json").read_text())
    assert res["distributed"]["world_size"] == 2 and res["distributed"]["mode"] == "data"
    assert res["distributed"]["bytes_per_step"] == expected
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["bytes_per_step"] == expected and metrics[-1]["bytes_communicated"] == STEPS * expected
    print(f"data-parallel, 2 ranks, k={K}, width {WIDTH}: {expected} bytes communicated per step and rank")


def test_dead_rank_stops_the_other_and_resume_continues(setup):
    root, sets, ref = setup
    out = root / "fault"
    p, elapsed = _torchrun("szo", sets, out, fault="1:2")  # rank 1: SIGKILL after step 2 (tests/fault_launcher.py)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: rank 0/2:")]
    assert len(lines) == 1 and ("peer process stopped answering" in lines[0] or "stopped by the launcher" in lines[0]), \
        p.stderr
    assert "--resume" in lines[0] and elapsed < 60
    assert re.search(r"exitcode\s*:\s*3\b", p.stderr), p.stderr  # rank 0 exited by itself (RankFailure)
    st = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert 1 <= st["step"] < STEPS
    # rank 0 reads the run's config.yaml and refuses an override that changes the run; every
    # rank stops with that same line (none waits for a collective)
    p, elapsed = _torchrun("szo", sets, out, "--resume", "--set", "method=szo-rge")
    lines = sorted(ln for ln in p.stderr.splitlines() if ln.startswith("error: "))
    assert p.returncode != 0 and len(lines) == 2 and elapsed < 60, p.stderr
    assert lines[0].startswith("error: [rank 0/2] cannot resume") and lines[1].startswith("error: [rank 1/2]")
    assert "method is 'szo-cge' in its config.yaml but 'szo-rge' now" in lines[1]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == st["step"]
    p, _ = _torchrun("szo", sets, out, "--resume")
    assert p.returncode == 0, p.stdout + p.stderr
    _assert_same_as_single(torch.load(out / "checkpoints" / "last.pt", weights_only=True), ref)
