"""Seed 004's setting: adapt a pretrained classifier to a corruption on an MCU, integer vs float.

The pretrained model (a BP run's ``model.safetensors``, BN statistics included) is converted to
the fixed-point backend, its weights frozen to int8 (``FixedPointNetwork.freeze_weights``), and
trained on the corrupted *train* split with ``szo.hw.optim.mcu.MCUZO`` (1-LSB XORShift32 Rademacher
probes, layer-wise adaptive WP/NP, eq. 8); accuracy on the corrupted *test* split before and
after. ``--blocks B``: first the paper's BP-free block selection (Sec. 3.3.1: one epoch of test
training per block from the same integers, or ``--select-steps`` steps; gain of held-out accuracy on
the last 10 % of the corrupted train split), then only the chosen block trains (sparse). The recipe
``digits-c-mcu`` runs the same selection as a stage (``szo.prepare.block_selection_stage``). ``--float``: the
same budget (steps, batch, q, layers) with the float layer-wise learner (``LayerwiseZO``,
adaptive, Gaussian, momentum 0.9, the recipes' mu 0.1) and with BP (SGD) on the float model.

    python bench/mcu_learner.py --dataset digits --pretrained RUN/bptt --steps 60 --float
    python bench/mcu_learner.py --dataset digits --pretrained RUN/bptt --blocks 4 --q 100 --lr 0.01 --batch 100
    python bench/mcu_learner.py --dataset mnist5k --pretrained RUN/bptt --layers fc --batch 16 --steps 40

Writes bench/results/mcu_learner_<dataset>[_<name>].json and prints one markdown row per learner.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from szo.build import load_run_model
from szo.data import get_dataset
from szo.hw import to_fixed
from szo.hw.optim.mcu import MCUZO, select_block, split_blocks
from szo.hw.reports.memory import layer_dims
from szo.optim import LayerwiseZO
from szo.train import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info, write_result  # noqa: E402


def loss_fn(out, y, reduction="mean"):
    return F.cross_entropy(out.mean(0), y, reduction=reduction)


def accuracy(net, loader) -> float:
    return evaluate(net, loader, loss_fn)[1]


def batches(ds, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        for x, y in DataLoader(ds, batch_size=batch, shuffle=True, generator=g, drop_last=True):
            out.append((x, y))
            if len(out) == steps:
                break
    return out


def pretrained(run: Path):
    return load_run_model(run)[0].eval()  # the BP run's model: parameters and BN statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["digits", "mnist5k"], default="digits")
    p.add_argument("--pretrained", type=Path, required=True, help="a BP run directory holding model.safetensors")
    p.add_argument("--corruption", default="gaussian_noise")
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--q", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1, help="eq. 8's global rate")
    p.add_argument("--layers", nargs="+", default=None, help="train only these synapses (sparse)")
    p.add_argument("--blocks", type=int, default=0, help="select one of this many blocks first (0: no selection)")
    p.add_argument("--select-steps", type=int, default=None,
                   help="test-training steps per block (default: one epoch of the training part, the paper's)")
    p.add_argument("--float", action="store_true", help="also the float layer-wise learner and BP, same budget")
    p.add_argument("--float-lr", type=float, default=0.01)
    p.add_argument("--bp-lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    opts = dict(corruption=a.corruption, severity=a.severity)
    train = get_dataset(f"{a.dataset}-c", "train", **opts)
    n_held = len(train) // 10
    fit_set, held_set = Subset(train, range(len(train) - n_held)), Subset(train, range(len(train) - n_held, len(train)))
    test = DataLoader(get_dataset(f"{a.dataset}-c", "test", **opts), batch_size=256)
    held = DataLoader(held_set, batch_size=256)
    rows: dict[str, dict] = {}

    source = pretrained(a.pretrained)
    net = to_fixed(source)
    x0 = fit_set[0][0].unsqueeze(0)
    net(x0)
    net.freeze_weights()
    synapses = list(net.int_weights)
    before_int = accuracy(net, test)
    layers = a.layers
    selection = None
    if a.blocks:
        blocks = split_blocks(synapses, a.blocks)
        t = time.perf_counter()
        steps = a.select_steps if a.select_steps is not None else len(fit_set) // a.batch  # one epoch (drop_last)
        selection = select_block(net, blocks, batches(fit_set, a.batch, steps, a.seed + 1),
                                 lambda: accuracy(net, held), loss_fn,
                                 lambda ls: MCUZO(net, layers=ls, q=a.q, lr=a.lr, seed=a.seed + 1))
        selection.update(blocks=blocks, time_s=time.perf_counter() - t)
        layers = blocks[selection["block"]]
        print(f"block selection: gains {[round(g * 100, 2) for g in selection['gains']]} -> block "
              f"{selection['block'] + 1} {layers} ({selection['forwards']} forwards, {selection['time_s']:.0f} s)")
    data = batches(fit_set, a.batch, a.steps, a.seed)
    start = {n: (s.w_int.clone(), s.bias_mant) for n, s in net.int_weights.items()}
    opt = MCUZO(net, layers=layers, q=a.q, lr=a.lr, seed=a.seed + 1)
    t = time.perf_counter()
    for x, y in data:
        opt.step(lambda x=x, y=y: loss_fn(net(x), y, reduction="none"))
    rows["mcu-zo (int8)"] = {"before": before_int, "after": accuracy(net, test), "forwards": opt.forward_passes,
                             "time_s": time.perf_counter() - t, "layers": opt.layer_paths, "modes": opt.mode_names,
                             "memory_bytes": opt.memory_bytes(a.batch), "saturations": opt.counter.total(),
                             "moved": {n: {"weights": int((net.int_weights[n].w_int != w).sum()), "of": w.numel(),
                                           "biases": None if b is None else int((net.int_weights[n].bias_mant != b).sum())}
                                       for n, (w, b) in start.items() if n in opt.layers}}
    if a.float:
        model = pretrained(a.pretrained)
        before = accuracy(model, test)
        lw = LayerwiseZO(model, perturbation="adaptive", layers=layers, mu=0.1, lr=a.float_lr, momentum=0.9, q=a.q,
                         generator=torch.Generator().manual_seed(a.seed + 1))
        t = time.perf_counter()
        for x, y in data:
            model.eval()
            lw.step(lambda x=x, y=y: loss_fn(model(x), y, reduction="none"))
        rows["awp-zo (float)"] = {"before": before, "after": accuracy(model, test), "forwards": lw.forward_passes,
                                  "time_s": time.perf_counter() - t, "layers": list(lw.layers)}
        model = pretrained(a.pretrained)
        names = set(layers or synapses)
        params = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in names]
        sgd = torch.optim.SGD(params, lr=a.bp_lr, momentum=0.9)
        t = time.perf_counter()
        for x, y in data:
            model.eval()  # deployed BN statistics, as the integer network's folded BN
            sgd.zero_grad()
            loss_fn(model(x), y).backward()
            sgd.step()  # the model resets its neurons after every forward
        rows["bp (float)"] = {"before": before, "after": accuracy(model, test), "forwards": len(data),
                              "time_s": time.perf_counter() - t, "layers": sorted(names)}
    dims = layer_dims(source, x0)  # shapes only: training (written back into it) does not change them
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "rows": rows,
           "selection": selection, "layer_dims": [d.__dict__ for d in dims], "machine": machine_info()}
    name = f"mcu_learner_{a.dataset}" + (f"_{a.name}" if a.name else "")
    write_result(name, out)
    print(f"| learner | layers | test acc before -> after ({a.dataset}-c {a.corruption} {a.severity}) | #FP | time |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {', '.join(r['layers']) if r['layers'] else 'all'} | {r['before'] * 100:.2f} -> "
              f"{r['after'] * 100:.2f} % | {r['forwards']:,} | {r['time_s']:.0f} s |")
    moved = rows["mcu-zo (int8)"]["moved"]
    print("int8 weights / bias mantissas changed by mcu-zo: " + ", ".join(
        f"{n} {m['weights']}/{m['of']}" + ("" if m["biases"] is None else f" (biases {m['biases']})") for n, m in moved.items()))
    print(f"(results: {RESULTS / (name + '.json')})")


if __name__ == "__main__":
    main()
