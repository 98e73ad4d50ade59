"""SZO step time vs plain forwards (overhead ratio), loop vs batched engine, and BPTT step time.

overhead ratio = step time / (m * t_fwd), m = 2k (CGE) or 2q (RGE, q = k here), t_fwd = one
plain no-grad forward of the unperturbed model (train mode) at the same batch.
Targets (CPU): loop <= 1.2; batched <= 0.7 (digits) and <= 1.0 (Spike-ResNet20).

    python bench/step.py            # batch 32, T=4, k in {20, 60}
    python bench/step.py --quick    # smoke run
    python bench/step.py --compile  # also the compiled forward (torch.compile) for BPTT and SZO
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    RandomSubspace,
    machine_info,
    make_batch,
    make_model,
    median_time,
    set_threads,
    timed,
    write_result,
)

from szo.evaluators import Batch  # noqa: E402
from szo.losses import tet_loss  # noqa: E402
from szo.optim import SZO  # noqa: E402
from szo.zo import ProbePath  # noqa: E402

TARGETS = {("loop", "digits"): 1.2, ("loop", "resnet20"): 1.2, ("batched", "digits"): 0.7, ("batched", "resnet20"): 1.0}


def timed_into(fn, wall: list[float], cpu: list[float]) -> None:
    """Append the wall and process-CPU seconds of one call of ``fn`` (``common.timed``)."""
    w, c = timed(fn)
    wall.append(w)
    cpu.append(c)


def bench_config(config: str, batch: int, T: int, ks: list[int], reps: int, chunk: int | None, device,
                 compiled: bool = False, q: int | None = None, epoch_samples: int | None = None) -> list[dict]:
    """Rows of one model; ``compiled``: the model's forward through torch.compile (inductor) for
    the plain forwards, BPTT and the SZO probes alike, loop engine only (the batched engine
    folds the copies itself), each row also against the eager forward."""
    model, shape = make_model(config, T, device)
    x, y = make_batch(shape, batch, device)
    rows = []
    if compiled:
        model.set_compile(True)
    mode = "compiled" if compiled else "eager"

    @torch.no_grad()
    def fwd():
        model(x)

    @torch.no_grad()
    def fwd_eager():
        old = model.compile_opts
        model.compile_opts = None
        try:
            model(x)
        finally:
            model.compile_opts = old

    t0 = time.perf_counter()
    fwd()  # compiles the train-mode no-grad graph
    compile_s = time.perf_counter() - t0 if compiled else None
    t_fwd, _ = median_time(fwd, max(reps, 5), warmup=2)

    # BPTT: forward + TET + backward + SGD
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def bptt():
        sgd.zero_grad(set_to_none=True)
        tet_loss(model(x), y).backward()
        sgd.step()

    t0 = time.perf_counter()
    bptt()  # warm-up (compiled: the grad-mode graph)
    bptt_first_s = time.perf_counter() - t0
    # interleaved with eager forwards, wall and process-CPU clocks (as the SZO rows below)
    bw, bc, ew, ec = [], [], [], []
    for _ in range(max(reps, 3)):
        timed_into(fwd_eager, ew, ec)
        timed_into(bptt, bw, bc)
    t_bptt, t_bptt_cpu = statistics.median(bw), statistics.median(bc)
    model.load_state_dict(state)
    bptt_row = dict(config=config, method="bptt", mode=mode, batch=batch, T=T, t_fwd=t_fwd, t_step=t_bptt,
                    t_step_cpu=t_bptt_cpu, t_fwd_eager=statistics.median(ew), t_fwd_eager_cpu=statistics.median(ec),
                    ratio_to_fwd=t_bptt / t_fwd, ratio_to_eager_fwd_cpu=t_bptt_cpu / statistics.median(ec),
                    first_forward_s=compile_s, first_bptt_step_s=bptt_first_s)
    if epoch_samples:
        bptt_row["epoch_s"] = t_bptt * -(-epoch_samples // batch)
    rows.append(bptt_row)
    d = model.num_params()
    for k in ks:
        sub = RandomSubspace(d, k)
        for est in ("cge", "rge"):
            for engine in (("loop",) if compiled else ("loop", "batched")):
                # the production path: SZO(engine=...) stepping on the batch (the loop calls its closure)
                opt = SZO(model.parameters(), sub, mu=1e-3, lr=0.0, momentum=0.0, estimator=est, q=q or k, model=model,
                          generator=torch.Generator().manual_seed(0), probes=ProbePath(engine=engine, chunk=chunk if engine == "batched" else None), scale="absolute")
                m = opt.forwards_per_step
                batch = Batch(x, y, tet_loss)

                def step():
                    opt.step(batch=batch)
                first, _ = timed(step)  # warm-up (and auto chunk sizing)
                n = reps if first * reps < 120 else 1  # keep the full run feasible on 2 shared cores
                # interleave plain forwards with the steps so both see the same machine load;
                # wall and process-CPU clocks (the CPU clock is less sensitive to other jobs)
                fw, fc, sw, sc, ew, ec = [], [], [], [], [], []
                for _ in range(n):
                    for _ in range(3):
                        timed_into(fwd, fw, fc)
                        if compiled:
                            timed_into(fwd_eager, ew, ec)
                    timed_into(step, sw, sc)
                # this row's forward reference (measured between its steps), not the BPTT row's
                f_wall, f_cpu = statistics.median(fw), statistics.median(fc)
                t_step, t_step_cpu = statistics.median(sw), statistics.median(sc)
                ratio, ratio_cpu = t_step / (m * f_wall), t_step_cpu / (m * f_cpu)
                target = TARGETS.get((engine, config))
                row = dict(config=config, method=f"szo-{est}", engine=engine, mode=mode, batch=batch, T=T, k=k,
                           q=(q or k) if est == "rge" else None, probes=m, t_fwd=f_wall, t_step=t_step, t_fwd_cpu=f_cpu, t_step_cpu=t_step_cpu,
                           samples=sw, overhead_ratio=ratio, overhead_ratio_cpu=ratio_cpu,
                           target=target, met=target is not None and ratio <= target,
                           met_cpu=target is not None and ratio_cpu <= target,
                           chunk=(opt.evaluator.last_chunk if engine == "batched" else None))
                if compiled:  # the compiled step against 2k eager forwards (target <= 0.5 on Spike-ResNet20)
                    e_wall, e_cpu = statistics.median(ew), statistics.median(ec)
                    row.update(t_fwd_eager=e_wall, t_fwd_eager_cpu=e_cpu, ratio_to_eager=t_step / (m * e_wall),
                               ratio_to_eager_cpu=t_step_cpu / (m * e_cpu), compiled_fwd_over_eager=f_wall / e_wall,
                               compiled_fwd_over_eager_cpu=f_cpu / e_cpu)
                print(f"{config:9s} {est} {engine:8s} {mode:8s} k={k:3d} m={m:3d} step {t_step:8.3f}s "
                      f"fwd {f_wall*1e3:8.2f}ms ratio wall {ratio:.3f} cpu {ratio_cpu:.3f} (target {target})"
                      + (f" | vs eager fwd: wall {row['ratio_to_eager']:.3f} cpu {row['ratio_to_eager_cpu']:.3f}"
                         if compiled else ""), flush=True)
                if epoch_samples:  # the training time of one epoch at this step time (paper Table 3)
                    row["epoch_s"] = t_step * -(-epoch_samples // batch)
                    print(f"{'':9s} one epoch of {epoch_samples} samples: {row['epoch_s']:.0f}s", flush=True)
                rows.append(row)
        model.load_state_dict(state)
    print(f"{config:9s} bptt {mode} step {t_bptt:.3f}s = {bptt_row['ratio_to_fwd']:.2f} forwards; CPU time "
          f"{t_bptt_cpu:.3f}s = {bptt_row['ratio_to_eager_fwd_cpu']:.2f} eager forwards"
          + (f" (first forward incl. compile {compile_s:.0f}s)" if compiled else "")
          + (f", one epoch {bptt_row['epoch_s']:.0f}s" if epoch_samples else ""), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    szo = [r for r in rows if r["method"].startswith("szo") and r.get("mode", "eager") == "eager"]
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
    ap.add_argument("--q", type=int, default=None, help="RGE queries per step (default: q = k)")
    ap.add_argument("--epoch-samples", type=int, default=None,
                    help="also report the time of one epoch of this many samples (e.g. 50000 for CIFAR)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=["digits", "resnet20"], choices=["digits", "resnet20", "resnet18"])
    ap.add_argument("--chunk", type=int, default=None, help="copies per batched pass (default: auto)")
    ap.add_argument("--compile", action="store_true",
                    help="also the compiled forward (torch.compile, inductor): plain forward, BPTT, SZO loop")
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
        for compiled in (False, True) if a.compile else (False,):
            rows += bench_config(cfg, a.batch, a.T, a.k, a.reps, a.chunk, device, compiled=compiled, q=a.q,
                                 epoch_samples=a.epoch_samples)
    out = dict(benchmark="step", quick=a.quick, args=vars(a), machine=machine_info(), rows=rows,
               wall_s=time.perf_counter() - t0)
    name = "step_quick" if a.quick else "step"
    if sorted(a.configs) != ["digits", "resnet20"]:  # a partial run does not overwrite the full one
        name += "_" + "-".join(a.configs)
    if a.compile:
        name += "_compile"
    print("wrote", write_result(name, out))
    plot(rows, RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
