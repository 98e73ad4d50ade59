"""``szo study q RECIPE``: accuracy and wall time of SZO-RGE as a function of q, SZO-CGE as the line.

Reviewer 3 asked what q costs. For a scratch (or continual) subspace recipe this trains
SZO-RGE once per ``--q`` value (``--set method=szo-rge --set szo.q=Q``, run directory
``OUT/szo-rge-q{Q}``) and SZO-CGE once (``OUT/szo-cge``), all else equal (``--rge-set`` adds
overrides for the RGE runs only, e.g. their perturbation scale), then writes

* ``OUT/q.json``: per run the best and final test accuracy, the epoch the best was reached,
  the forward passes per step (2q + 1 for RGE, 2k + 1 for CGE with ``bn_update=recompute``),
  total forwards and training wall time;
* ``OUT/q.md``: the same as a table;
* ``OUT/q.png``: accuracy vs q and wall time vs q, SZO-CGE (2k forwards) as a horizontal line.

A run directory that already holds a completed run of exactly this configuration (its
config.yaml differs in no trained key) is reused, not retrained: e.g. the Table-1 runs
``OUT/szo-cge`` and ``OUT/szo-rge-q1`` of the same recipe. A partial one is resumed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from szo import plots
from szo.config import load_recipe
from szo.io import atomic_write_json, atomic_write_text
from szo.methods import get_method, method_label
from szo.pipeline import run_or_reuse
from szo.rundir import run_lock

__all__ = ["study_q", "q_rows", "render_q", "plot_q"]


def _check_qs(qs: Sequence[int]) -> list[int]:
    out = []
    for q in qs:
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"every q must be a positive int, got {q!r} in {list(qs)!r}")
        out.append(q)
    if not out:
        raise ValueError("give at least one q (e.g. --q 1,2,5,10,20)")
    return sorted(set(out))


def q_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows from ``{name: (config, summary)}``-style entries (see :func:`study_q`)."""
    rows = []
    for name, r in runs.items():
        cfg, s = r["config"], r["summary"]
        k = int(s.get("k") or 0)
        q = int(cfg["szo"]["q"]) if get_method(cfg["method"]).q_labeled else None
        steps = max(int(s.get("steps") or 0), 1)
        rows.append({
            "run": name, "method": cfg["method"], "q": q, "k": k,
            "fp_per_step": s["fp"] / steps, "fp": s["fp"], "steps": s.get("steps"),
            "best_test_acc": s.get("best_test_acc"), "final_test_acc": s.get("final_test_acc"),
            "best_epoch": s.get("converged_epoch"), "epochs": s.get("epochs"),
            "train_time_min": s.get("train_time_min"), "status": s.get("status", "completed"),
            "run_dir": r["run_dir"],
        })
    return rows


def render_q(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`q_rows`."""
    head = "| method | q | forwards / step | best test acc | final test acc | best at epoch | train time (min) |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["best_test_acc"] is None else f"{100 * r['best_test_acc']:.2f} %"
        fin = "-" if r["final_test_acc"] is None else f"{100 * r['final_test_acc']:.2f} %"
        t = "-" if r["train_time_min"] is None else f"{r['train_time_min']:.2f}"
        label = method_label(r["method"])
        lines.append(f"| {label} | {r['q'] if r['q'] is not None else '-'} | {r['fp_per_step']:.0f} | {acc} | {fin} "
                     f"| {r['best_epoch']} / {r['epochs']} | {t} |")
    return "\n".join(lines)


def plot_q(rows: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Accuracy vs q and training time vs q (SZO-RGE points, SZO-CGE horizontal line)."""
    plt = plots.pyplot()
    rge = sorted((r for r in rows if r["q"] is not None), key=lambda r: r["q"])
    cge = [r for r in rows if r["q"] is None]  # the coordinate estimator: no q
    fig, axes = plt.subplots(1, 2, figsize=(8.6, 3.4))
    panels = (("best_test_acc", 100.0, "best test accuracy (%)"), ("train_time_min", 1.0, "training time (min)"))
    for ax, (key, scale, ylabel) in zip(axes, panels):
        qs = [r["q"] for r in rge if r[key] is not None]
        vals = [scale * r[key] for r in rge if r[key] is not None]
        if qs:
            ax.plot(qs, vals, "o-", color="C0", label="SZO-RGE")
            for q, v in zip(qs, vals):
                ax.annotate(f"{v:.1f}", (q, v), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7)
        for r in cge:
            if r[key] is not None:
                ax.axhline(scale * r[key], color="C3", ls="--", label=f"SZO-CGE (k={r['k']}, {r['fp_per_step']:.0f} fwd/step)")
        ax.set_xscale("log")
        if qs:
            ax.set_xticks(qs)
            ax.set_xticklabels([str(q) for q in qs])
            ax.minorticks_off()
        ax.set_xlabel("q (random directions per step)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    plots.save_figure(fig, path)
    return Path(path)


def study_q(recipe: str, qs: Sequence[int], *, overrides: Sequence[str] = (), rge_overrides: Sequence[str] = (),
            out: str | os.PathLike, cge: bool = True, plot: bool = True) -> dict[str, Any]:
    """Train (or reuse) SZO-RGE for every q and SZO-CGE once from ``recipe``; write q.json / q.md / q.png.

    ``overrides`` apply to every run, ``rge_overrides`` to the SZO-RGE runs only (e.g. an RGE
    perturbation scale ``szo.mu=0.3``: a Gaussian direction in k dimensions has length ~sqrt(k),
    so RGE probes sqrt(k) times farther than CGE at the same mu)."""
    qs = _check_qs(qs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):  # the study's directory; every run in it holds its own
        return _study_q(recipe, qs, list(overrides), list(rge_overrides), out, cge, plot)


def _study_q(recipe: str, qs: list[int], overrides: list[str], rge_overrides: list[str], out: Path, cge: bool,
             plot: bool) -> dict[str, Any]:
    plan: list[tuple[str, list[str]]] = [(f"szo-rge-q{q}", list(rge_overrides) + ["method=szo-rge", f"szo.q={q}"])
                                         for q in qs]
    if cge:
        plan.append(("szo-cge", ["method=szo-cge"]))
    runs: dict[str, dict[str, Any]] = {}
    for name, sets in plan:
        cfg = load_recipe(recipe, list(overrides) + sets)
        if cfg.get("kind") != "subspace":
            raise ValueError(f"szo study q trains in a subspace: recipe {recipe!r} is kind {cfg.get('kind')!r}; "
                             "use a scratch or continual recipe (e.g. mnist5k-scratch)")
        summary = run_or_reuse(cfg, out / name)
        runs[name] = {"config": cfg, "summary": summary, "run_dir": str(out / name)}
    rows = q_rows(runs)
    result = {"recipe": recipe, "overrides": list(overrides), "rge_overrides": list(rge_overrides), "qs": qs,
              "rows": rows}
    atomic_write_json(out / "q.json", result)
    atomic_write_text(out / "q.md", render_q(rows) + "\n")
    if plot:
        plot_q(rows, out / "q.png", title=f"{recipe}: SZO-RGE accuracy and cost vs q")
    return result
