"""Forward and SZO-step time against torch's intra-op thread count, and the thread policy's choice
(``szo.threads``, ``threads: auto``), quiet and under a synthetic load (issue 50).

For each network (the demo's digits ConvNet, Spike-ResNet8, Spike-ResNet20) and each machine state
(``quiet``: as found; ``loaded``: two busy processes started here, one pure-Python spin loop each):

* the policy decides first, exactly as a run does at its start (``szo.threads.choose_threads`` timing
  ``szo.threads.fit_workload``'s forward on one batch at 1 ... cores threads);
* then every thread count is timed, alternating counts round by round so they see the same load: one
  no-grad forward, one SZO-CGE step on the loop engine (``SZO.step``, a random orthonormal subspace, the
  BN forward of ``bn_update=recompute`` included) and the same step with its probes folded into the batch
  (the batched engine, ``ProbePath(engine="batched")``: cores spent across probes);
* ``policy / best`` = the time at the policy's count over the best count's, per cell (goal <= 1.1).

The machine's load average is recorded per cell: on a machine shared with other jobs "quiet" is not
quiet, so say so with the figures. Not a test: nothing here asserts a time.

    python bench/threads.py --quick        # digits b64 k20, ResNet8 b16 k8, ResNet20 b8 k4; ~3-5 min on 2 cores
    python bench/threads.py                # digits b64 k20, ResNet8 b32 k20, ResNet20 b32 k20
    python bench/threads.py --states quiet # the quiet half only
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RandomSubspace, machine_info, make_batch, write_result  # noqa: E402

from szo.evaluators import Batch  # noqa: E402
from szo.losses import tet_loss  # noqa: E402
from szo.models import create  # noqa: E402
from szo.optim import SZO  # noqa: E402
from szo.threads import candidate_threads, choose_threads, fit_workload  # noqa: E402
from szo.zo import ProbePath  # noqa: E402

# name -> (model, kwargs, input (C, H), classes, (batch, k) full, (batch, k) quick)
NETS = {
    "digits": ("spike_convnet", {"width": 16, "bn_time": "shared"}, (1, 8), 10, (64, 20), (64, 20)),
    "resnet8": ("spike_resnet8", {}, (3, 32), 10, (32, 20), (16, 8)),
    "resnet20": ("spike_resnet20", {}, (3, 32), 10, (32, 20), (8, 4)),
}


def _spin() -> None:  # one busy process of the synthetic load
    while True:
        pass


def _median_by_count(fns: dict[str, callable], counts: list[int], rounds: int,
                     budget_s: float) -> dict[str, dict[int, float]]:
    """Median seconds of each fn at each thread count, counts alternating per round; round 0 warms up
    and is kept as the only sample when it says more rounds would exceed ``budget_s`` (a loaded machine
    can make one 2-thread step take seconds)."""
    out = {name: {n: [] for n in counts} for name in fns}
    prev = torch.get_num_threads()
    try:
        r, total = 0, rounds + 1
        while r < total:
            t_round = time.perf_counter()
            for n in counts:
                torch.set_num_threads(n)
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    out[name][n].append(time.perf_counter() - t)
            if r == 0:
                warm = time.perf_counter() - t_round
                total = 1 + min(rounds, int(budget_s / warm))
                if total > 1:
                    for d in out.values():  # drop the warm-up
                        for v in d.values():
                            v.clear()
            r += 1
    finally:
        torch.set_num_threads(prev)
    return {name: {n: statistics.median(v) for n, v in d.items()} for name, d in out.items()}


def bench_net(net: str, quick: bool, rounds: int, engines: list[str], budget_s: float) -> dict:
    name, kw, (c, h), ncls, full, small = NETS[net]
    batch, k = small if quick else full
    torch.manual_seed(0)
    model = create(name, num_classes=ncls, T=4, in_channels=c, **kw).train()
    x, y = make_batch((c, h, ncls), batch, torch.device("cpu"))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    t0 = time.perf_counter()
    choice = choose_threads("auto", fit_workload(model, loader, "cpu", backward=False))
    decide_s = time.perf_counter() - t0
    sub = RandomSubspace(model.num_params(), k)
    fns = {}

    @torch.no_grad()
    def fwd():
        model(x)

    fns["forward"] = fwd
    state = {kk: v.clone() for kk, v in model.state_dict().items()}
    for engine in engines:
        opt = SZO(model.parameters(), sub, mu=1e-3, lr=0.0, momentum=0.0, estimator="cge", model=model, scale="absolute",
                  generator=torch.Generator().manual_seed(0), probes=ProbePath(engine=engine))
        probe_batch = Batch(x, y, tet_loss)  # not `batch`: that is the batch size the cell records
        fns[f"step_{engine}"] = (lambda o=opt, b=probe_batch: o.step(b.closure(model), batch=b))
    load0 = os.getloadavg()[0]
    times = _median_by_count(fns, candidate_threads(), rounds, budget_s)
    model.load_state_dict(state)
    cell = {"net": net, "model": name, "batch": batch, "T": 4, "k": k, "params": model.num_params(),
            "policy": choice.record(), "policy_decide_s": decide_s, "loadavg_1m": [load0, os.getloadavg()[0]],
            "times_s": {kk: {str(n): t for n, t in v.items()} for kk, v in times.items()}}
    for what, by_n in times.items():
        best = min(by_n, key=by_n.get)
        cell[f"{what}_best_threads"] = best
        cell[f"{what}_policy_over_best"] = by_n[choice.threads] / by_n[best]
    return cell


def _table(cells: list[dict]) -> str:
    counts = sorted({int(n) for c in cells for n in c["times_s"]["forward"]})
    head = ("| state | net (batch, k) | load | what | " + " | ".join(f"{n} thr (ms)" for n in counts)
            + " | policy | policy / best |")
    lines = [head, "|" + "---|" * (6 + len(counts))]
    for c in cells:
        for what, by_n in c["times_s"].items():
            vals = " | ".join(f"{1e3 * by_n[str(n)]:.1f}" if str(n) in by_n else "-" for n in counts)
            lines.append(f"| {c['state']} | {c['net']} ({c['batch']}, {c['k']}) | {c['loadavg_1m'][0]:.1f} | {what} "
                         f"| {vals} | {c['policy']['threads']} | {c[f'{what}_policy_over_best']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller batches and subspaces (a few minutes on 2 cores)")
    ap.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    ap.add_argument("--states", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per thread count (default 5, quick 3)")
    ap.add_argument("--busy", type=int, default=2, help="busy processes of the loaded state")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed rounds per net and state (default 60, quick 25); 1 round when exceeded")
    ap.add_argument("--engines", nargs="+", default=["loop", "batched"], choices=["loop", "batched"])
    a = ap.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS"):
        print("note: OMP_NUM_THREADS is set; the policy would keep it in a run, here it is timed anyway", flush=True)
    rounds = a.rounds or (3 if a.quick else 5)
    cells = []
    for state in a.states:
        busy = []
        if state == "loaded":
            ctx = mp.get_context("spawn")
            busy = [ctx.Process(target=_spin, daemon=True) for _ in range(a.busy)]
            for p in busy:
                p.start()
            time.sleep(2.0)
        try:
            for net in a.nets:
                cell = bench_net(net, a.quick, rounds, a.engines, a.budget or (25.0 if a.quick else 60.0))
                cell["state"] = state
                cells.append(cell)
                print(_table([cell]).split("\n", 2)[2], flush=True)  # its rows
        finally:
            for p in busy:
                p.terminate()
                p.join()
    table = _table(cells)
    print(table)
    path = write_result("threads" + ("_quick" if a.quick else ""),
                        {"machine": machine_info(), "quick": a.quick, "rounds": rounds, "cells": cells, "table": table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
