"""``szo study shift BP_RUN``: a deployed model meets a shifted input distribution and a few
hundred labelled samples, once. Which way of adapting it, on a chip, is worth its forwards?

The deployed model is BP_RUN's (a ``kind: bp`` run directory: ``model.safetensors``,
``trajectory/``). The shift is a corruption of its data set (``--data fmnist-c --corruption
gaussian_noise --severity 5``). ``N`` labelled samples of the shifted distribution arrive as a
stream, in batches of ``--batch``, each seen once (one epoch); then the model is scored on the
shifted *test* split. The adaptation samples are a seeded draw from the shifted *train* split,
so no image is both adapted on and scored.

Methods (``--methods``): ``none`` (the deployed model), ``bn`` (BN statistics re-estimated on
the N samples, no weight changes: a cumulative average, train-mode forwards only), and any
trainable method of the registry: ``bp`` (SGD fine-tuning of every weight; 1 forward + 1
backward per batch), ``bp-subspace``, ``szo-cge``, ``szo-rge`` (forward-only, ``2k + 1`` and
``2q + 1`` forwards per batch). Subspace methods train in the model's *own* trajectory
subspace: the centered PCA of ``BP_RUN/trajectory`` over the epoch window ``--window``
(default: the second half of its epochs), ``--k`` directions, through the deployed weights.
Every method that updates weights also updates the BN running statistics as ordinary
train-mode training does.

Writes, under ``--out`` (default ``BP_RUN/study-shift``), one run directory per (N, method)
(``fit``'s run contract: lock, results.json, metrics.jsonl; a finished cell is not rerun) and
``shift.json``, ``shift.md`` and ``shift.png`` (accuracy vs N, accuracy vs forwards).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from subspace_store import build_subspace
from szo import plots
from szo.build import load_run_model, loss_for
from szo.data import dataset_info, get_dataset, make_loader
from szo.io import atomic_write_json, atomic_write_text
from szo.methods import get_method, list_methods, method_label
from szo.optim import build_optimizer
from szo.rundir import run_lock
from szo.train import fit
from szo.train.trainer import evaluate
from szo.trajectory import Trajectory

__all__ = ["ShiftSettings", "study_shift", "adaptation_subspace", "bn_adapt", "render_shift", "plot_shift"]

#: the methods that change no weight (no adaptation, BN statistics): the registry's non-trainable ones
#: with a source or batch-statistics adapter
NOT_TRAINING = list_methods(trainable=False, adapter=lambda a: a in ("source", "batch-statistics"))
#: the study's default methods: no adaptation, BN statistics, full-space BP, and the methods that adapt
#: in a subspace (the registry's subspace-gradient / subspace-zo adapters)
STUDIED = (NOT_TRAINING + list_methods(backprop=True, subspace=False)
           + list_methods(adapter=lambda a: a in ("subspace-gradient", "subspace-zo")))


@dataclass(frozen=True)
class ShiftSettings:
    """The shift, the stream and each method's hyperparameters (``lr``: per method, default
    ``default_lr``; ``mu``: SZO's perturbation scale, ``q``: SZO-RGE's directions)."""

    data: str = "fmnist-c"
    corruption: str = "gaussian_noise"
    severity: int = 5
    samples: tuple[int, ...] = (100, 200, 500)
    methods: tuple[str, ...] = STUDIED
    batch: int = 20
    eval_images: int | None = None
    k: int = 20
    window: str | None = None
    lr: dict[str, float] = field(default_factory=dict)
    mu: float = 0.1
    q: int = 10
    momentum: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        for m in self.methods:
            if m not in NOT_TRAINING:
                spec = get_method(m, trainable=True)
                if not (spec.backprop or spec.subspace):
                    raise ValueError(f"method {m!r} neither trains in a subspace nor by backprop; valid here: "
                                     "none, bn, bp, bp-subspace and the subspace methods (szo-cge, szo-rge, ...)")
        bad = sorted(set(self.lr) - set(self.methods))
        if bad:
            raise ValueError(f"lr given for method(s) {bad} that are not studied ({list(self.methods)})")
        for name, v in (("batch", self.batch), ("k", self.k), ("q", self.q)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.samples or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.samples):
            raise ValueError(f"samples must be positive ints, got {self.samples!r}")
        if not self.mu > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"need mu > 0 and 0 <= momentum < 1, got mu={self.mu}, momentum={self.momentum}")

    def lr_of(self, method: str) -> float:
        return float(self.lr.get(method, default_lr(method)))


def default_lr(method: str) -> float:
    """The adaptation stream's learning rate: fixed, not tuned on the shifted test split; 0.1 in a
    subspace, 0.01 for full-space BP (its step moves all d weights). ``--lr METHOD=VALUE`` overrides one."""
    spec = get_method(method)
    return 0.01 if spec.backprop and not spec.subspace else 0.1


def adaptation_subspace(bp_run: str | os.PathLike, model: torch.nn.Module, k: int, window: str | None = None) -> Any:
    """The deployed model's own trajectory subspace: centered PCA of ``bp_run/trajectory`` over
    ``window`` (default: the second half of its epochs), ``k`` directions, through the deployed
    weights (reference = ``model.flat_params()``)."""
    traj = Path(bp_run) / "trajectory"
    if not traj.is_dir():
        raise ValueError(f"{bp_run} has no trajectory/ directory: pass the run directory of a kind: bp recipe")
    if window is None:
        epochs = [int(s["epoch"]) for s in Trajectory(traj).samples]
        window = f"{max(epochs) // 2 + 1}-{max(epochs)}"
    return build_subspace(traj, k, window=window, reference=model.flat_params().cpu(), progress=False)


@torch.no_grad()
def bn_adapt(model: torch.nn.Module, loader: Any) -> int:
    """Re-estimate every BN layer's running statistics on ``loader`` (a cumulative average, as
    ``momentum=None``), weights unchanged; returns the number of forwards."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [b.momentum for b in bns]
    for b in bns:
        b.reset_running_stats()
        b.momentum = None
    model.train()
    n = 0
    try:
        for x, _ in loader:
            model(x)
            n += 1
    finally:
        for b, mom in zip(bns, saved):
            b.momentum = mom
    model.eval()
    return n


