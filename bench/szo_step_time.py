"""CPU time of SZO.step alone (SZO-RGE q=10, Spike-ResNet20, T=4, batch 32, one thread), the
quantity behind bench/reference.py's szo/fwd without the forward it is divided by. Run it from two
checkouts alternately to compare commits (docs/performance.md, "The step after the core landed"):

    for i in 1 2 3; do for d in OLD NEW; do (cd $d && OMP_NUM_THREADS=1 python bench/szo_step_time.py); done; done
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RandomSubspace, make_batch, make_model, set_threads  # noqa: E402

from szo.losses import tet_loss  # noqa: E402
from szo.optim import SZO  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps after one warm-up step (default 8)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    set_threads(1)
    model, shape = make_model("resnet20", 4, torch.device("cpu"))
    x, y = make_batch(shape, 32, torch.device("cpu"))
    opt = SZO(model.parameters(), RandomSubspace(model.num_params(), 20), mu=1e-3, lr=1e-3, momentum=0.9,
              estimator="rge", q=10, model=model, generator=torch.Generator().manual_seed(0), scale="absolute")

    def step():
        opt.step(lambda: tet_loss(model(x), y))

    step()
    ts = []
    for _ in range(a.steps):
        t0 = time.process_time()
        step()
        ts.append(time.process_time() - t0)
    print(f"{os.getcwd()}: SZO.step CPU s median {statistics.median(ts):.3f}, min {min(ts):.3f}, "
          f"each {' '.join(f'{t:.2f}' for t in ts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
