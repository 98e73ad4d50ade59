"""The drill's cases for a setting given at another door, old run directories, run names and sizes, and
the Lava runner (issue 41); ``bench/chaos.py`` runs them after its kill / tamper cases (``edge_cases``).

Each case runs real ``python -m szo ...`` processes and ends either in an exact resume or in one
``error:`` line with the expected exit status (2: bad input, 5: an external process or the operating
system failed, 130: interrupted) and nothing lost. The Lava runner's failures are made with small
stand-in interpreters (shell scripts given as ``--lava-python``); where ``.venv-lava`` exists, the
runner killed mid-run and Ctrl-C are also done to Lava's own runtime, and a clean check is run.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import yaml
from drill import REPO, _env, final_state, one_line, run, same, szo_cmd

from szo.hw.lava import runner as lava_runner
from szo.hw.lava.bridge import lava_python
from szo.hw.lava.check import export_run
from szo.rundir import ADDED_KEYS


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _wait_for(path: Path, seconds: float = 120.0) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    return ""


def _group_gone(pgid: int, seconds: float = 20.0) -> bool:
    """Every process of group ``pgid`` gone within ``seconds`` (SIGKILLed processes leave asynchronously)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _members(pgid: int) -> int:
    """How many processes are in process group ``pgid`` (from /proc)."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        n += int(fields[2]) == pgid  # state, ppid, pgrp
    return n


def _when_lava_runs(pidfile: Path, seconds: float = 120.0) -> int:
    """The runner's pid once Lava's runtime has started its worker processes in the runner's group."""
    pid = int(_wait_for(pidfile, seconds) or 0)
    end = time.monotonic() + seconds
    while pid and time.monotonic() < end and _members(pid) < 2:
        time.sleep(0.05)
    return pid