def _streams(cfg: Any, st: ShiftSettings) -> tuple[Any, Any]:
    """The shifted train split (the pool the N samples are drawn from) and test split."""
    base = cfg["data"]["name"]
    info, shifted = dataset_info(base), dataset_info(st.data)
    if (info.num_classes, info.in_channels, info.image_size) != (shifted.num_classes, shifted.in_channels,
                                                                 shifted.image_size):
        raise ValueError(f"{st.data} ({shifted.num_classes} classes, {shifted.in_channels} x {shifted.image_size}) "
                         f"does not fit the deployed model's data {base} ({info.num_classes} classes, "
                         f"{info.in_channels} x {info.image_size})")
    kw = dict(corruption=st.corruption, severity=st.severity)
    pool = get_dataset(st.data, "train", limit=max(st.samples) * 4, **kw)
    test = get_dataset(st.data, "test", limit=st.eval_images, **kw)
    if max(st.samples) > len(pool):
        raise ValueError(f"N = {max(st.samples)} samples asked, the {st.data} train split has {len(pool)}")
    return pool, test


def _cell(bp_run: Path, method: str, n: int, st: ShiftSettings, sub: Any, pool: Any, test_loader: Any,
          run_dir: Path) -> dict[str, Any]:
    """One (N, method) cell from the deployed weights: adapt on the first ``n`` of the seeded
    draw, score on the shifted test split."""
    if (run_dir / "results.json").is_file() and method not in NOT_TRAINING:
        res = json.loads((run_dir / "results.json").read_text())
        if res.get("status") == "completed":
            return res
    model, cfg = load_run_model(bp_run)
    loss_fn = loss_for(cfg)
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(st.seed))[:n].tolist()
    gen = torch.Generator().manual_seed(st.seed + 1)
    loader = make_loader(Subset(pool, order), st.batch, shuffle=True, generator=gen)
    t0 = time.perf_counter()
    fp = bp = 0
    spec = get_method(method, trainable=None)
    if spec.adapter == "batch-statistics":
        fp = bn_adapt(model, loader)
    elif spec.trainable:
        model.train()
        opt = build_optimizer(method, model, subspace=sub if spec.subspace else None, lr=st.lr_of(method),
                              momentum=st.momentum, mu=st.mu, q=st.q, generator=torch.Generator().manual_seed(st.seed),
                              start="current", scale="absolute")  # the study's mu / lr are the paper's units
        res = fit(model, loader, test_loader, opt, epochs=1, loss_fn=loss_fn, run_dir=run_dir, generator=gen,
                  progress=False, plot=False, info={"name": f"shift {method} N={n}", "method": method})
        return {**res, "adapt_seconds": time.perf_counter() - t0}
    model.eval()
    loss, acc = evaluate(model, test_loader, loss_fn)
    return {"final_test_acc": acc, "best_test_acc": acc, "test_loss": loss, "fp": fp, "bp": bp,
            "adapt_seconds": time.perf_counter() - t0, "status": "completed", "method": method}


