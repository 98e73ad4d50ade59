"""SZO step time vs plain forwards (overhead ratio), loop vs batched engine, and BPTT step time.

overhead ratio = step time / (m * t_fwd), m = 2k (CGE) or 2q (RGE, q = k here), t_fwd = one
plain no-grad forward of the unperturbed model (train mode) at the same batch.
Targets (CPU): loop <= 1.2; batched <= 0.7 (digits) and <= 1.0 (Spike-ResNet20).

    python bench/step.py            # batch 32, T=4, k in {20, 60}
    python bench/step.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, RandomSubspace, machine_info, make_batch, make_model,  # noqa: E402
                    median_time, set_threads, timed, write_result)

from szo.engine import batch_closure  # noqa: E402
from szo.losses import tet_loss  # noqa: E402
from szo.optim import SZO  # noqa: E402

TARGETS = {("loop", "digits"): 1.2, ("loop", "resnet20"): 1.2, ("batched", "digits"): 0.7, ("batched", "resnet20"): 1.0}


def bench_config(config: str, batch: int, T: int, ks: list[int], reps: int, chunk: int | None, device) -> list[dict]:
    model, shape = make_model(config, T, device)
    x, y = make_batch(shape, batch, device)
    rows = []
    @torch.no_grad()
    def fwd():
        model(x)

    t_fwd, _ = median_time(fwd, max(reps, 5), warmup=2)

    # BPTT: forward + TET + backward + SGD
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def bptt():
        sgd.zero_grad(set_to_none=True)
        tet_loss(model(x), y).backward()
        sgd.step()

    t_bptt, _ = median_time(bptt, max(reps, 3), warmup=1)
    model.load_state_dict(state)
    bptt_row = dict(config=config, method="bptt", batch=batch, T=T, t_fwd=t_fwd, t_step=t_bptt,
                    ratio_to_fwd=t_bptt / t_fwd)
    rows.append(bptt_row)
    d = model.num_params()
    for k in ks:
        sub = RandomSubspace(d, k)
        for est in ("cge", "rge"):
            for engine in ("loop", "batched"):
                # the production path: SZO(engine=...) stepping a closure that carries its batch
                opt = SZO(model.parameters(), sub, mu=1e-3, lr=0.0, momentum=0.0, estimator=est, q=k, model=model,
                          generator=torch.Generator().manual_seed(0), engine=engine,
                          chunk=chunk if engine == "batched" else None)
                m = opt.forwards_per_step
                closure = batch_closure(model, tet_loss, x, y)

                def step():
                    opt.step(closure)
                first, _ = timed(step)  # warm-up (and auto chunk sizing)
                n = reps if first * reps < 120 else 1  # keep the full run feasible on 2 shared cores
                # interleave plain forwards with the steps so both see the same machine load;
                # wall and process-CPU clocks (the CPU clock is less sensitive to other jobs)
                fw, fc, sw, sc = [], [], [], []
                for _ in range(n):
                    for _ in range(3):
                        w, c = timed(fwd)
                        fw.append(w)
                        fc.append(c)
                    w, c = timed(step)
                    sw.append(w)
                    sc.append(c)
                # this row's forward reference (measured between its steps), not the BPTT row's
                f_wall, f_cpu = statistics.median(fw), statistics.median(fc)
                t_step, t_step_cpu = statistics.median(sw), statistics.median(sc)
                ratio, ratio_cpu = t_step / (m * f_wall), t_step_cpu / (m * f_cpu)
                target = TARGETS[(engine, config)]
                row = dict(config=config, method=f"szo-{est}", engine=engine, batch=batch, T=T, k=k,
                           probes=m, t_fwd=f_wall, t_step=t_step, t_fwd_cpu=f_cpu, t_step_cpu=t_step_cpu,
                           samples=sw, overhead_ratio=ratio, overhead_ratio_cpu=ratio_cpu,
                           target=target, met=ratio <= target, met_cpu=ratio_cpu <= target,
                           chunk=(opt._batched.evaluator.last_chunk if engine == "batched" else None))
                print(f"{config:9s} {est} {engine:8s} k={k:3d} m={m:3d} step {t_step:8.3f}s "
                      f"fwd {f_wall*1e3:8.2f}ms ratio wall {ratio:.3f} cpu {ratio_cpu:.3f} (target {target})",
                      flush=True)
                rows.append(row)
        model.load_state_dict(state)
    print(f"{config:9s} bptt step {t_bptt:.3f}s = {bptt_row['ratio_to_fwd']:.2f} forwards", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    szo = [r for r in rows if r["method"].startswith("szo")]
    labels = [f"{r['config']}\n{r['method'][4:]} k={r['k']}" for r in szo if r["engine"] == "loop"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    width = 0.4
    for i, eng in enumerate(("loop", "batched")):
        vals = [r["overhead_ratio"] for r in szo if r["engine"] == eng]
        ax.bar([j + (i - 0.5) * width for j in range(len(vals))], vals, width, label=eng)
    for t, ls in ((1.2, "--"), (1.0, ":"), (0.7, "-.")):
        ax.axhline(t, color="gray", ls=ls, lw=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("step time / (m x plain forward)")
    ax.set_title("SZO step overhead (targets: loop 1.2, batched 0.7 digits / 1.0 ResNet20)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 8, T=2, k=4, 1 repeat")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--k", type=int, nargs="+", default=[20, 60])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=["digits", "resnet20"])
    ap.add_argument("--chunk", type=int, default=None, help="copies per batched pass (default: auto)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.quick:
        a.batch, a.T, a.k, a.reps = 8, 2, [4], 1
    set_threads(a.threads)
    device = torch.device(a.device)
    t0 = time.perf_counter()
    rows = []
    for cfg in a.configs:
        rows += bench_config(cfg, a.batch, a.T, a.k, a.reps, a.chunk, device)
    out = dict(benchmark="step", quick=a.quick, args=vars(a), machine=machine_info(), rows=rows,
               wall_s=time.perf_counter() - t0)
    name = "step_quick" if a.quick else "step"
    if sorted(a.configs) != ["digits", "resnet20"]:  # a partial run does not overwrite the full one
        name += "_" + "-".join(a.configs)
    print("wrote", write_result(name, out))
    plot(rows, RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
