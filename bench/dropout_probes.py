"""Train-mode dropout in the probes: how close SZO's estimate is to the dropout-free one (issue 40 item 9).

A probe pair must compare one network at two points. Before szo replayed the step's random state,
train-mode dropout drew new masks for every probe, so ``L(theta + mu v) - L(theta - mu v)`` also
measured the difference between two random networks, which the division by ``2 mu`` amplifies at
small mu. Now every forward of a step draws the step's masks (``szo.zo.guard.RandomReplay``).

Setup: the own-loop network of examples/own_loop.py (digits, T = 4, Conv -> BN -> LIF -> Linear) with
SpikingJelly's ``layer.Dropout(p)`` after the LIF (one mask per sequence), a k = 8 subspace of a
3-epoch BPTT trajectory of the same network (with dropout), at its reference (the first sample).
On each of ``--batches`` batches of 32 digits (after the 22 the BPTT run trained on), SZO-CGE's coordinate estimate ``g_c`` (``SZO.plan``,
``SZO.evaluate``, ``Plan.estimate``: no step is taken) three ways:

* ``free``: the dropout layer in eval mode (the dropout-free estimate, the reference);
* ``fresh masks``: train mode, a new mask for every probe (the earlier behaviour: the guard's random
  replay switched off);
* ``replayed``: train mode, every probe with the step's mask (szo now).

and, for scale, the cosine of the projected BPTT gradient ``P^T grad`` with one train-mode mask to
the dropout-free one (what any single dropout mask does to a gradient). Reported: the mean cosine
to ``free`` over the batches (and its standard deviation), at each ``--mu`` (absolute units; 1.0 is
SZO's default).

    OMP_NUM_THREADS=1 python bench/dropout_probes.py            # p 0.2 and 0.5, mu 1e-3 and 1.0, 20 batches

Writes bench/results/dropout_probes.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, set_threads, write_result  # noqa: E402

from subspace_store import build_subspace  # noqa: E402
from szo.data import get_dataset  # noqa: E402
from szo.optim import SZO  # noqa: E402

T = 4


def make_model(p: float) -> nn.Module:
    net = nn.Sequential(layer.Conv2d(1, 8, 3, padding=1, bias=False), layer.BatchNorm2d(8), neuron.LIFNode(tau=2.0),
                        layer.Dropout(p), layer.Flatten(), layer.Linear(8 * 8 * 8, 10))
    functional.set_step_mode(net, "m")
    return net


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.mean(0), y)


def batches(n: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ds = get_dataset("digits", "train")
    x = torch.stack([ds[i][0] for i in range(n * size)])
    y = torch.tensor([int(ds[i][1]) for i in range(n * size)])
    return [(x[i:i + size].unsqueeze(0).repeat(T, 1, 1, 1, 1), y[i:i + size]) for i in range(0, n * size, size)]


def trajectory_subspace(p: float, train: list, k: int, epochs: int = 3):
    torch.manual_seed(0)
    net = make_model(p).train()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    samples = [torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()]
    for _ in range(epochs):
        for i, (x, y) in enumerate(train):
            functional.reset_net(net)
            sgd.zero_grad()
            loss_fn(net(x), y).backward()
            sgd.step()
            if i % 4 == 3:
                samples.append(torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone())
    return build_subspace(samples, k, reference="first", progress=False)


class FreshMasks:
    """The guard's random replay switched off: every forward draws its own masks (the earlier behaviour)."""

    def snapshot(self) -> None:
        pass

    def restore(self) -> None:
        pass


def dropout_layers(net: nn.Module) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, layer.Dropout)]


def estimate(net: nn.Module, sub, mu: float, x, y, *, mode: str) -> torch.Tensor:
    """SZO-CGE's g_c at the subspace reference: ``mode`` free / fresh / replayed."""
    opt = SZO(net, sub, mu=mu, estimator="cge", scale="absolute")  # moves the network to sub.reference
    for m in dropout_layers(net):
        m.train(mode != "free")
    if mode == "fresh":
        opt.guard.random = FreshMasks()
    plan = opt.plan()
    return plan.estimate(opt.evaluate(lambda: loss_fn(net(x), y), plan))


def bptt_projection(net: nn.Module, sub, x, y, *, dropout: bool) -> torch.Tensor:
    for m in dropout_layers(net):
        m.train(dropout)
    net.zero_grad()
    functional.reset_net(net)
    loss_fn(net(x), y).backward()
    functional.reset_net(net)
    g = torch.cat([q.grad.reshape(-1) for q in net.parameters()]).double()
    return sub.basis.double().t() @ g


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=float, nargs="+", default=[0.2, 0.5], help="dropout probabilities")
    ap.add_argument("--mu", type=float, nargs="+", default=[1e-3, 1.0], help="probe lengths (absolute)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    data = batches(a.batches + 22)
    train, probe = data[:22], data[22:]
    rows = []
    for p in a.p:
        sub = trajectory_subspace(p, train, a.k)
        net = make_model(p).train()
        bptt = [cos(bptt_projection(net, sub, x, y, dropout=True), bptt_projection(net, sub, x, y, dropout=False))
                for x, y in probe]
        for mu in a.mu:
            cosines: dict[str, list[float]] = {"fresh": [], "replayed": []}
            for b, (x, y) in enumerate(probe):
                free = estimate(net, sub, mu, x, y, mode="free")
                for mode in cosines:
                    torch.manual_seed(1000 + b)  # the same global random state for both modes
                    cosines[mode].append(cos(estimate(net, sub, mu, x, y, mode=mode), free))
            row = {"p": p, "mu": mu, "batches": len(probe),
                   **{f"{m}_mean": statistics.fmean(v) for m, v in cosines.items()},
                   **{f"{m}_std": statistics.pstdev(v) for m, v in cosines.items()},
                   "bptt_one_mask_mean": statistics.fmean(bptt), "bptt_one_mask_std": statistics.pstdev(bptt)}
            rows.append(row)
            print(row, flush=True)
    out = write_result("dropout_probes", {"rows": rows, "k": a.k, "T": T, "machine": machine_info(),
                                          "command": "OMP_NUM_THREADS=1 python bench/dropout_probes.py "
                                          + " ".join(argv if argv is not None else sys.argv[1:])})
    print("\n| dropout p | mu | fresh masks per probe (before) | the step's masks replayed (now) | "
          "BPTT, one mask vs none |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['p']} | {r['mu']:g} | {r['fresh_mean']:.2f} ± {r['fresh_std']:.2f} | "
              f"{r['replayed_mean']:.2f} ± {r['replayed_std']:.2f} | "
              f"{r['bptt_one_mask_mean']:.2f} ± {r['bptt_one_mask_std']:.2f} |")
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
