"""Peak memory of one training step (paper Fig. 5): BPTT, SZO (loop, batched, streaming), full-space ZO.

Spike-ResNet20, batch x T grid, each point in a fresh process. CUDA: max_memory_allocated;
CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs after the model and batch are
built) minus the RSS at that moment. SZO uses CGE with k=2 (4 probes; memory does not
depend on k beyond the k x d basis), the batched engine a fixed chunk (default 4 copies
per pass). ``szo-stream`` is the loop with the streaming forward (``model.set_streaming``:
``--time-chunk`` steps per chunk, default 1; BN policy ``--stream-bn``, default ``running``:
one pass per probe; ``exact`` needs one extra truncated pass per BN layer, the same memory
but ~11x the time on ResNet20), ``szo-batched-stream`` the batched engine on top of it.
``bptt-ckpt`` recomputes each residual block in the backward pass (SpikingJelly's
``memopt.checkpoint_module``, neuron state handled by it; same gradients), ``bptt-bf16`` runs
the forward under ``torch.autocast`` in bfloat16. ``bptt-memoptL`` (L = 1..4) is SpikingJelly 2.0's
own ``memopt.optimize_memory`` at level L, the strongest BP memory baseline a SpikingJelly user has
(1: selective checkpointing of the residual blocks, 2: + spatial splitting, 3: + temporal splitting,
4: + greedy unwrapping; levels 2-4 search with CUDA peak-memory trials, so CUDA only; the search runs
before the measured step). Each point also records the persistent training
state the step peak leaves out (``state``: weights, buffers, optimizer state, and SZO's basis P^T,
k x d floats: with the paper's k = 20-40 it outweighs a small step), and the plot / table add
"persistent state + step peak". ``--config resnet18`` measures Spike-ResNet18
(CIFAR-100-shaped input, the paper's Fig. 5 model) instead of Spike-ResNet20.
Targets: SZO T=16 within 1.3x of T=1; at T=16, batch 128, SZO <= 1/4 of BPTT.

    python bench/memory.py            # batch {16,32,64,128} x T {1,2,4,8,16}
    python bench/memory.py --quick    # batch {16,32} x T {1,4}
    python bench/memory.py --batch 16 32 64 128 --T 1 4 16 --methods bptt szo-loop szo-stream zo-rge

``--merge`` adds the new points to the existing JSON of the same name (a point measured
again replaces the old one), so a grid can be filled in several runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    RandomSubspace,
    cpu_alloc_peak,
    machine_info,
    make_batch,
    make_model,
    proc_status_kb,
    run_json_worker,
    set_threads,
    write_result,
)

from szo.models.streaming import STREAM_BN_MODES  # noqa: E402
from szo.zo import ProbePath  # noqa: E402

MEMOPT_METHODS = ("bptt-memopt1", "bptt-memopt2", "bptt-memopt3", "bptt-memopt4")
METHODS = ("bptt", "bptt-ckpt", "bptt-bf16", *MEMOPT_METHODS, "szo-loop", "szo-batched", "szo-stream",
           "szo-batched-stream", "zo-rge")
BPTT_METHODS = ("bptt", "bptt-ckpt", "bptt-bf16", *MEMOPT_METHODS)
DEFAULT_METHODS = ("bptt", "szo-loop", "szo-batched", "szo-stream", "zo-rge")
SZO_METHODS = tuple(m for m in METHODS if m.startswith("szo"))


def _malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: return free heap pages to the OS (False where unavailable)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def worker(method: str, batch: int, T: int, chunk: int, device: torch.device, *, k: int = 2,
           time_chunk: int = 1, stream_bn: str = "running", warmup: bool = True, alloc_peak: bool = True,
           config: str = "resnet20") -> dict:
    """One training step of ``method``; returns the peak memory above the post-load baseline.

    ``peak_bytes``: CUDA max_memory_allocated, or on CPU peak RSS (VmHWM) of that step.
    ``alloc_peak_bytes`` (CPU, ``alloc_peak``): peak tensor bytes the CPU allocator handed
    out during one more step, replayed from profiler events (``common.cpu_alloc_peak``);
    a second step because the profiler's own records would add to the RSS of the first.
    """
    from szo.evaluators import Batch
    from szo.losses import tet_loss
    from szo.optim import SZO, FullSpaceZO

    model, shape = make_model(config, T, device)
    x, y = make_batch(shape, batch, device)
    batch_data = {"x": x, "y": y}
    streaming = method.endswith("-stream")
    if streaming:
        model.set_streaming(time_chunk, stream_bn)
    if method in BPTT_METHODS:
        if method == "bptt-ckpt":
            from spikingjelly.activation_based.memopt import checkpoint_module

            for stage in model.stages:  # every residual block recomputed in the backward pass
                for i in range(len(stage)):
                    stage[i] = checkpoint_module(stage[i])
        elif method in MEMOPT_METHODS:  # SpikingJelly's own pipeline, on the residual blocks
            from spikingjelly.activation_based.memopt import optimize_memory

            level = int(method[-1])
            if level > 1 and device.type != "cuda":
                raise ValueError(f"{method}: memopt levels 2-4 search with CUDA memory trials; run on CUDA")
            block = type(model.stages[0][0])
            optimize_memory(model, block, lambda m: tet_loss(m(batch_data["x"]), batch_data["y"]), level=level)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        bf16 = torch.autocast(device.type, dtype=torch.bfloat16, enabled=method == "bptt-bf16")

        def step():
            opt.zero_grad(set_to_none=True)
            with bf16:
                out = model(batch_data["x"])
            tet_loss(out.float(), batch_data["y"]).backward()
            opt.step()
    elif method in SZO_METHODS:
        batched = "batched" in method
        opt = SZO(model.parameters(), RandomSubspace(model.num_params(), k), mu=1e-3, lr=1e-3, momentum=0.9,
                  estimator="cge", model=model, probes=ProbePath(engine="batched" if batched else "loop", chunk=chunk if batched else None), scale="absolute")

        def step():
            opt.step(batch=Batch(batch_data["x"], batch_data["y"], tet_loss))
    elif method == "zo-rge":
        opt = FullSpaceZO(model.parameters(), estimator="rge", q=1, mu=1e-3, lr=1e-3, model=model)

        def step():
            opt.step(lambda: tet_loss(model(batch_data["x"]), batch_data["y"]))
    else:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if warmup:
        # one step on a 2-sample batch first: loads library code pages and builds kernels
        # (which would otherwise count as step memory), then malloc_trim hands the freed
        # heap back, so the baseline holds no reusable free memory
        batch_data["x"], batch_data["y"] = x[:2], y[:2]
        step()
        batch_data["x"], batch_data["y"] = x, y
        if device.type == "cpu":
            _malloc_trim()
    state = persistent_state_bytes(model, opt)
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
        base = proc_status_kb("VmRSS") * 1024
        step()
        peak = proc_status_kb("VmHWM") * 1024 - base
    step_s = time.perf_counter() - t0
    if warmup:
        how += ", after a 2-sample warm-up step" + (" and malloc_trim" if device.type == "cpu" else "")
    alloc = int(peak) if device.type == "cuda" else (cpu_alloc_peak(step) if alloc_peak else None)
    return dict(method=method, config=config, batch=batch, T=T, peak_bytes=int(peak), alloc_peak_bytes=alloc, step_s=step_s,
                state_bytes=state["total"], state=state,
                how=how, chunk=chunk if "batched" in method else None, k=k if method in SZO_METHODS else None,
                time_chunk=time_chunk if streaming else None, stream_bn=stream_bn if streaming else None)


def persistent_state_bytes(model: torch.nn.Module, opt) -> dict:
    """Bytes the training holds between steps, outside the step peak: the weights and buffers,
    the optimizer's state tensors (momentum: d floats for SGD / full-space ZO, k for SZO) and,
    for SZO, the basis P (k x d floats). Counted from the tensors themselves, each storage once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                n += t.untyped_storage().nbytes()
        return n

    def state_tensors(o):
        for st in list(getattr(o, "state", {}).values()) + [getattr(o, "subspace_state", {})]:
            if isinstance(st, dict):
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))
            elif isinstance(st, torch.Tensor):
                yield st

    out = {"weights": size(model.parameters()), "buffers": size(model.buffers())}
    space = getattr(opt, "space", None)  # SZO's SubspaceSpace keeps P^T [k, d] row-contiguous
    basis = getattr(space, "basis_t", None)
    out["basis"] = size([basis]) if basis is not None else 0
    out["optimizer"] = size(state_tensors(opt))
    out["total"] = sum(out.values())
    return out


