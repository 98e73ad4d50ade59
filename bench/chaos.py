"""Kill / tamper / concurrency drill for the run-directory contract (docs/runs.md).

Runs real ``python -m szo recipe ...`` processes on a tiny digits model and checks that every
case ends either in an exact resume (the final parameters equal, bit for bit, those of an
uninterrupted run) or in one clear ``error:`` line (no traceback) with the expected exit
status. Prints a summary table and writes bench/results/chaos.json.

    python bench/chaos.py                  # all cases (12 min measured on 2 cores shared with other jobs)
    python bench/chaos.py --kills 5        # more random SIGKILL trials per method
    python bench/chaos.py --no-torchrun    # skip the 2-process case

Cases: SIGKILL at random moments of an SZO-CGE run and of a BPTT run (trajectory + subspace
build), and right after a random optimizer step of an SZO-CGE run and of seed 004's integer learner (mcu-zo), then ``--resume`` until done; a 2-process torchrun run whose rank 1 SIGKILLs itself,
then resumed; a re-signed mcu-zo checkpoint with int8 mantissas of 1000 or a bias tensor missing; a flipped byte / truncated / empty / random / record-less checkpoint; a BPTT
checkpoint copied into an SZO run; a trajectory sample flipped before a resume; resuming
with an override that changes the run; two runs started at once on one --out; a diverging
run (zo-rge at a huge learning rate); ``subspace.k`` larger than the trajectory allows; ``szo demo
dvs-stream`` (its source model's BPTT stage, then the on-line replays) SIGKILLed at a random moment and
resumed with ``--resume``, rerun on its --out without ``--resume``, and resumed with a changed setting.
Then bench/chaos_edges.py's cases: a setting a door does not apply (federated precision, mu beyond float32),
settings that are 0 or subnormal in float32, an empty ``--set`` value, ``model.T=1e9`` (refused before allocation,
no run directory left, the same --out then runs), ``szo report`` naming a run without results.json,
a run directory written before the newer schema keys, run names and sizes (a name leaving runs/, 1e9 BPTT
epochs, study precision --out, hw.select_epochs=1e6) and the Lava runner's failures (no lava-nc, not
executable, SIGKILL, timeout, Ctrl-C, a result without its arrays, too many samples, an object array,
export flags, an unreadable lava_check.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chaos_edges import edge_cases
from common import machine_info, write_result
from drill import REPO, _env, error_lines, final_state, one_line, run, same, szo_cmd, torch_load

TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "data.batch_size=32", "data.test_batch_size=120"]
SZO = ["train.epochs=2", "train.max_steps_per_epoch=12", "train.checkpoint_every_steps=3"]
BPTT = ["bptt.epochs=2", "bptt.max_steps_per_epoch=8", "trajectory.every=1", "subspace.k=6", "bptt.lr=0.5",
        "bptt.checkpoint_every_steps=3"]
# szo demo dvs-stream on a tiny source (22 synthetic gestures of 100 ms: 4 epochs x 2 steps) and a 6-gesture stream
DVS = ["--gestures", "6", "--window-ms", "20", "--print-every", "0"]
for _s in ("model.kwargs={width: 4}", "data.kwargs={T: 10, n_per_class: 2, duration_us: 100000}", "bptt.epochs=4",
           "trajectory.every=1", "subspace.k=4", "data.test_batch_size=22", "progress=false",
           "bptt.checkpoint_every_steps=1"):
    DVS += ["--set", _s]


def dvs_cmd(out: Path, *extra: str) -> list[str]:
    """``python -m szo demo dvs-stream`` on the tiny source (``DVS``)."""
    return [sys.executable, "-m", "szo", "demo", "dvs-stream", "--out", str(out), *DVS, *extra]


def dvs_windows(out: Path) -> dict:
    """Each replay's (window, label, prediction, SZO loss) records (timings left out)."""
    recs = json.loads((out / "windows.json").read_text())
    return {k: [(r["window"], r["label"], r["pred"], r["loss"]) for r in v] for k, v in recs.items()}


def started(p: subprocess.Popen, out: Path) -> float:
    """Wait until the run holds its directory's lock (imports and data loading are done);
    returns the seconds waited."""
    t = time.perf_counter()
    lock = out / ".lock"
    while p.poll() is None and not (lock.is_file() and lock.stat().st_size > 0):
        time.sleep(0.05)
    return time.perf_counter() - t


