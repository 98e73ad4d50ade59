"""bench/gpu_suite.sh refuses what it cannot run before it installs or runs anything."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).resolve().parent.parent / "bench" / "gpu_suite.sh"


def _run(*parts, **env):
    return subprocess.run(["bash", str(SUITE), *parts], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SZO_BENCH_RESULTS": env.pop("results"), "PYTHON": sys.executable, **env})


def test_an_unknown_part_is_one_line_with_the_valid_ones(tmp_path):
    r = _run("probe", "bogus", results=str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("gpu_suite: unknown part 'bogus'; valid: quick all device devtests tests probe step "
                                "reference memory memopt epoch study anchor szo128")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    r = _run("quick", results=str(tmp_path), WHEELS=str(tmp_path / "no-wheels"))
    assert r.returncode == 2 and "torch sees no CUDA device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no part ran, no log written


def test_under_the_device_tool_the_results_come_back_as_one_archive(tmp_path):
    """The device tool returns a handful of files from $OUT: the suite packs its folder into
    $OUT/gpu.tgz (logs and JSON, never checkpoints). An interpreter that answers every check with
    success stands in for the GPU machine's; nvidia-smi may be missing (the part fails, the run goes on)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SZO_BENCH_RESULTS"}
    r = subprocess.run(["bash", str(SUITE), "device"], capture_output=True, text=True, timeout=120,
                       env={**env, "OUT": str(out), "PYTHON": str(fake), "WHEELS": str(tmp_path / "none")})
    assert f"results in {out}/gpu.tgz" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu.tgz"]
    with tarfile.open(out / "gpu.tgz") as tar:
        assert "gpu/device.log" in tar.getnames()


def test_szo128_trains_in_the_anchors_subspace_and_counts_its_bptt_epochs(tmp_path):
    """The anchor writes its k = 20 subspace to the results folder's store; szo128 trains the same 128-channel
    network in that entry and then reports the cost with the anchor's BPTT run. An interpreter that logs its
    arguments stands in for the GPU machine's."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    fake.chmod(0o755)
    fm = tmp_path / "fm"
    fm.mkdir()
    r = _run("anchor", "szo128", results=str(tmp_path / "res"), PYTHON=str(fake), WHEELS=str(tmp_path / "none"),
             FMNIST_DIR=str(fm), SZO_EPOCHS="3")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [c for c in log.read_text().splitlines() if c.startswith(("-m szo", "bench/"))]
    res = tmp_path / "res"
    anchor, szo, cost = calls
    assert anchor.startswith("-m szo recipe fmnist-bp --device cuda") and f"subspace.root={res}/store" in anchor
    assert szo.startswith(f"-m szo recipe fmnist-scratch --device cuda --out {res}/fmnist-szo128 --set")
    for item in (f"subspace.root={res}/store", "subspace.name=fmnist-csnn128-k20", "model.kwargs={channels: 128}",
                 "train.epochs=3"):
        assert f"--set {item}" in szo, item
    from szo.config import load_recipe
    assert load_recipe("fmnist-bp")["subspace"]["name"] == "fmnist-csnn128-k20"  # the entry the anchor builds
    assert cost == f"bench/subspace_questions.py cost --bp-run {res}/fmnist-bp --run {res}/fmnist-szo128"
