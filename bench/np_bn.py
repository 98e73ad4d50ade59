"""Node perturbation under train-mode BatchNorm: how far the per-sample estimate (seed 004
Algorithm 1) is from the gradient, with the BN statistics live or frozen during the probes.

``--cosine``: two smooth models with train-mode BN after the perturbed layer, float64, where
autograd gives the true gradient of the batch-mean loss (BN statistics included): a 10-32-4 tanh MLP
(``Linear -> BatchNorm1d -> tanh -> Linear``, N = 32 random inputs) and a tanh ConvNet on a batch
of 32 digits (``conv -> BN -> tanh`` twice, pool, linear; both convolutions perturbed). Per layer:

* the exact expectations (mu -> 0) of the four estimates, by autograd: per-sample with live BN
  (each sample's own-loss derivative ``dl_n/dz_n``: no cross-sample terms), per-sample with the
  clean batch's statistics frozen (the gradient with the statistics held constant), the same
  carried through the local VJP of the BN the layer feeds, batch-mean (the true gradient itself);
* ``LayerwiseZO``'s estimate (``node_bn="live"`` / ``"frozen"`` / ``"bn-vjp"``, ``per_sample=False``): the cosine
  of the mean of ``--draws`` estimates at ``q`` (its expectation) and the mean per-draw cosine, at
  q = 16 and q = 1024.

``--train``: ``np-zo`` on the digits ConvNet (the recipe's ``digits-scratch --set method=np-zo``:
20 epochs, q = 4, mu 0.1, lr 0.01) with each ``node_bn``, built and fitted as the recipe's
subspace stage does (``szo.prepare``); the ``bn-vjp`` row is what ``szo recipe`` runs.

    OMP_NUM_THREADS=1 python bench/np_bn.py --cosine
    OMP_NUM_THREADS=1 python bench/np_bn.py --train --root RUNS/subspaces --out RUNS/np_bn

Writes bench/results/np_bn.json (and np_bn_train.json) and prints markdown tables.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from spikingjelly.activation_based import layer
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_result  # noqa: E402

from szo.data import get_dataset  # noqa: E402
from szo.optim import LayerwiseZO  # noqa: E402
from szo.optim.layerwise import CleanBatchStatistics  # noqa: E402


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)).double()


class TanhConvNet(nn.Module):
    """``conv -> BN -> tanh`` twice, pool, linear, in SpikingJelly's multi-step layout ``[T = 1, N, ...]``
    (the layout LayerwiseZO reads a layer's output in); returns ``[N, 10]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = layer.Conv2d(1, 8, 3, padding=1, bias=False, step_mode="m")
        self.bn1 = layer.BatchNorm2d(8, step_mode="m")
        self.conv2 = layer.Conv2d(8, 8, 3, padding=1, bias=False, step_mode="m")
        self.bn2 = layer.BatchNorm2d(8, step_mode="m")
        self.fc = nn.Linear(8 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.bn1(self.conv1(x.unsqueeze(0))))
        x = torch.tanh(self.bn2(self.conv2(x)))
        return self.fc(F.adaptive_avg_pool2d(x[0], 4).flatten(1))


def data(which: str) -> tuple[torch.Tensor, torch.Tensor]:
    if which == "mlp":
        g = torch.Generator().manual_seed(1)
        return torch.randn(32, 10, generator=g, dtype=torch.float64), torch.arange(32) % 4
    ds = get_dataset("digits", "train")
    x = torch.stack([ds[i][0] for i in range(32)]).double()
    return x, torch.tensor([int(ds[i][1]) for i in range(32)])


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.reshape(-1), b.reshape(-1), dim=0))


