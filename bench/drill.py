"""Helpers of the kill / tamper / concurrency drill (bench/chaos.py, bench/chaos_edges.py): run real ``python -m
szo ...`` processes and judge how they ended (one ``error:`` line with the expected status, or bit-identical
final parameters)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def szo_cmd(recipe: str, out: Path, sets: list[str], *extra: str, fault: str | None = None) -> list[str]:
    """``python -m szo recipe ...``; ``fault="RANK:STEP"``: through tests/fault_launcher.py, which
    makes rank RANK SIGKILL itself right after optimizer step STEP (no such hook in the library)."""
    module = ["szo"] if fault is None else ["tests.fault_launcher", fault]
    cmd = [sys.executable, "-m", *module, "recipe", recipe, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=REPO)


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that are not progress-bar redraws, warnings or torchrun chatter."""
    lines = [seg.strip() for ln in stderr.splitlines() for seg in ln.split("\r")]
    return [ln for ln in lines if ln and not re.match(r"^(epoch \d+/\d+|eval|W\d{4}|\*{5,}|Setting OMP)", ln)
            and "OMP_NUM_THREADS" not in ln and "warnings.warn" not in ln and "UserWarning" not in ln]


def one_line(r: subprocess.CompletedProcess, code: int, phrase: str) -> tuple[bool, str]:
    errs = [ln for ln in error_lines(r.stderr) if ln.startswith("error:")]
    ok = r.returncode == code and len(errs) >= 1 and phrase in errs[0] and "Traceback" not in r.stderr
    ok = ok and len({e.split("] ", 1)[-1] for e in errs}) == 1  # torchrun: the same line from each rank
    return ok, (errs[0] if errs else (error_lines(r.stderr) or ["(no stderr)"])[-1])[:150]


def final_state(run_dir: Path, bptt: bool) -> dict:
    import torch

    if bptt:
        from safetensors.torch import load_file

        return load_file(run_dir / "model.safetensors")
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def torch_load(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
