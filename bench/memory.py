"""Peak memory of one training step (paper Fig. 5): BPTT, SZO (loop, batched), full-space ZO.

Spike-ResNet20, batch x T grid, each point in a fresh process. CUDA: max_memory_allocated;
CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs after the model and batch are
built) minus the RSS at that moment. SZO uses k=2 (4 probes; memory does not depend on k
beyond the k x d basis), the batched engine a fixed chunk (default 4 copies per pass).
Targets: SZO T=16 within 1.3x of T=1; at T=16, batch 128, SZO <= 1/4 of BPTT.

    python bench/memory.py            # batch {16,32,64,128} x T {1,2,4,8,16}
    python bench/memory.py --quick    # batch {16,32} x T {1,4}
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, RandomSubspace, machine_info, make_batch, make_model, set_threads, write_result  # noqa: E402

METHODS = ("bptt", "szo-loop", "szo-batched", "zo-rge")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(method: str, batch: int, T: int, chunk: int, device: torch.device) -> dict:
    """One training step of ``method``; returns the peak memory above the post-load baseline."""
    from szo.engine import make_plan_evaluator
    from szo.losses import tet_loss
    from szo.optim import SZO, FullSpaceZO

    model, shape = make_model("resnet20", T, device)
    x, y = make_batch(shape, batch, device)
    if method == "bptt":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            tet_loss(model(x), y).backward()
            opt.step()
    elif method.startswith("szo"):
        opt = SZO(model.parameters(), RandomSubspace(model.num_params(), 2), mu=1e-3, lr=1e-3, momentum=0.9,
                  estimator="cge", model=model)
        if method == "szo-loop":
            def step():
                opt.step(lambda: tet_loss(model(x), y))
        else:
            ev = make_plan_evaluator("batched", model, loss_fn=tet_loss, chunk=chunk)

            def step():
                U, z = opt.probe_plan()
                opt._apply_update(opt.combine(ev(opt, U, batch=(x, y)), z))
    elif method == "zo-rge":
        opt = FullSpaceZO(model.parameters(), estimator="rge", q=1, mu=1e-3, lr=1e-3, model=model)

        def step():
            opt.step(lambda: tet_loss(model(x), y))
    else:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        how = "cuda max_memory_allocated"
    else:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset VmHWM to the current RSS
            how = "VmHWM after clear_refs"
        except OSError:
            how = "VmHWM (not resettable: includes the load peak)"
        base = _status_kb("VmRSS") * 1024
        step()
        peak = _status_kb("VmHWM") * 1024 - base
    return dict(method=method, batch=batch, T=T, peak_bytes=int(peak), step_s=time.perf_counter() - t0,
                how=how, chunk=chunk if method == "szo-batched" else None)


def run_point(method: str, batch: int, T: int, chunk: int, threads: int, device: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--batch", str(batch), "--T", str(T),
           "--chunk", str(chunk), "--threads", str(threads), "--device", device]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"worker {method} b={batch} T={T} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], batches: list[int], Ts: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    get = {(r["method"], r["batch"], r["T"]): r["peak_bytes"] / 2**20 for r in rows}
    fig, axes = plt.subplots(1, len(methods) + 1, figsize=(4 * (len(methods) + 1), 3.6))
    for ax, meth in zip(axes, methods):  # memory vs batch, one line per T (Fig. 5 left)
        for T in Ts:
            ax.plot(batches, [get.get((meth, b, T), float("nan")) for b in batches], "o-", label=f"T={T}")
        ax.set_title(meth)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak memory (MiB)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    ax = axes[-1]  # memory vs T at the largest batch (Fig. 5 right)
    b = max(batches)
    for meth in methods:
        ax.plot(Ts, [get.get((meth, b, T), float("nan")) for T in Ts], "o-", label=meth)
    ax.set_title(f"memory vs T (batch {b})")
    ax.set_xlabel("T")
    ax.set_ylabel("peak memory (MiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid: batch {16,32} x T {1,4}")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--chunk", type=int, default=4, help="copies per batched pass")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    if a.worker:
        print(json.dumps(worker(a.worker, a.batch[0], a.T[0], a.chunk, torch.device(a.device))))
        return 0
    if a.quick:
        a.batch, a.T = [16, 32], [1, 4]
    t0 = time.perf_counter()
    rows = []
    for b in a.batch:
        for T in a.T:
            for meth in a.methods:
                r = run_point(meth, b, T, a.chunk, a.threads, a.device)
                rows.append(r)
                print(f"{meth:12s} batch {b:4d} T {T:3d} peak {r['peak_bytes']/2**20:9.1f} MiB "
                      f"({r['step_s']:.1f}s)", flush=True)
    get = {(r["method"], r["batch"], r["T"]): r["peak_bytes"] for r in rows}
    bmax, tmin, tmax = max(a.batch), min(a.T), max(a.T)
    checks = {}
    for meth in ("szo-loop", "szo-batched"):
        if (meth, bmax, tmax) in get and (meth, bmax, tmin) in get:
            flat = get[(meth, bmax, tmax)] / max(1, get[(meth, bmax, tmin)])
            checks[f"{meth} T={tmax}/T={tmin} (batch {bmax}) <= 1.3"] = dict(value=flat, met=flat <= 1.3)
        if (meth, bmax, tmax) in get and ("bptt", bmax, tmax) in get:
            frac = get[(meth, bmax, tmax)] / max(1, get[("bptt", bmax, tmax)])
            checks[f"{meth}/bptt at T={tmax}, batch {bmax} <= 0.25"] = dict(value=frac, met=frac <= 0.25)
    for kname, v in checks.items():
        print(f"{kname}: {v['value']:.3f} {'MET' if v['met'] else 'NOT MET'}")
    out = dict(benchmark="memory", quick=a.quick, args=vars(a), machine=machine_info(), rows=rows,
               checks=checks, wall_s=time.perf_counter() - t0)
    name = "memory_quick" if a.quick else "memory"
    print("wrote", write_result(name, out), f"in {out['wall_s']:.0f}s")
    plot(rows, a.batch, a.T, RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