def timed_run(cmd: list[str], out: Path) -> float:
    """Seconds a run holds its lock (from taking it to clearing it: its training phase)."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=REPO)
    started(p, out)
    t = time.perf_counter()
    lock = out / ".lock"
    while p.poll() is None and lock.stat().st_size > 0:
        time.sleep(0.02)
    held = time.perf_counter() - t
    p.wait()
    return held


def same_trajectory(a: Path, b: Path) -> bool:
    """Same (epoch, step) samples with bit-identical weights. (File sha256s are not compared:
    safetensors writes its metadata in hash-map order, which differs between processes.)"""
    import torch

    from szo.trajectory import Trajectory

    ta, tb = Trajectory(a, verify=True), Trajectory(b, verify=True)
    key = lambda t: [(s["epoch"], s["step"]) for s in t.samples]  # noqa: E731
    return key(ta) == key(tb) and all(torch.equal(ta[i], tb[i]) for i in range(len(ta)))


def kill_and_resume(cmd: list[str], out: Path, rng: random.Random, t_run: float, env: dict | None = None
                    ) -> tuple[str, int, bool, int]:
    """SIGKILL the run at a random moment of its training phase (uniform in [0, 0.7 t_run] after it
    took its lock), then --resume until it exits; returns (where the kill landed, resumes,
    saw a stale-lock takeover line, final exit code)."""
    env = env or _env()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    started(p, out)
    time.sleep(rng.uniform(0.0, 0.7 * t_run))  # the hold time varies with the load: stay inside it
    killed = p.poll() is None
    if killed:
        p.kill()
    p.wait()
    rec = out / "checkpoints" / "last.json"
    for d in (out, out / "bptt", out / "source"):
        if (d / "checkpoints" / "last.json").is_file():
            rec = d / "checkpoints" / "last.json"
    at = json.loads(rec.read_text())["step"] if rec.is_file() else None
    lock = out / ".lock"
    held = lock.is_file() and lock.stat().st_size > 0  # killed while it held the run directory
    resumes, stale, code = 0, False, p.returncode
    while resumes < 5:
        r = run(cmd + ["--resume"], env)
        resumes += 1
        stale = stale or "taking over the stale lock" in r.stderr
        code = r.returncode
        if code == 0:
            break
    where = ("after the run" if not held else f"in the run, last checkpoint at step {at}" if at is not None
             else "in the run, before its first checkpoint")
    return where if killed else "not killed (ended first)", resumes, stale, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=3, help="random SIGKILL trials per kind of run (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the 2-process case")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="szo-chaos-"))
    rows: list[dict] = []

    def row(case: str, expect: str, ok: bool, got: str) -> None:
        got = got.replace(str(tmp), "$TMP")
        rows.append({"case": case, "expected": expect, "outcome": got, "ok": bool(ok)})
        print(f"{'ok  ' if ok else 'FAIL'} {case}: {got}", flush=True)

    store = tmp / "subspaces"
    base = TINY + [f"subspace.root={store}"]
    t0 = time.perf_counter()
    r = run(szo_cmd("digits-bp", tmp / "bp", base + BPTT))
    if r.returncode != 0:
        print(r.stderr)
        return 1
    # --- SIGKILL during an SZO-CGE run, resume until done: exact?
    sets = base + BPTT + SZO
    t_ref = timed_run(szo_cmd("digits-scratch", tmp / "ref", sets), tmp / "ref")
    ref = final_state(tmp / "ref", False)
    for i in range(args.kills):
        out = tmp / f"szo-kill{i}"
        killed, resumes, stale, code = kill_and_resume(szo_cmd("digits-scratch", out, sets), out, rng, t_ref)
        exact = code == 0 and same(final_state(out, False), ref)
        row(f"SIGKILL SZO-CGE run #{i + 1} (random moment)", "exact resume",
            exact, f"killed {killed}; stale lock taken over: {'yes' if stale else 'no'}; resume exit={code}, "
                   f"params {'bit-identical' if exact else 'DIFFER'}")
    # --- SIGKILL right after a random optimizer step (the run kills itself: tests/fault_launcher.py 0:STEP)
    for i in range(args.kills):
        out = tmp / f"szo-step{i}"
        at = rng.randint(1, 23)  # 2 epochs x 12 steps
        r = run(szo_cmd("digits-scratch", out, sets, fault=f"0:{at}"))
        rec = out / "checkpoints" / "last.json"
        ck = json.loads(rec.read_text())["step"] if rec.is_file() else None
        r2 = run(szo_cmd("digits-scratch", out, sets, "--resume"))
        exact = r.returncode == -9 and r2.returncode == 0 and same(final_state(out, False), ref)
        row(f"SIGKILL SZO-CGE run after step {at}", "exact resume", exact,
            f"exit={r.returncode} (SIGKILL), last checkpoint at step {ck}; stale lock taken over: "
            f"{'yes' if 'taking over the stale lock' in r2.stderr else 'no'}; resume exit={r2.returncode}, "
            f"params {'bit-identical' if exact else 'DIFFER'}")
    # --- seed 004's integer learner (int8 weights in the optimizer state, float parameters written back):
    # SIGKILL right after a random step of a digits-fixed mcu-zo run, resume: the same integers and parameters?
    mcu = base + BPTT + SZO + ["method=mcu-zo", "szo.q=2"]
    run(szo_cmd("digits-fixed", tmp / "mcu-ref", mcu))
    mcu_ref = torch_load(tmp / "mcu-ref")
    for i in range(args.kills):
        out = tmp / f"mcu-step{i}"
        at = rng.randint(1, 23)
        r = run(szo_cmd("digits-fixed", out, mcu, fault=f"0:{at}"))
        r2 = run(szo_cmd("digits-fixed", out, mcu, "--resume"))
        got = torch_load(out) if r2.returncode == 0 else None
        exact = (r.returncode == -9 and got is not None and same(got["model"], mcu_ref["model"])
                 and all(a.equal(b) for a, b in zip(got["optimizer"]["mcu"]["integers"],
                                                     mcu_ref["optimizer"]["mcu"]["integers"])))
        row(f"SIGKILL MCU-ZO (int8 learner) run after step {at}", "exact resume", exact,
            f"exit={r.returncode} (SIGKILL); resume exit={r2.returncode}, int8 weights and params "
            f"{'bit-identical' if exact else 'DIFFER'}")
    # --- a re-signed mcu-zo checkpoint (valid sha256 record) whose integers are not the learner's:
    # int8 mantissas of 1000, a bias tensor missing: refused on resume in one line, before a step
    half = tmp / "mcu-half"
    run(szo_cmd("digits-fixed", half, mcu, fault="0:4"))

    def resigned(name: str, change, phrase: str) -> None:
        from szo.train.checkpoint import save_checkpoint

        d = tmp / f"mcu-{name.replace(' ', '-')}"
        shutil.copytree(half, d)
        st = torch_load(d)
        st["optimizer"]["mcu"]["integers"] = change(st["optimizer"]["mcu"]["integers"])
        save_checkpoint(d / "checkpoints" / "last.pt", st)  # a fresh sha256 record: only the content is wrong
        record = (d / "checkpoints" / "last.json").read_text()
        r = run(szo_cmd("digits-fixed", d, mcu, "--resume"))
        ok, line = one_line(r, 2, phrase)
        kept = (d / "checkpoints" / "last.json").read_text() == record  # no step, no new checkpoint
        row(f"re-signed MCU-ZO checkpoint: {name}", f"exit 2, one line ({phrase}), no step taken",
            ok and kept, f"exit={r.returncode} '{line}'; checkpoint {'untouched' if kept else 'REWRITTEN'}")

    def mantissa_1000(ints):
        ints[0].view(-1)[0] = 1000
        return ints

    resigned("int8 mantissa of 1000", mantissa_1000, "outside the signed 8-bit range")
    resigned("a bias tensor missing", lambda ints: ints[:-1], "integer tensors where this learner's layers need")
    # --- SIGKILL during a BPTT run (trajectory, model, subspace build), resume: exact?
    bsets = lambda name: TINY + BPTT + [f"subspace.root={tmp / ('st-' + name)}"]  # noqa: E731
    tb = timed_run(szo_cmd("digits-bp", tmp / "bref", bsets("bref")), tmp / "bref")
    bref = final_state(tmp / "bref", True)
    for i in range(args.kills):
        out = tmp / f"bp-kill{i}"
        killed, resumes, stale, code = kill_and_resume(szo_cmd("digits-bp", out, bsets(f"b{i}")), out, rng, tb)
        ok = code == 0 and same(final_state(out, True), bref)
        ok = ok and same_trajectory(out / "trajectory", tmp / "bref" / "trajectory")
        row(f"SIGKILL BPTT run #{i + 1}", "exact resume", ok,
            f"killed {killed}; stale lock taken over: {'yes' if stale else 'no'}; resume exit={code}, "
            f"model + trajectory {'bit-identical' if ok else 'DIFFER'}")
    # --- szo demo dvs-stream: SIGKILL at a random moment (BPTT of its source, subspace build, replays), --resume
    td = timed_run(dvs_cmd(tmp / "dvs-ref"), tmp / "dvs-ref")
    dref, dsrc = dvs_windows(tmp / "dvs-ref"), final_state(tmp / "dvs-ref" / "source", True)
    for i in range(args.kills):
        out = tmp / f"dvs-kill{i}"
        killed, resumes, stale, code = kill_and_resume(dvs_cmd(out), out, rng, td)
        ok = code == 0 and dvs_windows(out) == dref and same(final_state(out / "source", True), dsrc)
        ok = ok and same_trajectory(out / "source" / "trajectory", tmp / "dvs-ref" / "source" / "trajectory")
        row(f"SIGKILL szo demo dvs-stream #{i + 1}", "exact resume", ok,
            f"killed {killed}; stale lock taken over: {'yes' if stale else 'no'}; resume exit={code}, source model + "
            f"trajectory and every window's prediction and SZO loss {'identical' if ok else 'DIFFER'}")
    r = run(dvs_cmd(tmp / "dvs-ref"))
    ok, line = one_line(r, 2, "already holds a dvs-stream run; pass --resume")
    row("szo demo dvs-stream again on its --out", "exit 2, one line", ok, f"exit={r.returncode} '{line}'")
    r = run(dvs_cmd(tmp / "dvs-ref", "--resume", "--adapt", "szo-rge"))
    ok, line = one_line(r, 2, "adapt is 'szo-cge' in its config.yaml but 'szo-rge' now")
    row("szo demo dvs-stream --resume --adapt szo-rge", "exit 2, one line naming key and both values", ok,
        f"exit={r.returncode} '{line}'")
    # --- torchrun: rank 1 SIGKILLs itself after step 5; resume; equal to an uninterrupted 2-process run
    if not args.no_torchrun:
        def cmd(out: Path, fault: str | None = None) -> list[str]:
            import socket

            with socket.socket() as sk:  # a free port: other jobs on this machine may use torchrun too
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            one = szo_cmd("digits-scratch", out, sets + ["distributed.timeout_s=60"], fault=fault)
            return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    *one[1:]]

        run(cmd(tmp / "dref"))
        r = run(cmd(tmp / "dkill", fault="1:5"))
        errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        ok1 = len(errs) == 1 and errs[0].startswith("error: rank 0/2:")  # rank 1 is gone, rank 0 says why
        line = (errs[0] if errs else "(no error line)")[:150]
        r2 = run(cmd(tmp / "dkill") + ["--resume"])
        ok = r.returncode != 0 and r2.returncode == 0 and same(final_state(tmp / "dkill", False),
                                                               final_state(tmp / "dref", False))
        row("torchrun 2 ranks, rank 1 SIGKILLed at step 5", "one line, then exact resume", ok and ok1,
            f"exit={r.returncode} '{line}'; resume exit={r2.returncode}, params "
            f"{'bit-identical' if ok else 'DIFFER'} to an uninterrupted 2-rank run")
    # --- tampering: every case one line, exit 2
    done = tmp / "ref"

    def tampered(name: str, damage, phrase: str) -> None:
        d = tmp / f"tamper{len(rows)}"
        shutil.copytree(done, d)
        damage(d)
        r = run(szo_cmd("digits-scratch", d, ["progress=false"], "--resume"))
        ok, line = one_line(r, 2, phrase)
        row(f"tamper: {name}", f"exit 2, one line ({phrase})", ok, f"exit={r.returncode} '{line}'")

    ck = lambda d: d / "checkpoints" / "last.pt"  # noqa: E731

    def flip(d: Path) -> None:
        b = bytearray(ck(d).read_bytes())
        b[len(b) // 2] ^= 0x01
        ck(d).write_bytes(bytes(b))

    tampered("flipped byte in last.pt", flip, "does not match the sha256")
    tampered("truncated last.pt", lambda d: ck(d).write_bytes(ck(d).read_bytes()[:1000]), "does not match the sha256")
    tampered("empty last.pt", lambda d: ck(d).write_bytes(b""), "is empty")
    tampered("random last.pt", lambda d: ck(d).write_bytes(os.urandom(5000)), "does not match the sha256")
    tampered("last.json removed", lambda d: (d / "checkpoints" / "last.json").unlink(), "has no sha256 record")

    def bptt_ckpt(d: Path) -> None:
        for n in ("last.pt", "last.json"):
            shutil.copy(tmp / "bp" / "checkpoints" / n, d / "checkpoints" / n)

    tampered("BPTT checkpoint copied into SZO run", bptt_ckpt, "was written by method 'bp'")
    # a trajectory sample flipped, then the BPTT run resumed: refused before training
    d = tmp / "t-traj"
    shutil.copytree(tmp / "bref", d)
    f = d / "trajectory" / "sample_000004.safetensors"
    b = bytearray(f.read_bytes())
    b[-5] ^= 0x01
    f.write_bytes(bytes(b))
    r = run(szo_cmd("digits-bp", d, ["progress=false"], "--resume"))
    ok, line = one_line(r, 2, "is corrupt")
    row("tamper: trajectory sample, BPTT resumed", "exit 2, one line, before training", ok,
        f"exit={r.returncode} '{line}'")
    # --- resume with an override that changes the run
    for key in ("method=szo-rge", "szo.mu=0.5", "train.epochs=5", "model.T=3", "seed=1"):
        r = run(szo_cmd("digits-scratch", done, ["progress=false", key], "--resume"))
        ok, line = one_line(r, 2, f"{key.split('=')[0]} is ")
        row(f"resume with --set {key}", "exit 2, one line naming key and both values", ok,
            f"exit={r.returncode} '{line}'")
    # --- two runs on one --out at once
    out = tmp / "twice"
    cmd = szo_cmd("digits-scratch", out, sets)
    ps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
          for _ in range(2)]
    res = [(p.wait(), p.communicate()) for p in ps]
    codes = sorted(c for c, _ in res)
    loser = next((e for c, (_, e) in res if c == 2), "")
    n_lines = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").exists() else 0
    ok = codes == [0, 2] and "in use by another szo run" in loser and n_lines == 2 \
        and same(final_state(out, False), ref)
    row("two runs on one --out at once", "one runs (exact), the other: exit 2, one line", ok,
        f"exits={codes} '{(error_lines(loser) or [''])[0][:100]}' metrics lines={n_lines}")
    # --- a diverging run
    out = tmp / "diverge"
    r = run(szo_cmd("digits-scratch", out, base + ["method=zo-rge", "train.epochs=3"]))
    status = json.loads((out / "results.json").read_text()).get("status") if (out / "results.json").exists() else None
    ok, line = one_line(r, 4, "training diverged at step")
    row("zo-rge at its recipe settings (diverges)", "exit 4, one line, results.json status diverged",
        ok and status == "diverged", f"exit={r.returncode} status={status} '{line}'")
    # --- k larger than the planned trajectory: refused before BPTT
    out = tmp / "bigk"
    r = run(szo_cmd("digits-scratch", out, base + BPTT + ["subspace.name=bigk", "subspace.k=40"]))
    ok, line = one_line(r, 2, "subspace.k=40 needs at least")
    ok = ok and not (out / "bptt" / "checkpoints").exists()
    row("subspace.k > planned samples - 1", "exit 2, one line, before BPTT", ok, f"exit={r.returncode} '{line}'")
    # --- issue 41: settings at other doors, old run directories, names and sizes, the Lava runner
    edge_cases(tmp, row, base, sets, BPTT)

    wall = time.perf_counter() - t0
    print("\n| case | expected | outcome | ok |\n|---|---|---|---|")
    for x in rows:
        print(f"| {x['case']} | {x['expected']} | {x['outcome'].replace('|', '/')} | {'yes' if x['ok'] else 'NO'} |")
    n_ok = sum(x["ok"] for x in rows)
    print(f"\n{n_ok}/{len(rows)} cases as expected, {wall:.0f} s (python bench/chaos.py --kills {args.kills} "
          f"--seed {args.seed}{' --no-torchrun' if args.no_torchrun else ''})")
    write_result("chaos", {"machine": machine_info(), "args": vars(args), "wall_s": wall, "cases": rows})
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp}")
    return 0 if n_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