def exact(model: nn.Module, layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The true gradient of the batch-mean loss wrt ``layer.weight`` and the mu -> 0 expectations of
    the per-sample estimate with live and with frozen BN statistics (autograd)."""
    model.train()
    out: dict[str, torch.Tensor] = {}
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    out["true"] = layer.weight.grad.detach().clone()
    # live: sample n's node estimate has expectation dl_n/dz_n (its own loss only)
    zs: list[torch.Tensor] = []
    h = layer.register_forward_hook(lambda m, a, o: zs.append(o) or None)
    losses = F.cross_entropy(model(x), y, reduction="none")
    h.remove()
    z = zs[0]
    n_axis = 1 if z.dim() > 2 else 0  # [T, N, ...] or [N, F]
    own = torch.stack([torch.autograd.grad(losses[n], z, retain_graph=True)[0].select(n_axis, n)
                       for n in range(len(y))], dim=n_axis)
    out["per-sample, live BN"] = torch.autograd.grad(z, layer.weight, grad_outputs=own / len(y))[0]
    # frozen: the gradient with every BN normalising with the clean batch's statistics (constants)
    # (node_bn="frozen"), and that carried through the BN the layer feeds (node_bn="bn-vjp")
    cs = CleanBatchStatistics(model, {"layer": layer})
    zs.clear()
    with cs.session():
        with torch.no_grad(), cs.recording():
            model(x)
        h = layer.register_forward_hook(lambda m, a, o: zs.append(o) or None)
        with cs.frozen(cs.bns):
            loss = F.cross_entropy(model(x), y)
        h.remove()
        z = zs[0]
        gz = torch.autograd.grad(loss, z, retain_graph=True)[0]
        out["per-sample, frozen BN"] = torch.autograd.grad(z, layer.weight, grad_outputs=gz, retain_graph=True)[0]
        out["per-sample, frozen BN + BN VJP"] = torch.autograd.grad(z, layer.weight,
                                                                     grad_outputs=cs.bn_vjp(layer, gz))[0]
    return out


def estimates(model: nn.Module, name: str, layer: nn.Module, x, y, q: int, draws: int, mu: float, **kw) -> list:
    """``draws`` LayerwiseZO node estimates of ``layer.weight`` (lr 1, momentum 0; the model is put back each time)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for s in range(draws):
        opt = LayerwiseZO(model, perturbation="node", layers=[name], q=q, mu=mu, lr=1.0, momentum=0.0,
                          generator=torch.Generator().manual_seed(s), bn_update="probe-mean", **kw)
        w0 = layer.weight.detach().clone()
        red = "none" if opt.per_sample else "mean"
        model.train()
        opt.step(lambda: F.cross_entropy(model(x), y, reduction=red))
        out.append((w0 - layer.weight.detach()).clone())
        model.load_state_dict(state)
    return out


def cosine(args) -> None:
    rows = []
    variants = {"per-sample, live BN": {"node_bn": "live"}, "per-sample, frozen BN": {"node_bn": "frozen"},
                "per-sample, frozen BN + BN VJP": {"node_bn": "bn-vjp"}, "batch-mean": {"per_sample": False}}
    for which, model, layers in (("mlp", mlp(), ["0"]), ("tanh-convnet", TanhConvNet().double(), ["conv1", "conv2"])):
        x, y = data(which)
        for name in layers:
            layer = model.get_submodule(name)
            ex = exact(model, layer, x, y)
            g = ex["true"]
            for label, kw in variants.items():
                row = {"model": which, "layer": name, "estimate": label,
                       "expectation_cos": 1.0 if label == "batch-mean" else cos(ex[label], g)}
                for q, draws in ((16, args.draws), (1024, args.draws_large)):
                    est = estimates(model, name, layer, x, y, q, draws, args.mu, **kw)
                    row[f"q{q}_mean_cos"] = cos(torch.stack(est).mean(0), g)
                    row[f"q{q}_per_draw_cos"] = sum(cos(e, g) for e in est) / len(est)
                rows.append(row)
                print(row, flush=True)
    write_result("np_bn", {"args": vars(args), "rows": rows, "machine": machine_info()})
    print(f"\n| model | layer | estimate | cos(expectation, gradient) | q = 16: cos(mean of {args.draws}) / per draw "
          f"| q = 1024: cos(mean of {args.draws_large}) / per draw |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layer']} | {r['estimate']} | {r['expectation_cos']:.3f} | "
              f"{r['q16_mean_cos']:.3f} / {r['q16_per_draw_cos']:.3f} | {r['q1024_mean_cos']:.3f} / "
              f"{r['q1024_per_draw_cos']:.3f} |")


def train(args) -> None:
    from szo.build import loaders_for, loss_for
    from szo.config import load_recipe
    from szo.optim import RunOptions
    from szo.prepare import optimizer_options, subspace_model
    from szo.train import fit

    rows = {}
    for node_bn in args.node_bn:
        cfg = load_recipe("digits-scratch", ["method=np-zo", f"subspace.root={args.root}", "progress=false",
                                             f"seed={args.seed}"])
        g = torch.Generator().manual_seed(int(cfg["seed"]))
        tr_loader, test = loaders_for(cfg, g)
        sm = subspace_model(cfg, test)
        o = optimizer_options(cfg)
        run = RunOptions(generator=g, start="current")
        opt = LayerwiseZO(sm.net, perturbation="node", layers=None, mu=o.mu, lr=o.lr, momentum=o.momentum, q=o.q,
                          generator=run.generator, bn_update=o.bn_update, node_bn=node_bn)
        tr = cfg["train"]
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=tr["epochs"])
        s = fit(sm.net, tr_loader, test, opt, epochs=tr["epochs"], loss_fn=loss_for(cfg), scheduler=sched,
                run_dir=Path(args.out) / node_bn, generator=g, progress=False,
                checkpoint_every_steps=tr["checkpoint_every_steps"], info={"node_bn": node_bn})
        rows[node_bn] = {"best_test_acc": s["best_test_acc"], "final_test_acc": s["final_test_acc"], "fp": s["fp"]}
        print(node_bn, rows[node_bn], flush=True)
    write_result("np_bn_train", {"args": vars(args), "rows": rows, "machine": machine_info()})
    print("| node_bn | best / final test acc (%) | #FP |\n|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {100 * r['best_test_acc']:.2f} / {100 * r['final_test_acc']:.2f} | {r['fp']:,} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cosine", action="store_true")
    p.add_argument("--train", action="store_true")
    p.add_argument("--mu", type=float, default=1e-4, help="node perturbation (smooth models: small, near mu -> 0)")
    p.add_argument("--draws", type=int, default=200, help="estimates at q = 16")
    p.add_argument("--draws-large", type=int, default=8, help="estimates at q = 1024")
    p.add_argument("--root", default="subspaces", help="subspace store with digits-scratch's entry (--train)")
    p.add_argument("--out", default="runs/np_bn", help="run directories of --train")
    p.add_argument("--node-bn", nargs="+", default=["bn-vjp", "frozen", "live"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    if not (a.cosine or a.train):
        p.error("give --cosine and/or --train")
    if a.cosine:
        cosine(a)
    if a.train:
        train(a)


if __name__ == "__main__":
    main()
