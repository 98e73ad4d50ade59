"""How far 2 data-parallel ranks drift from 1 process, step by step, in float32 and float64.

Trains the ``digits-scratch`` model (SZO-CGE, its recipe's k, mu, momentum; constant lr 1) for
``--steps`` steps on the first batches of epoch 1, four times: 1 process and 2 gloo processes
(data mode, sync BN, the trainer's shard-loss weighting), each in float32 and in float64. Prints
per step the max |difference| of the parameters and of the probe losses. Data mode computes the
one-process objective exactly (float64: rounding-level agreement); in float32 a spike flipped by
a rounding difference moves a probe loss by a finite amount, so the float32 runs drift apart as
far as a one-process float32 run drifts from its float64 twin (docs/distributed.md).

The subspace must be in the store first, e.g. (7 s):

    szo recipe digits-scratch --set kind=bp --set bptt.epochs=3 --set trajectory.every=3 \\
        --set subspace.root=/tmp/sub --out /tmp/bp
    OMP_NUM_THREADS=1 python bench/distributed_drift.py --subspace-root /tmp/sub --steps 23

Writes bench/results/distributed_drift.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import machine_info, write_result

from szo.build import build_model, loaders_for, loss_for, subspace_store_for
from szo.config import load_recipe
from szo.optim import RunOptions, build_optimizer
from szo.pipeline import PAPER_UNITS  # SZO-CGE at App. G's mu 1 / lr 1: the settings the drift table was measured with
from szo.prepare import optimizer_options


def _run(sets: list[str], steps: int, dtype: torch.dtype, rank: int = 0, world: int = 1):
    torch.set_num_threads(1)
    cfg = load_recipe("digits-scratch", sets)
    train, _ = loaders_for(cfg, torch.Generator().manual_seed(int(cfg["seed"])), None)
    model = build_model(cfg)
    sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=model)
    model.load_flat_params(sub.reference)
    model.to(dtype).train()
    # the recipe's own options (mu, lr, scale, ...: optimizer_options), so the drift is the recipe's step
    opt = build_optimizer(cfg.method, model, subspace=sub, options=optimizer_options(cfg),
                          run=RunOptions(generator=torch.Generator().manual_seed(0),
                                         distributed="data" if world > 1 else None))
    loss_fn = loss_for(cfg)
    params, losses = [], []
    for i, (x, y) in enumerate(train):
        if i == steps:
            break
        n = y.shape[0]
        lo, hi = rank * n // world, (rank + 1) * n // world
        xs, ys, scale = x[lo:hi].to(dtype), y[lo:hi], world * (hi - lo) / n  # as szo.train.fit weights shards
        opt.step(lambda: loss_fn(model(xs), ys) * scale)
        params.append(torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]))
        losses.append(opt.last_losses.clone())
    return torch.stack(params), torch.stack(losses)


def _worker(rank: int, world: int, init: str, out: str, sets: list[str], steps: int, dtype: torch.dtype) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        p, losses = _run(sets, steps, dtype, rank, world)
        if rank == 0:
            torch.save({"params": p, "losses": losses}, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--subspace-root", required=True, help="subspace store holding digits-convnet-k20")
    ap.add_argument("--steps", type=int, default=23)
    args = ap.parse_args()
    sets = [f"subspace.root={args.subspace_root}", "progress=false", *PAPER_UNITS]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
            one = _run(sets, args.steps, dtype)
            out = os.path.join(tmp, f"{name}.pt")
            mp.spawn(_worker, args=(2, os.path.join(tmp, f"init_{name}"), out, sets, args.steps, dtype),
                     nprocs=2, join=True)
            two = torch.load(out, weights_only=True)
            got[name] = (one, (two["params"], two["losses"]))
    rows = []
    print("step | params 2 vs 1 f32 | f64 | 1 process f32 vs f64 | probe losses 2 vs 1 f32 | f64")
    for s in range(args.steps):
        (p32, l32), (q32, m32) = got["float32"]
        (p64, l64), (q64, m64) = got["float64"]
        row = {"step": s + 1,
               "params_2v1_float32": float((p32[s] - q32[s]).abs().max()),
               "params_2v1_float64": float((p64[s] - q64[s]).abs().max()),
               "params_1p_float32_vs_float64": float((p32[s] - p64[s]).abs().max()),
               "losses_2v1_float32": float((l32[s] - m32[s]).abs().max()),
               "losses_2v1_float64": float((l64[s] - m64[s]).abs().max())}
        rows.append(row)
        print(" | ".join([f"{s + 1:4d}"] + [f"{v:.2e}" for k, v in row.items() if k != "step"]))
    path = write_result("distributed_drift", {"machine": machine_info(), "steps": args.steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