def _as_in_a_terminal() -> None:
    """SIGINT as a terminal's foreground command has it: the drill may run in the background of a
    non-interactive shell, which starts it (and so every child) with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def edge_cases(tmp: Path, row: Callable[[str, str, bool, str], None], base: list[str], sets: list[str],
               bptt: list[str]) -> None:
    """Append issue 41's cases to the drill. ``tmp`` holds the drill's digits-bp run (``tmp/bp``, its store in
    ``base``), ``sets``: its tiny SZO-CGE settings."""
    szo = [sys.executable, "-m", "szo"]

    # --- one setting, several doors: what a door does not apply it refuses in one line
    r = run(szo + ["federated", "digits-scratch", "--set", "precision=bf16", "--out", str(tmp / "fed")])
    ok, line = one_line(r, 2, "precision 'bf16' is not applied by szo federated")
    row("szo federated --set precision=bf16", "exit 2, one line, nothing written", ok and not (tmp / "fed").exists(),
        f"exit={r.returncode} '{line}'")
    r = run(szo_cmd("digits-scratch", tmp / "mu", base + ["szo.mu=1e39"]))
    ok, line = one_line(r, 2, "'szo.mu' must be finite in float32")
    row("szo.mu=1e39 (finite in float64 only)", "exit 2, one line, before a probe", ok, f"exit={r.returncode} '{line}'")

    # --- issue 49: settings that round to nothing, an empty value, sizes before allocation; a retry that works
    for bad, phrase in (("szo.mu=1e-50", "'szo.mu' is 0 or subnormal in float32"),
                        ("train.lr=1e-50", "'train.lr' is 0 or subnormal in float32"),
                        ("szo.mu=", "--set szo.mu= has no value"),
                        ("model.T=1000000000", "model.T = 1000000000 x data.batch_size = 32 x")):
        out = tmp / "refused49"
        r = run(szo_cmd("digits-scratch", out, sets + ["szo.scale=absolute", bad]))
        ok, line = one_line(r, 2, phrase)
        row(f"--set {bad}", "exit 2, one line, no run directory left", ok and not out.exists(),
            f"exit={r.returncode} '{line}'")
    r = run(szo_cmd("digits-scratch", tmp / "refused49", sets))
    row("the same --out again with a corrected input", "runs to the end", r.returncode == 0
        and (tmp / "refused49" / "results.json").is_file(), f"exit={r.returncode}")
    rep = tmp / "rep"
    shutil.copytree(tmp / "refused49", rep / "done")
    shutil.copytree(tmp / "refused49", rep / "stopped")
    (rep / "stopped" / "results.json").unlink()
    r = run(szo + ["report", str(rep), "--out", str(tmp / "rep-out")])
    warned = [ln for ln in r.stderr.splitlines() if "without results.json" in ln]
    row("szo report on a directory with an unfinished run", "exit 0, names the run it leaves out and why",
        r.returncode == 0 and len(warned) == 1 and str(rep / "stopped") in warned[0],
        f"exit={r.returncode} '{(warned or [''])[0][:150]}'")

    # --- a run directory written before precision / cuda_graphs / szo.scale existed resumes as it was trained
    old = sets + ["szo.scale=absolute", "tt.cge=central"]
    run(szo_cmd("digits-scratch", tmp / "old-ref", old))
    r = run(szo_cmd("digits-scratch", tmp / "old", old, fault="0:7"))
    cfg_path = tmp / "old" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    for key in ADDED_KEYS:
        *path, last = key.split(".")
        node = cfg
        for p in path:
            node = node.get(p, {})
        node.pop(last, None)
    cfg_path.write_text(yaml.safe_dump(cfg))
    r2 = run(szo_cmd("digits-scratch", tmp / "old", ["progress=false"], "--resume"))
    exact = r.returncode == -9 and r2.returncode == 0 and same(final_state(tmp / "old", False),
                                                               final_state(tmp / "old-ref", False))
    row("resume a run dir written before precision / cuda_graphs / szo.scale",
        "exact resume, in the units it trained in", exact,
        f"SIGKILL after step 7 (exit {r.returncode}), config.yaml without {len(ADDED_KEYS)} newer keys; resume "
        f"exit={r2.returncode}, params {'bit-identical' if exact else 'DIFFER'}"
        + ("" if r2.returncode == 0 else f" '{one_line(r2, 0, '')[1]}'"))

    # --- run names and sizes
    cwd = tmp / "cwd"
    cwd.mkdir()
    before = sorted(p.name for p in tmp.iterdir())
    r = subprocess.run(szo + ["recipe", "digits-scratch"] + [a for s in base + ["name=../../escaped"]
                                                             for a in ("--set", s)],
                       capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600)
    ok, line = one_line(r, 2, "name '../../escaped' cannot name a run directory in runs/")
    ok = ok and sorted(p.name for p in tmp.iterdir()) == before and not any(cwd.iterdir())
    row("--set name=../../escaped without --out", "exit 2, one line, nothing written", ok,
        f"exit={r.returncode} '{line}'")
    t = time.perf_counter()
    r = run(szo_cmd("digits-bp", tmp / "huge", base + bptt + ["bptt.epochs=1000000000", "subspace.name=huge",
                                                              "subspace.k=1000000000000"]))
    wall = time.perf_counter() - t
    ok, line = one_line(r, 2, "subspace.k=1000000000000 needs at least")
    row("bptt.epochs=1e9 (the pre-run sample count)", "exit 2 at once (closed form), one line", ok,
        f"exit={r.returncode} in {wall:.1f} s '{line}'")
    taken = tmp / "taken"
    taken.write_text("a file")
    r = run(szo + ["study", "precision", "digits-scratch", "--no-train", "--out", str(taken)])
    ok, line = one_line(r, 2, "exists and is not a directory")
    r2 = run(szo + ["study", "precision", "digits-bp", "--out", str(tmp / "refused")])
    ok2, _ = one_line(r2, 2, "szo study precision trains in a subspace")
    row("szo study precision --out FILE; a refused study", "exit 2, one line; no --out left behind",
        ok and ok2 and taken.read_text() == "a file" and not (tmp / "refused").exists(), f"exit={r.returncode} '{line}'")
    # hw.select_epochs=1e6: the selection's batches are streamed, memory stays flat
    sel = tmp / "select"
    p = subprocess.Popen(szo_cmd("digits-fixed", sel, sets + ["method=mcu-zo", "szo.q=2", "hw.blocks=2",
                                                              "hw.select_epochs=1000000"]),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=REPO)
    while p.poll() is None and not (sel / ".lock").is_file():
        time.sleep(0.1)
    time.sleep(15)
    a = _rss_mb(p.pid) if p.poll() is None else float("nan")
    time.sleep(20)
    b = _rss_mb(p.pid) if p.poll() is None else float("nan")
    running = p.poll() is None
    p.kill()
    p.wait()
    row("hw.select_epochs=1e6 (block selection)", "runs with flat memory (batches streamed)",
        running and b - a < 100, f"RSS {a:.0f} MB 15 s into the run, {b:.0f} MB 20 s later; still selecting: {running}")

    # --- the Lava runner (stand-in interpreters; Lava's own where .venv-lava exists)
    try:
        lava = lava_python()
    except ValueError:
        lava = None
    run_dir = tmp / "bp"
    check = szo + ["hw", "lava-check", str(run_dir), "--reset", "zero", "--samples", "8"]
    long_check = check[:-1] + ["360"]  # Lava's own runtime busy for seconds: time to interrupt it
    fake = tmp / "fake_runner.py"
    fake.write_text("import sys, numpy as np\nfrom szo.hw.lava.runner import read_bundle, write_bundle\n"
                    "req = read_bundle(sys.argv[1])\nwrite_bundle(sys.argv[2], 'result', {'request_kind': req.kind}, "
                    "{'a_out': np.zeros((1, 1), np.int32)})\n")
    noexec = tmp / "noexec"
    noexec.write_text("#!/bin/sh\n")
    noexec.chmod(0o644)
    cases = [
        ("a Python without lava-nc", sys.executable, (), 5, "has no lava-nc"),
        ("an interpreter that is not executable", noexec, (), 5, "cannot start the Lava interpreter"),
        ("a runner killed by SIGKILL", _script(tmp / "killed", "kill -KILL $$\n"), (), 5,
         "was killed by signal SIGKILL"),
        ("a runner past --timeout-s 2", _script(tmp / "slow", "exec sleep 60\n"), ("--timeout-s", "2"), 5,
         "did not finish within 2 s; killed"),
        ("a signed result without the spike arrays",
         _script(tmp / "nospikes", f'PYTHONPATH="{REPO}" exec "{sys.executable}" "{fake}" "$3" "$4"\n'), (), 2,
         "(missing: spikes."),
        ("--samples 400 on the 360-sample test set", _script(tmp / "never", f'touch "{tmp / "ran"}"\n'),
         ("--samples", "400"), 2, "--samples 400: the test set of"),
    ]
    for name, exe, extra, code, phrase in cases:
        r = run(check + ["--lava-python", str(exe), *extra])
        ok, line = one_line(r, code, phrase)
        row(f"lava-check: {name}", f"exit {code}, one line", ok and not (tmp / "ran").exists(),
            f"exit={r.returncode} '{line}'")
    # Ctrl-C while the runner works: its whole process group goes, and no '--resume' (lava-check has none)
    for who, body in (("stand-in", "sleep 60 &\nexec sleep 60\n"), ("Lava's own", f'exec "{lava}" "$@"\n')):
        if who == "Lava's own" and lava is None:
            row("lava-check: Ctrl-C during Lava's own runtime", "skipped", True, "no .venv-lava (make lava)")
            continue
        pidfile = tmp / f"pid-{who[:5]}"
        exe = _script(tmp / f"ctrlc-{who[:5]}", f'echo $$ > "{pidfile}"\n{body}')
        p = subprocess.Popen(long_check + ["--lava-python", str(exe)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, preexec_fn=_as_in_a_terminal)
        pid = _when_lava_runs(pidfile)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        gone = bool(pid) and _group_gone(pid)
        last = (err.strip().splitlines() or [""])[-1]
        row(f"lava-check: Ctrl-C during the {who} runner", "exit 130, 'interrupted', the runner's group gone",
            p.returncode == 130 and last == "interrupted" and gone and "Traceback" not in err,
            f"exit={p.returncode} '{last}'; runner process group {'gone' if gone else 'STILL RUNNING'}")
    if lava is not None:
        pidfile = tmp / "pid-kill"
        exe = _script(tmp / "kill-lava", f'echo $$ > "{pidfile}"\nexec "{lava}" "$@"\n')
        p = subprocess.Popen(long_check + ["--lava-python", str(exe)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
        pid = _when_lava_runs(pidfile)
        if pid:
            os.kill(pid, signal.SIGKILL)  # the runner alone: Lava's workers are left to szo
        _, err = p.communicate(timeout=120)
        r = subprocess.CompletedProcess(p.args, p.returncode, "", err)
        ok, line = one_line(r, 5, "was killed by signal SIGKILL")
        gone = bool(pid) and _group_gone(pid)
        row("lava-check: Lava's own runner SIGKILLed mid-run", "exit 5, one line, its group gone", ok and gone,
            f"exit={p.returncode} '{line}'")
        r = run(check)
        ok = r.returncode == 0 and "bit-exact: yes" in r.stdout
        row("lava-check of the drill's BPTT model (--reset zero, 8 samples)", "exit 0, bit-exact", ok,
            f"exit={r.returncode}; " + next((ln.strip() for ln in r.stdout.splitlines() if "labels agree" in ln), ""))
    # a bundle with an object array (re-signed): the runner's one ExchangeError line
    bundle, _ = export_run(str(run_dir), tmp / "bundle", reset="zero")
    arrays = dict(np.load(bundle / "arrays.npz"))
    arrays["readout_bias"] = np.array([object()] * arrays["readout_bias"].size, dtype=object)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    (bundle / "arrays.npz").write_bytes(buf.getvalue())
    manifest = json.loads((bundle / "exchange.json").read_text())
    manifest["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (bundle / "exchange.json").write_text(json.dumps(manifest))
    r = run([str(lava or sys.executable), "-I", lava_runner.__file__, str(bundle), str(tmp / "bundle-out")])
    ok, line = one_line(r, 2, "does not hold plain integer arrays")
    row("Lava runner: arrays.npz with an object array", "exit 2, one line, nothing unpickled",
        ok and not (tmp / "bundle-out").exists(), f"exit={r.returncode} '{line}'")
    # export --to lava: every flag applied or refused
    r = run(szo + ["export", str(run_dir), "--to", "lava", str(tmp / "b4"), "--reset", "zero", "--weight-bits", "4"])
    b = lava_runner.read_bundle(tmp / "b4", "network") if r.returncode == 0 else None
    w = max(int(abs(v).max()) for k, v in b.arrays.items() if k.startswith("weights.")) if b is not None else None
    r2 = run(szo + ["export", str(run_dir), "--to", "lava", str(tmp / "bdt"), "--reset", "zero", "--dt", "0.001"])
    ok2, line = one_line(r2, 2, "--dt sets NIR's time constants")
    row("szo export --to lava --weight-bits 4; --dt", "4-bit weights written; --dt refused in one line",
        r.returncode == 0 and w is not None and w <= 14 and ok2 and not (tmp / "bdt").exists(),
        f"largest |2 w_int| {w}; --dt: exit={r2.returncode} '{line}'")
    # szo hw-report with an unreadable lava_check.json: one warning line, the report kept
    rep = tmp / "report-run"
    shutil.copytree(run_dir, rep, ignore=shutil.ignore_patterns("trajectory", "checkpoints"))
    for content in ("[1, 2]", '{"target": "x", "samp'):
        (rep / "lava_check.json").write_text(content)
        r = run(szo + ["hw-report", str(rep), "--no-neurobench", "--batch", "4"])
        warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
        ok = r.returncode == 0 and len(warns) == 1 and "lava_check.json is not a readable" in warns[0] \
            and "Traceback" not in r.stderr and "## " in r.stdout
        row(f"szo hw-report, lava_check.json = {content!r}", "exit 0, one warning line, the report kept", ok,
            f"exit={r.returncode} '{(warns or [''])[0].replace(str(tmp), '$TMP')[:110]}'")
