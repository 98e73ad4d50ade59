"""AsyncFGD speed-up (seed 001, Sec. 6.4): the K-stage asynchronous pipeline vs synchronous FGD (K = 1).

spike_convnet on the 8x8 digits, cut into K stages (``szo.asyncfgd.split_stages``), one
process per stage (gloo, one torch thread each), trained with forward gradients for
``--epochs`` epochs of micro-batches of ``--batch``; the synchronous baseline is the same
code with K = 1 (one process runs the whole JVP forward: vanilla FGD). Reports the wall time
of the training loop (last stage, between a barrier before and the last update), micro-batches
per second, the speed-up and the test accuracy of the trained model (gathered on rank 0).

    python bench/asyncfgd.py                 # K = 1 and K = 2, 3 epochs, batch 16
    python bench/asyncfgd.py --K 1 2 3 --epochs 1 --batch 4

With K processes on fewer than K free cores the stages time-share and the speed-up shrinks:
the JSON records the core count and load average next to the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_result  # noqa: E402

import szo.models as M  # noqa: E402
from szo.asyncfgd import gather_stages, reference_async_fgd, run_stage, split_stages  # noqa: E402
from szo.data import get_dataset  # noqa: E402
from szo.distributed import shutdown  # noqa: E402
from szo.losses import tet_loss  # noqa: E402


def _tensors(split: str):
    ds = get_dataset("digits", split)
    xs, ys = zip(*[ds[i] for i in range(len(ds))])
    return torch.stack(xs), torch.tensor(ys)


def _batches(x, y, batch: int, epochs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        out += [(x[perm[i:i + batch]], y[perm[i:i + batch]]) for i in range(0, len(y) - batch + 1, batch)]
    return out


def _model(T: int):
    torch.manual_seed(0)
    return M.create("spike_convnet", num_classes=10, T=T)


def _worker(rank, K, init_file, out_file, args, batches, test):
    torch.set_num_threads(args.threads)
    if K > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=K)
    try:
        model = _model(args.T)
        stages = split_stages(model, K)
        encode = lambda x: x.unsqueeze(0).repeat(args.T, 1, 1, 1, 1)  # noqa: E731  direct encoding over T
        if K > 1:
            dist.barrier()
        t0 = time.perf_counter()
        res = run_stage(stages[rank], rank, K, batches, tet_loss, lr=args.lr, seed=args.seed, encode=encode)
        wall = time.perf_counter() - t0
        if K > 1:
            walls = [torch.zeros(1, dtype=torch.float64) for _ in range(K)]
            dist.all_gather(walls, torch.tensor([wall], dtype=torch.float64))
            wall = max(float(w) for w in walls)
        gather_stages(stages, rank, K)
        if rank == 0:
            model.eval()
            with torch.no_grad():
                acc = float((model(test[0]).mean(0).argmax(1) == test[1]).float().mean())
            Path(out_file).write_text(json.dumps({"K": K, "wall_s": wall, "micro_batches": len(batches),
                                                  "micro_batches_per_s": len(batches) / wall, "test_acc": acc,
                                                  "final_loss_mean_last_epoch": sum(res["losses"][-20:]) / 20}))
    finally:
        if K > 1:
            shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--K", type=int, nargs="+", default=[1, 2], help="stage counts to run (1 = synchronous FGD)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="micro-batch size (the paper uses 4 for streaming input)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD step (Algorithm 1: no momentum)")
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--name", default="asyncfgd")
    args = p.parse_args(argv)
    if any(k < 1 for k in args.K):
        raise ValueError(f"--K values must be >= 1, got {args.K}")
    torch.set_num_threads(args.threads)
    x, y = _tensors("train")
    test = _tensors("test")
    batches = _batches(x, y, args.batch, args.epochs, args.seed)
    # check the stage chain is the model's forward, and warm up SpikingJelly's lazily scripted
    # functions before forking (every child would otherwise pay for it inside the timed loop)
    model = _model(args.T)
    xb = batches[0][0]
    with torch.no_grad():
        ref = model(xb)
        chain = torch.nn.Sequential(*split_stages(model, 1)[0])(xb.unsqueeze(0).repeat(args.T, 1, 1, 1, 1))
    if not torch.allclose(ref, chain, atol=1e-6):
        raise ValueError("spike_convnet's children do not chain to its forward; AsyncFGD needs a layer chain")
    reference_async_fgd(split_stages(_model(args.T), 1), batches[:1], tet_loss, lr=0.0,
                        encode=lambda v: v.unsqueeze(0).repeat(args.T, 1, 1, 1, 1))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for K in args.K:
            out = os.path.join(tmp, f"K{K}.json")
            mp.start_processes(_worker, args=(K, os.path.join(tmp, f"init{K}"), out, args, batches, test), nprocs=K,
                               join=True, start_method="fork")
            runs.append(json.loads(Path(out).read_text()))
            print(f"K={K}: {runs[-1]['wall_s']:.2f} s for {len(batches)} micro-batches "
                  f"({runs[-1]['micro_batches_per_s']:.1f}/s), test acc {100 * runs[-1]['test_acc']:.2f} %", flush=True)
    base = next((r for r in runs if r["K"] == 1), None)
    if base is not None:
        for r in runs:
            r["speedup_vs_sync"] = base["wall_s"] / r["wall_s"]
    result = {"bench": "asyncfgd", "args": vars(args), "machine": machine_info(), "runs": runs}
    path = write_result(args.name, result)
    print(json.dumps({r["K"]: round(r.get("speedup_vs_sync", float("nan")), 3) for r in runs}), "->", path)
    return result


if __name__ == "__main__":
    main()
