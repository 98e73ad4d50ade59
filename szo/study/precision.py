"""``szo study precision RECIPE``: does the arithmetic change the zeroth-order estimate, and what
does a run reach in it? The measurement behind ``precision: auto`` (``szo.precision.AUTO``).

A ZO estimate divides a loss difference by mu, and a spike is a threshold: a rounding that a
BP-trained forward tolerates can flip spikes between the + and the - probe. For a scratch or
continual subspace recipe, at the model the subspace stage starts from (``szo.prepare.subspace_model``:
the subspace's reference point, the pretrained weights for continual) and one fixed train batch
(the first ``batch`` images, no augmentation), for every precision and mu:

* the subspace CGE estimate (2k forwards) and ``repeats`` SZO-RGE estimates for each q, their
  cosine to the fp32 autograd (surrogate BPTT) gradient, variance and relative error
  (``szo.functional.diagnostics.estimate_statistics``, as ``szo diagnose``);
* ``cosine_to_fp32``: the estimate against the fp32 estimate along the *same* directions (CGE:
  the k basis vectors; RGE: the same draws), i.e. what the arithmetic alone changes;
* ``spike_flip_rate``: the share of spikes that differ from the fp32 forward at the same weights.

Then (unless ``train=False``) it trains the recipe once per precision x training mu x seed
(``--set precision=P seed=S [szo.mu=M]``, run directories ``OUT/P-muM-sS``; a completed run of
the same config is reused) and reports best / final test accuracy, mean and spread over seeds.
The subspace is built once, by the recipe's BPTT stage at ``precision: auto``, into
``OUT/subspaces`` unless ``subspace.root`` is set. Results: ``OUT/precision.json``,
``OUT/precision.md`` (both tables) and ``OUT/precision.png`` (cosine vs mu; accuracy per precision).
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
from spikingjelly.activation_based.neuron import BaseNode

from szo import plots
from szo.build import loss_for, subspace_store_for
from szo.config import load_recipe
from szo.functional.diagnostics import cosine
from szo.io import atomic_write_json, atomic_write_text
from szo.pipeline import run_or_reuse
from szo.precision import check_precision, precision_policy
from szo.prepare import subspace_model
from szo.rundir import run_lock
from szo.stages import bptt_stage, device_for
from szo.study.diagnose import diagnose_model, run_batch
from szo.zo import get_estimator

__all__ = ["study_precision", "estimate_rows", "training_rows", "spike_flip_rate", "render_precision",
           "plot_precision", "default_precisions"]


def default_precisions(device: str) -> list[str]:
    """fp32 and bf16 everywhere, TF32 where it exists (CUDA)."""
    return ["fp32", "tf32", "bf16"] if str(device).startswith("cuda") else ["fp32", "bf16"]


def _spikes(model: torch.nn.Module, x: torch.Tensor, scope) -> list[torch.Tensor]:
    """Every spiking layer's output of one forward in ``scope`` (BN buffers put back)."""
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o.detach().float()))
             for m in model.modules() if isinstance(m, BaseNode)]
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        with torch.no_grad(), scope():
            model(x)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    return outs


def spike_flip_rate(model: torch.nn.Module, x: torch.Tensor, scope, reference_scope) -> float:
    """The share of spike outputs (all spiking layers, all time steps) that differ between a
    forward in ``scope`` and one in ``reference_scope`` at the same weights; nan without spiking layers."""
    a, b = _spikes(model, x, scope), _spikes(model, x, reference_scope)
    total = sum(t.numel() for t in a)
    if total == 0:
        return float("nan")
    return float(sum(int((s != r).sum()) for s, r in zip(a, b))) / total


