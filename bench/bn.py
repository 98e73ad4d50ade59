"""BatchNorm running statistics under forward-only training: how far they are from the truth.

Two measurements (docs/bn.md quotes both):

``--step ROOT``: one SZO step's running-variance update with ``bn_update="probe-mean"`` (the
mean over the 2k / 2q probes around theta_t) against the update an unperturbed train-mode
forward of theta_t makes, at the start of scratch training (the subspace reference, fresh BN
statistics; ``--at RUN_DIR``: at that run's final parameters and statistics), averaged over the first ``--batches`` train batches of digits. Relative error
``||dv_probe_mean - dv_unperturbed|| / ||dv_unperturbed||`` over all BN channels, and the same
difference relative to the batch variance the update averages in (``dv = momentum * (batch_var
- v)``): near a converged state dv is small and the first ratio large.

``--runs DIR ...``: for trained runs (``szo recipe`` run directories), the running variance
they ended with against "precise BN" statistics of their final parameters (a train-mode pass
over the whole train set with a cumulative average, i.e. what unperturbed forwards of those
parameters measure), as ``mean over channels of rv / rv_precise - 1``, and the test accuracy
with either set of statistics.

    python bench/bn.py --step runs/demo/subspaces [--at runs/demo/szo-cge]
    python bench/bn.py --runs runs/demo/szo-cge /tmp/bn-runs/cge-probe-mean

Writes bench/results/bn.json.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from common import RESULTS, machine_info, set_threads, write_result
from torch import nn

from szo.zo import ProbePath


def _bn(model: nn.Module) -> list[nn.Module]:
    from szo.optim import bn_layers

    return bn_layers(model)


def _running_var(model: nn.Module) -> torch.Tensor:
    return torch.cat([m.running_var.detach().clone() for m in _bn(model)])


def loaders_for(cfg):
    from szo.build import loaders_for as loaders

    return loaders(cfg, torch.Generator().manual_seed(int(cfg["seed"])))


@torch.no_grad()
def precise_bn(model: nn.Module, loader) -> nn.Module:
    """A copy of ``model`` whose BN statistics are the cumulative average over ``loader`` at its parameters."""
    net = copy.deepcopy(model).train()
    for m in _bn(net):
        m.reset_running_stats()
        m.momentum = None  # cumulative average: every batch counts equally
    for x, _ in loader:
        net(x)
    return net.eval()


def run_gap(run_dir: Path) -> dict:
    from szo.build import load_run_model, loss_for
    from szo.train import evaluate

    model, cfg = load_run_model(run_dir)
    train, test = loaders_for(cfg)
    precise = precise_bn(model, train)
    ratio = _running_var(model) / _running_var(precise)
    loss_fn = loss_for(cfg)
    _, acc = evaluate(model.eval(), test, loss_fn)
    _, acc_precise = evaluate(precise, test, loss_fn)
    return {"run": str(run_dir), "method": cfg["method"], "bn_update": cfg["szo"]["bn_update"],
            "bn_time": cfg["model"]["bn_time"], "running_var_gap_pct": 100 * float((ratio - 1).mean()),
            "running_var_abs_gap_pct": 100 * float((ratio - 1).abs().mean()),
            "test_acc": acc, "test_acc_precise_bn": acc_precise}


def step_bias(root: Path, batches: int, at: Path | None = None) -> list[dict]:
    from szo.build import build_model, load_run_model, loss_for, subspace_store_for
    from szo.config import load_recipe
    from szo.optim import SZO

    state = load_run_model(at)[0].state_dict() if at is not None else None

    out = []
    for label, sets, est, q, mu in [("SZO-CGE, mu 1", [], "cge", 1, 1.0),
                                    ("SZO-RGE(q=1), mu 1", [], "rge", 1, 1.0),
                                    ("SZO-RGE(q=1), mu 0.3 (digits-scratch)", [], "rge", 1, 0.3)]:
        cfg = load_recipe("digits-scratch", [f"subspace.root={root}", *sets])
        model = build_model(cfg).train()
        sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=model)
        loss_fn = loss_for(cfg)
        train, _ = loaders_for(cfg)
        errs = []
        for i, (x, y) in enumerate(train):
            if i == batches:
                break
            fresh = build_model(cfg).train()  # fresh BN statistics, as a scratch run starts
            if state is not None:  # or a trained run's parameters and statistics
                fresh.load_state_dict(state)
            pm = copy.deepcopy(fresh)
            opt = SZO(pm, sub, mu=mu, lr=0.0, momentum=0.0, estimator=est, q=q,
                      generator=torch.Generator().manual_seed(i), start="reference" if state is None else "current", probes=ProbePath(bn_update="probe-mean"), scale="absolute")
            v0 = _running_var(pm)
            opt.step(lambda: loss_fn(pm(x), y))  # lr 0: theta_{t+1} = theta_t
            ref = copy.deepcopy(pm)
            for a, b in zip(_bn(ref), _bn(fresh)):
                a.running_mean.copy_(b.running_mean)
                a.running_var.copy_(b.running_var)
            with torch.no_grad():
                ref(x)  # the unperturbed forward of theta_t
            d_pm, d_ref = _running_var(pm) - v0, _running_var(ref) - v0
            mom = _bn(ref)[0].momentum  # the zoo's BN: 0.1 everywhere; d = mom * (batch var - v0)
            errs.append((float((d_pm - d_ref).norm() / d_ref.norm()),
                         float((d_pm - d_ref).norm() / (d_ref + mom * v0).norm())))
        out.append({"setting": label, "at": str(at) if at else "reference", "batches": len(errs),
                    "update_rel_error_pct": 100 * sum(e[0] for e in errs) / len(errs),
                    "batch_var_rel_error_pct": 100 * sum(e[1] for e in errs) / len(errs)})
        print(f"{label}: probe-mean running-variance update off by {out[-1]['update_rel_error_pct']:.1f} %, "
              f"the batch variance it averages in by {out[-1]['batch_var_rel_error_pct']:.1f} % "
              f"(mean over {len(errs)} batches)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=Path, metavar="SUBSPACE_ROOT", help="store holding digits-convnet-k20")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--at", type=Path, help="--step from this run's final parameters and BN statistics "
                                          "(default: the subspace reference with fresh statistics)")
    p.add_argument("--runs", type=Path, nargs="*", default=[])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    set_threads(a.threads)
    res: dict = {"machine": machine_info()}
    if a.step:
        res["step"] = step_bias(a.step.resolve(), a.batches, a.at)
    if a.runs:
        res["runs"] = []
        for d in a.runs:
            r = run_gap(d)
            res["runs"].append(r)
            print(f"{d}: {r['method']} bn_update={r['bn_update']} bn_time={r['bn_time']}: running var "
                  f"{r['running_var_gap_pct']:+.1f} % (|.| {r['running_var_abs_gap_pct']:.1f} %) vs precise BN; "
                  f"test acc {100 * r['test_acc']:.2f} % (precise BN {100 * r['test_acc_precise_bn']:.2f} %)",
                  flush=True)
    write_result("bn", res)
    print(f"wrote {RESULTS / 'bn.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