def run_point(method: str, batch: int, T: int, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--batch", str(batch), "--T", str(T),
           "--chunk", str(a.chunk), "--threads", str(a.threads), "--device", a.device, "--k", str(a.k),
           "--time-chunk", str(a.time_chunk), "--stream-bn", a.stream_bn, "--config", a.config]
    cmd += (["--no-warmup"] if a.no_warmup else []) + (["--no-alloc"] if a.no_alloc else [])
    env = dict(os.environ)
    if a.malloc_mmap_threshold is not None:
        # glibc: a fixed threshold turns off the dynamic one, so freed tensors above it go
        # straight back to the OS instead of fragmenting the heap (slower: fresh pages each time)
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_mmap_threshold)
    row = run_json_worker(cmd, env)
    if a.malloc_mmap_threshold is not None:
        row["how"] += f", MALLOC_MMAP_THRESHOLD_={a.malloc_mmap_threshold}"
        row["malloc_mmap_threshold"] = a.malloc_mmap_threshold
    return row


def _metrics(rows: list[dict]) -> list[tuple[str, str]]:
    """(row key, label) of the memory measures present: CPU peak RSS and allocator peak, or CUDA."""
    if rows and str(rows[0].get("how", "")).startswith("cuda"):
        return [("peak_bytes", "CUDA max_memory_allocated")]
    out = [("peak_bytes", "peak RSS")]
    if any(r.get("alloc_peak_bytes") is not None for r in rows):
        out.append(("alloc_peak_bytes", "allocator peak"))
    if any(r.get("state_bytes") is not None for r in rows):
        out.append(("total_bytes", "persistent state + step peak RSS"))
    return out