def estimate_rows(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, basis: torch.Tensor,
                  precisions: Sequence[str], mus: Sequence[float], qs: Sequence[int], *, repeats: int = 10,
                  seed: int = 0, device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """One row per (precision, estimator, mu, q): ``szo diagnose``'s statistics against the fp32
    gradient, ``cosine_to_fp32`` and ``spike_flip_rate`` (see the module doc). The fp32 estimates
    are the reference, so fp32 is always measured (first)."""
    precs = ["fp32"] + [p for p in dict.fromkeys(precisions) if p != "fp32"]
    for p in precs:
        check_precision(p)
    fp32 = precision_policy("fp32", model, device, forward_only=True)
    ref: dict[tuple[str, float, int | None], torch.Tensor] = {}
    rows: list[dict[str, Any]] = []
    x, y = x.to(device), y.to(device)
    for p in precs:
        pol = precision_policy(p, model, device, forward_only=True)
        flips = spike_flip_rate(model, x, pol.scope, fp32.scope) if p != "fp32" else 0.0
        with fp32.scope():  # the reference gradient in fp32 whatever is measured
            got = diagnose_model(model, x, y, loss_fn, directions=basis.to(device), mus=mus, qs=qs, repeats=repeats,
                                 seed=seed, spaces=("subspace",), scope=pol.scope, keep_estimates=True)
        for r in got:
            e = r.pop("estimates").to(torch.float64)
            key = (r["estimator"], r["mu"], r["q"])
            if p == "fp32":
                ref[key] = e
            r["cosine_to_fp32"] = sum(cosine(a, b) for a, b in zip(e, ref[key])) / e.shape[0]
            rows.append({"precision": p, "effective": pol.effective, **r, "spike_flip_rate": flips})
    return rows


def training_rows(recipe: str, overrides: Sequence[str], precisions: Sequence[str], train_mus: Sequence[float | None],
                  seeds: Sequence[int], out: Path, device: str | None) -> list[dict[str, Any]]:
    """Train (or reuse) the recipe per precision x mu x seed; one row per run."""
    rows = []
    for p in precisions:
        for mu in train_mus:
            for s in seeds:
                sets = list(overrides) + [f"precision={p}", f"seed={s}"] + ([f"szo.mu={mu}"] if mu is not None else [])
                cfg = load_recipe(recipe, sets)
                name = f"{p}-mu{cfg['szo']['mu']:g}-s{s}"
                summary = run_or_reuse(cfg, out / name, device=device)
                rows.append({"precision": p, "mu": cfg["szo"]["mu"], "seed": s, "run_dir": str(out / name),
                             "method": cfg["method"], "best_test_acc": summary.get("best_test_acc"),
                             "final_test_acc": summary.get("final_test_acc"), "status": summary.get("status"),
                             "train_time_min": summary.get("train_time_min"),
                             "effective": (summary.get("precision") or {}).get("effective")})
    return rows


def _accuracy_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean / spread over seeds per (precision, mu)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["precision"], r["mu"]), []).append(r)
    out = []
    for (p, mu), rs in groups.items():
        best = [100 * r["best_test_acc"] for r in rs if r["best_test_acc"] is not None]
        final = [100 * r["final_test_acc"] for r in rs if r["final_test_acc"] is not None]
        out.append({"precision": p, "mu": mu, "n": len(rs), "seeds": [r["seed"] for r in rs],
                    "best_mean": statistics.mean(best) if best else None,
                    "best_std": statistics.stdev(best) if len(best) > 1 else 0.0,
                    "final_mean": statistics.mean(final) if final else None, "best_each": best})
    return out


def study_precision(recipe: str, *, precisions: Sequence[str] | None = None, mus: Sequence[float] = (0.01, 0.1, 1.0),
                    qs: Sequence[int] = (1, 10), repeats: int = 10, batch: int = 64, seeds: Sequence[int] = (0, 1, 2),
                    train_mus: Sequence[float] | None = None, overrides: Sequence[str] = (), device: str | None = None,
                    out: str | os.PathLike, train: bool = True, plot: bool = True) -> dict[str, Any]:
    """The study (module doc); writes precision.json / .md / .png into ``out`` and returns the result.
    Everything is checked before ``out`` is created (a refused study leaves nothing behind); ``out``
    is held as a run directory (``szo.rundir.run_lock``: a file there is refused in one line)."""
    out = Path(out)
    sets = list(overrides)
    if not any(s.startswith("subspace.root=") for s in sets):
        sets.append(f"subspace.root={(out / 'subspaces').resolve()}")
    cfg = load_recipe(recipe, sets + ["precision=auto"])
    if cfg["kind"] != "subspace":
        raise ValueError(f"szo study precision trains in a subspace: recipe {recipe!r} is kind {cfg['kind']!r}; "
                         "use a scratch or continual recipe (e.g. digits-scratch, digits-continual)")
    dev = device_for(cfg, device)
    precs = list(precisions) if precisions else default_precisions(dev)
    for p in precs:
        check_precision(p)
    _check_settings(mus, qs, repeats, batch, seeds if train else (0,))
    if train:  # every training run's config, checked now rather than after the estimates
        for p in precs:
            for mu in (list(train_mus) if train_mus else [None]):
                load_recipe(recipe, sets + [f"precision={p}", f"seed={seeds[0]}"]
                            + ([f"szo.mu={mu}"] if mu is not None else []))
    with run_lock(out):  # creates the study's directory (one line if it cannot); every run in it holds its own
        if not subspace_store_for(cfg).exists(cfg["subspace"]["name"]):
            bptt_stage(cfg, out / "bptt", device=dev)
        sm = subspace_model(cfg)
        model = sm.net.to(dev).train()
        x, y = run_batch(cfg, batch)
        est = estimate_rows(model, x, y, loss_for(cfg), sm.subspace.basis, precs, mus, qs, repeats=repeats,
                            seed=int(cfg["seed"]), device=dev)
        runs = training_rows(recipe, sets, precs, list(train_mus) if train_mus else [None], seeds, out, dev) \
            if train else []
        result = {"recipe": recipe, "overrides": list(overrides), "device": dev, "precisions": precs, "mus": list(mus),
                  "qs": list(qs), "repeats": repeats, "batch": int(y.shape[0]), "k": sm.subspace.k,
                  "estimates": est, "training": runs, "accuracy": _accuracy_table(runs)}
        atomic_write_json(out / "precision.json", result)
        atomic_write_text(out / "precision.md", render_precision(result) + "\n")
        if plot:
            plot_precision(result, out / "precision.png")
    return result


