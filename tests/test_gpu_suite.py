"""bench/gpu_suite.sh refuses what it cannot run before it installs or runs anything."""
from __future__ import annotations

import os
import subprocess
import sys
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
                                "reference memory memopt epoch study anchor")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    r = _run("quick", results=str(tmp_path), WHEELS=str(tmp_path / "no-wheels"))
    assert r.returncode == 2 and "torch sees no CUDA device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no part ran, no log written