def _get(rows: list[dict], key: str) -> dict:
    if key == "total_bytes":  # what the device must hold: weights, optimizer state, P, plus the step's peak
        return {(r["method"], r["batch"], r["T"]): r["state_bytes"] + r["peak_bytes"] for r in rows
                if r.get("state_bytes") is not None}
    return {(r["method"], r["batch"], r["T"]): r[key] for r in rows if r.get(key) is not None}


def plot(rows: list[dict], path: Path) -> None:
    """Paper Fig. 5 layout: (a) memory vs batch size at the largest T, (b) memory vs T at the
    largest batch; one line per method; one row of panels per memory measure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    batches = sorted({r["batch"] for r in rows})
    Ts = sorted({r["T"] for r in rows})
    tmax, bmax = max(Ts), max(batches)
    metrics = _metrics(rows)
    fig, axes = plt.subplots(len(metrics), 2, figsize=(10, 3.8 * len(metrics)), squeeze=False)
    for (key, label), (ax_b, ax_t) in zip(metrics, axes):
        get = {k: v / 2**20 for k, v in _get(rows, key).items()}
        for meth in methods:
            bs = [b for b in batches if (meth, b, tmax) in get]
            ax_b.plot(bs, [get[(meth, b, tmax)] for b in bs], "o-", label=meth)
            ts = [t for t in Ts if (meth, bmax, t) in get]
            ax_t.plot(ts, [get[(meth, bmax, t)] for t in ts], "o-", label=meth)
        ax_b.set_title(f"(a) {label} vs batch size (T={tmax})", fontsize=10)
        ax_b.set_xlabel("batch size")
        ax_b.set_xticks(batches)
        ax_t.set_title(f"(b) {label} vs time steps (batch {bmax})", fontsize=10)
        ax_t.set_xlabel("time steps T")
        ax_t.set_xticks(Ts)
        for ax, ticks in ((ax_b, batches), (ax_t, Ts)):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_ylabel("MiB" if key == "total_bytes" else "MiB above baseline, one step")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    model = {"resnet20": "Spike-ResNet20", "resnet18": "Spike-ResNet18"}.get(rows[0].get("config", "resnet20"))
    fig.suptitle(f"{model}, memory of one training step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    """Markdown table: one row per (batch, T), one column per method; MiB (RSS / allocator peak)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    metrics = _metrics(rows)
    gets = [_get(rows, key) for key, _ in metrics]
    lines = [f"MiB: {' / '.join(label for _, label in metrics)}",
             "| batch | T | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for b, T in sorted({(r["batch"], r["T"]) for r in rows}):
        cells = [" / ".join(f"{g[(m, b, T)] / 2**20:.0f}" if (m, b, T) in g else "-" for g in gets)
                 for m in methods]
        lines.append(f"| {b} | {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def state_table(rows: list[dict]) -> str:
    """Persistent training state per method (MiB): weights, buffers, optimizer state, basis P."""
    lines = ["Persistent state between steps, MiB (not in the step peaks above):",
             "| method | weights | buffers | optimizer state | basis P | total |", "|---|---|---|---|---|---|"]
    done = set()
    for r in rows:
        st = r.get("state")
        if not st or r["method"] in done:
            continue
        done.add(r["method"])
        k = f" (k={r['k']})" if r.get("k") else ""
        lines.append(f"| {r['method']}{k} | " + " | ".join(f"{st[key] / 2**20:.2f}" for key in
                                                          ("weights", "buffers", "optimizer", "basis", "total")) + " |")
    return "\n".join(lines) if done else ""


def checks_for(rows: list[dict]) -> dict:
    """The two targets at the largest batch, for every SZO series and memory measure."""
    checks = {}
    for key, label in _metrics(rows):
        get = _get(rows, key)
        if not get:
            continue
        bmax = max(b for (_, b, _) in get)
        Ts = sorted({T for (_, b, T) in get if b == bmax})
        tmin, tmax = Ts[0], Ts[-1]
        for meth in SZO_METHODS:
            if (meth, bmax, tmax) in get and (meth, bmax, tmin) in get and tmax > tmin:
                flat = get[(meth, bmax, tmax)] / max(1, get[(meth, bmax, tmin)])
                checks[f"{label}: {meth} T={tmax}/T={tmin} (batch {bmax}) <= 1.3"] = dict(value=flat, met=flat <= 1.3)
            if (meth, bmax, tmax) in get and ("bptt", bmax, tmax) in get:
                frac = get[(meth, bmax, tmax)] / max(1, get[("bptt", bmax, tmax)])
                checks[f"{label}: {meth}/bptt at T={tmax}, batch {bmax} <= 0.25"] = dict(value=frac,
                                                                                         met=frac <= 0.25)
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid: batch {16,32} x T {1,4}")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--config", default="resnet20", choices=["resnet20", "resnet18"],
                    help="Spike-ResNet20 (CIFAR-10 shape) or Spike-ResNet18 (CIFAR-100 shape)")
    ap.add_argument("--chunk", type=int, default=4, help="copies per batched pass")
    ap.add_argument("--k", type=int, default=2, help="SZO subspace dimension (2k probes per step)")
    ap.add_argument("--time-chunk", type=int, default=1, help="time steps per chunk of the *-stream methods")
    ap.add_argument("--stream-bn", default="running", choices=STREAM_BN_MODES,
                    help="train-mode BN policy of the *-stream methods (szo.models.streaming)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="measure the first step (default: a 2-sample warm-up step and malloc_trim first)")
    ap.add_argument("--no-alloc", action="store_true",
                    help="CPU: skip the second, profiled step that measures the allocator peak")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="CPU: run workers with glibc MALLOC_MMAP_THRESHOLD_=BYTES (fixed; default: dynamic)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="result name in bench/results/ (default memory / memory_quick)")
    ap.add_argument("--merge", action="store_true", help="add to the existing result of the same name")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG / table / checks of --out from its JSON")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    if a.replot:
        name = a.out or ("memory_quick" if a.quick else "memory")
        rows = json.loads((RESULTS / f"{name}.json").read_text())["rows"]
        for kname, v in checks_for(rows).items():
            print(f"{kname}: {v['value']:.3f} {'MET' if v['met'] else 'NOT MET'}")
        print(table(rows))
        print(state_table(rows))
        plot(rows, RESULTS / f"{name}.png")
        return 0
    if a.worker:
        print(json.dumps(worker(a.worker, a.batch[0], a.T[0], a.chunk, torch.device(a.device), k=a.k,
                                time_chunk=a.time_chunk, stream_bn=a.stream_bn, warmup=not a.no_warmup,
                                alloc_peak=not a.no_alloc, config=a.config)))
        return 0
    if a.quick:
        a.batch, a.T = [16, 32], [1, 4]
    name = a.out or ("memory_quick" if a.quick else "memory")
    old_rows, old_wall = [], 0.0
    if a.merge and (RESULTS / f"{name}.json").exists():
        old = json.loads((RESULTS / f"{name}.json").read_text())
        old_rows, old_wall = old["rows"], float(old.get("wall_s", 0.0))
    t0 = time.perf_counter()
    rows = []
    for b in a.batch:
        for T in a.T:
            for meth in a.methods:
                r = run_point(meth, b, T, a)
                rows.append(r)
                alloc = r.get("alloc_peak_bytes")
                print(f"{meth:18s} batch {b:4d} T {T:3d} peak {r['peak_bytes']/2**20:9.1f} MiB"
                      + (f", allocator peak {alloc/2**20:9.1f} MiB" if alloc is not None else "")
                      + f" ({r['step_s']:.1f}s)", flush=True)
    new_keys = {(r["method"], r["batch"], r["T"]) for r in rows}
    rows = [r for r in old_rows if (r["method"], r["batch"], r["T"]) not in new_keys] + rows
    checks = checks_for(rows)
    for kname, v in checks.items():
        print(f"{kname}: {v['value']:.3f} {'MET' if v['met'] else 'NOT MET'}")
    out = dict(benchmark="memory", quick=a.quick, args=vars(a), machine=machine_info(), rows=rows,
               checks=checks, wall_s=old_wall + time.perf_counter() - t0)
    print(table(rows))
    print(state_table(rows))
    print("wrote", write_result(name, out), f"in {time.perf_counter() - t0:.0f}s")
    plot(rows, RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