def _check_settings(mus: Sequence[float], qs: Sequence[int], repeats: int, batch: int, seeds: Sequence[int]) -> None:
    """The study's own numbers, one ValueError naming the first bad one (before any directory is made)."""
    def bad(what: str, got: Any, valid: str) -> None:
        raise ValueError(f"szo study precision: {what} {got!r}; valid: {valid}")

    if not mus or any(isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf") for m in mus):
        bad("--mu", list(mus), "positive finite numbers")
    if not qs or any(isinstance(q, bool) or not isinstance(q, int) or q < 1 for q in qs):
        bad("--q", list(qs), "ints >= 1")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        bad("--repeats", repeats, "an int >= 2 (a variance needs two draws)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        bad("--batch", batch, "an int >= 1")
    if not seeds or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in seeds):
        bad("--seeds", list(seeds), "ints >= 0")


def render_precision(result: dict[str, Any]) -> str:
    """Both tables as markdown."""
    lines = [f"### {result['recipe']} on {result['device']}: ZO estimates at the subspace's start point "
             f"(batch {result['batch']}, k {result['k']}, RGE repeats {result['repeats']})", "",
             "| precision | estimator | mu | cosine to fp32 BP grad | cosine to the fp32 estimate | variance | "
             "relative error | spike flips |", "|---|---|---|---|---|---|---|---|"]
    for r in result["estimates"]:
        est = get_estimator(r["estimator"]).describe(r["q"])
        lines.append(f"| {r['precision']} | {est} | {r['mu']:g} | {r['cosine']:.3f} | {r['cosine_to_fp32']:.4f} | "
                     f"{r['variance']:.3g} | {r['relative_error']:.3g} | {100 * r['spike_flip_rate']:.3f} % |")
    if result["accuracy"]:
        lines += ["", "| precision | mu | seeds | best test acc (mean +- sd) | each | final (mean) |",
                  "|---|---|---|---|---|---|"]
        for a in result["accuracy"]:
            each = " / ".join(f"{v:.2f}" for v in a["best_each"])
            fin = f"{a['final_mean']:.2f}" if a["final_mean"] is not None else "-"
            best = f"{a['best_mean']:.2f} +- {a['best_std']:.2f}" if a["best_mean"] is not None else "-"
            lines.append(f"| {a['precision']} | {a['mu']:g} | {a['n']} | {best} | {each} | {fin} |")
    return "\n".join(lines)


def plot_precision(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Left: cosine of the estimate to the fp32 gradient vs mu, one line per (precision,
    estimator); right: best test accuracy per precision (mean and each seed)."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.5))
    ax = axes[0]
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in result["estimates"]:
        est = get_estimator(r["estimator"]).describe(r["q"])
        series.setdefault((r["precision"], est), []).append((r["mu"], r["cosine"]))
    styles = {p: c for p, c in zip(result["precisions"], ("C0", "C1", "C2", "C3"))}
    marks = {e: m for e, m in zip(dict.fromkeys(e for _, e in series), ("o-", "s--", "^:", "v-.", "D--"))}
    for (p, est), pts in series.items():  # colour: precision; marker and line: estimator
        pts.sort()
        ax.plot([m for m, _ in pts], [c for _, c in pts], marks[est], color=styles.get(p, "C4"),
                label=f"{p} {est}", alpha=0.9)
    ax.set_xscale("log")
    ax.set_xlabel("mu")
    ax.set_ylabel("cosine to the fp32 BPTT gradient")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    acc = result["accuracy"]
    for i, a in enumerate(acc):
        if a["best_mean"] is None:
            continue
        ax.bar(i, a["best_mean"], color=styles.get(a["precision"], "C4"), alpha=0.6)
        ax.plot([i] * len(a["best_each"]), a["best_each"], "k.", ms=5)
    ax.set_xticks(range(len(acc)))
    ax.set_xticklabels([f"{a['precision']}\nmu {a['mu']:g}" for a in acc], fontsize=8)
    ax.set_ylabel("best test accuracy (%)")
    if acc:
        lo = min(v for a in acc for v in a["best_each"]) if any(a["best_each"] for a in acc) else 0
        ax.set_ylim(max(0.0, lo - 5), 100)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result['recipe']} on {result['device']}: precision of the probe forwards", fontsize=10)
    plots.save_figure(fig, path)
    return Path(path)