def study_shift(bp_run: str | os.PathLike, settings: ShiftSettings = ShiftSettings(), *,
                out: str | os.PathLike | None = None, progress: bool = True) -> dict[str, Any]:
    """Every (N, method) cell of ``settings``; writes ``shift.json`` / ``shift.md`` / ``shift.png``."""
    bp_run = Path(bp_run)
    model, cfg = load_run_model(bp_run)
    out = Path(out or bp_run / "study-shift")
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):
        pool, test = _streams(cfg, settings)
        test_loader = make_loader(test, cfg["data"]["test_batch_size"], shuffle=False)
        needs_sub = any(m not in NOT_TRAINING and get_method(m).subspace for m in settings.methods)
        sub = adaptation_subspace(bp_run, model, settings.k, settings.window) if needs_sub else None
        rows = []
        for n in settings.samples:
            for m in settings.methods:
                res = _cell(bp_run, m, n, settings, sub, pool, test_loader, out / f"n{n}" / m)
                rows.append({"method": m, "label": method_label(m), "n": n, "test_acc": res["final_test_acc"],
                             "fp": int(res.get("fp", 0)), "bp": int(res.get("bp", 0)),
                             "seconds": round(float(res.get("adapt_seconds", res.get("wall_time_min", 0) * 60)), 2)})
                if progress:
                    r = rows[-1]
                    print(f"N={n:<5} {r['label']:<14} acc {100 * r['test_acc']:6.2f}%  #FP {r['fp']:<6} "
                          f"#BP {r['bp']:<5} {r['seconds']:.1f}s", flush=True)
        result = {"bp_run": str(bp_run.resolve()), "model": cfg["model"]["name"], "clean_data": cfg["data"]["name"],
                  "settings": {**asdict(settings), "lr": {m: settings.lr_of(m) for m in settings.methods
                                                           if m not in NOT_TRAINING}},
                  "subspace": None if sub is None else {"k": sub.k, "window": sub.provenance.get("window"),
                                                        "explained_variance": float(sub.explained_variance_ratio.sum())},
                  "eval_images": len(test), "rows": rows, "status": "completed"}
        atomic_write_json(out / "shift.json", result)
        atomic_write_text(out / "shift.md", render_shift(result))
        plot_shift(result, out / "shift.png")
    return result


def render_shift(result: dict[str, Any]) -> str:
    """Markdown: test accuracy per method (rows) and N (columns), with #FP / #BP per cell."""
    st = result["settings"]
    ns = sorted({r["n"] for r in result["rows"]})
    lines = [f"{result['model']} deployed on {result['clean_data']}; shift: {st['data']} {st['corruption']} "
             f"severity {st['severity']}; N labelled samples seen once in batches of {st['batch']}; "
             f"accuracy on {result['eval_images']} shifted test images", "",
             "| method | " + " | ".join(f"N = {n}" for n in ns) + " | #FP / #BP at N = " + str(ns[-1]) + " |",
             "|---|" + "---|" * (len(ns) + 1)]
    for m in dict.fromkeys(r["method"] for r in result["rows"]):
        cells = {r["n"]: r for r in result["rows"] if r["method"] == m}
        last = cells[ns[-1]]
        lines.append(f"| {method_label(m)} | " + " | ".join(f"{100 * cells[n]['test_acc']:.2f}" for n in ns)
                     + f" | {last['fp']} / {last['bp']} |")
    return "\n".join(lines) + "\n"


def plot_shift(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Accuracy vs N and accuracy vs forwards (a backward counted as two forwards), one line per method."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for i, m in enumerate(dict.fromkeys(r["method"] for r in result["rows"])):
        rs = sorted((r for r in result["rows"] if r["method"] == m), key=lambda r: r["n"])
        mk = plots.MARKERS[i % len(plots.MARKERS)]
        axes[0].plot([r["n"] for r in rs], [100 * r["test_acc"] for r in rs], marker=mk, label=method_label(m))
        cost = [max(r["fp"] + 2 * r["bp"], 1) for r in rs]
        axes[1].plot(cost, [100 * r["test_acc"] for r in rs], marker=mk, label=method_label(m))
    axes[0].set_xlabel("labelled samples N (seen once)")
    axes[1].set_xlabel("forward-equivalents (FP + 2 BP)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("shifted test accuracy (%)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    plots.legend_below(fig, handles, labels)
    plots.save_figure(fig, path, layout=False)
    return Path(path)
