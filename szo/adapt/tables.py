"""TTA result tables in the layout of the paper (Table 2; Appendix E, Tables 5-10) and a chart.

``results`` is the dict written by :func:`szo.adapt.runner.run_tta` (``tta_results.json``)::

    {"dataset": "digits-c", "model": "spike_convnet", "severity": 5,
     "corruptions": [... 15 names in table order ...],
     "methods": [...], "settings": [...],
     "results": {setting: {method: {"per_corruption": {corruption: acc}, "average": acc,
                                     "fp": int, "bp": int, ...}}},
     "protocol": {"name": "paper" | "train" | "loco", "label_leak": bool, "warning": ..., ...},  # recipes
     "notes": [...]}                                                                            # optional

Accuracies are fractions in [0, 1] in the JSON and percentages (2 decimals) in the tables.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from szo import plots
from szo.io import atomic_write_json, atomic_write_text
from szo.methods import NO_ADAPTATION, get_method, method_label

from .methods import USES_BP
from .subspace import LABEL_LEAK

__all__ = ["SHORT_NAMES", "protocol_text", "corruption_table", "summary_table", "plot_accuracy",
           "write_tables"]

#: column headers of Tables 5-10 (imagecorruptions / Hendrycks & Dietterich names)
SHORT_NAMES = {
    "gaussian_noise": "Gauss.", "shot_noise": "Shot", "impulse_noise": "Impul.",
    "defocus_blur": "Defoc.", "glass_blur": "Glass", "motion_blur": "Motion", "zoom_blur": "Zoom",
    "snow": "Snow", "frost": "Frost", "fog": "Fog", "brightness": "Brit.",
    "contrast": "Contr.", "elastic_transform": "Elas.", "pixelate": "Pix.", "jpeg_compression": "JPEG",
}

def protocol_text(results: Mapping[str, Any]) -> str:
    """Markdown lines naming the adaptation-subspace protocol (``results["protocol"]``) and any
    notes; the paper protocol's label leak in bold. Empty if the results name no protocol."""
    proto = results.get("protocol")
    lines = []
    if proto:
        text = f"Adaptation subspace: protocol **{proto['name']}**"
        if proto.get("description"):
            text += f" ({proto['description']})"
        lines.append(text + ".")
        if proto.get("label_leak"):
            lines.append(f"**Label leak: {proto.get('warning') or LABEL_LEAK}**"
                         " (every corruption is made from the same clean test images).")
    lines += [f"Note: {n}." for n in results.get("notes", [])]
    return "".join(f"{line}\n\n" for line in lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100.0 * v:.2f}"


def _md(rows: list[list[str]]) -> str:
    head, body = rows[0], rows[1:]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def corruption_table(results: Mapping[str, Any], setting: str) -> str:
    """Markdown table like Tables 5-10: one row per method, 15 corruption columns + average."""
    if setting not in results["results"]:
        raise ValueError(f"no results for setting {setting!r}; valid: {', '.join(results['results'])}")
    corruptions = list(results["corruptions"])
    q = results.get("config", {}).get("q")
    rows = [["Method", "BP", *[SHORT_NAMES.get(c, c) for c in corruptions], "Average Acc."]]
    for method, r in results["results"][setting].items():
        rows.append([method_label(method, q, q_sep=" "), "✓" if USES_BP.get(method, False) else "X",
                     *[_pct(r["per_corruption"].get(c)) for c in corruptions], _pct(r["average"])])
    title = (f"Accuracy (%) on {results['dataset']} ({results.get('model', '?')}) with corruption severity "
             f"level {results['severity']} under *{setting.capitalize()}* setting.\n\n")
    return title + protocol_text(results) + _md(rows)


def summary_table(results: Mapping[str, Any]) -> str:
    """Markdown table like Table 2: rows = settings, columns = methods (average accuracy)."""
    q = results.get("config", {}).get("q")
    methods = list(results["methods"])
    rows = [["Setting", "Dataset", "Model", *[method_label(m, q, q_sep=" ") for m in methods]]]
    for setting, per_method in results["results"].items():
        rows.append([setting.capitalize(), str(results["dataset"]), str(results.get("model", "?")),
                     *[_pct(per_method[m]["average"]) if m in per_method else "-" for m in methods]])
    cost = [["Method", "#FP per batch", "#BP per batch", *[f"#FP ({s})" for s in results["results"]],
             *[f"#BP ({s})" for s in results["results"]]]]
    for m in methods:
        any_r = next(r[m] for r in results["results"].values() if m in r)
        cost.append([method_label(m, q, q_sep=" "), str(any_r["fp_per_batch"]), str(any_r["bp_per_batch"]),
                     *[str(r[m]["fp"]) if m in r else "-" for r in results["results"].values()],
                     *[str(r[m]["bp"]) if m in r else "-" for r in results["results"].values()]])
    title = (f"Accuracy (%) on unsupervised model adaptation on {results['dataset']} "
             f"(severity {results['severity']}).\n\n")
    return title + protocol_text(results) + _md(rows) + "\nForward / backward passes (network calls on a batch):\n\n" + _md(cost)


def plot_accuracy(results: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """PNG, per setting: accuracy per corruption of every method (no adaptation as grey bars,
    the others as side-by-side markers, legend with the averages beside the panel) and, under
    it, each adapting method's accuracy minus BN's, where differences of a point or two that
    overlap in the accuracy panel stay readable."""
    corruptions = list(results["corruptions"])
    settings = list(results["results"])
    q = results.get("config", {}).get("q")
    methods = list(dict.fromkeys(m for st in settings for m in results["results"][st]))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    markers = {m: plots.MARKERS[i % len(plots.MARKERS)] for i, m in enumerate(methods)}
    points = [m for m in methods if m != NO_ADAPTATION]
    dx = {m: (j - (len(points) - 1) / 2) * min(0.13, 0.8 / max(len(points), 1)) for j, m in enumerate(points)}
    # the difference panel's reference: the BN-statistics adaptation where it ran (the registry's adapter)
    diff_ref = next((m for m in methods if get_method(m).adapter == "batch-statistics"), None)
    ratios = [3, 2] if diff_ref else [3]
    fig = plots.pyplot().figure(figsize=(13, len(settings) * (sum(ratios) * 1.3 + 1.0)), layout="constrained")
    subs = fig.subfigures(len(settings), 1, squeeze=False)[:, 0]
    xs = list(range(len(corruptions)))
    names = [SHORT_NAMES.get(c, c) for c in corruptions]
    for setting, sub in zip(settings, subs):
        per = results["results"][setting]
        axes = sub.subplots(len(ratios), 1, sharex=True, squeeze=False, height_ratios=ratios)[:, 0]
        ax = axes[0]
        handles, labels = [], []  # in the table's method order
        for m, r in per.items():
            ys = [100.0 * r["per_corruption"][c] for c in corruptions]
            if m == NO_ADAPTATION:
                handles.append(ax.bar(xs, ys, width=0.8, color="0.85"))
            else:
                handles += ax.plot([x + dx[m] for x in xs], ys, ls="none", marker=markers[m], ms=5, color=colors[m])
            labels.append(f"{method_label(m, q, q_sep=' ')}: {100.0 * r['average']:.1f}")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 102)
        proto = results.get("protocol") or {}
        tag = f", subspace protocol {proto['name']}" if proto else ""
        tag += " (LABEL LEAK: test labels used)" if proto.get("label_leak") else ""
        ax.set_title(f"{results['dataset']} severity {results['severity']}: {setting}{tag}")
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  title="average accuracy (%)", title_fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=45, ha="right")
        if diff_ref:
            ax2 = axes[1]
            base = per[diff_ref]["per_corruption"]
            ax2.axhline(0.0, color=colors[diff_ref], lw=1.2)
            for m, r in per.items():
                if m in (NO_ADAPTATION, diff_ref):
                    continue
                ax2.plot([x + dx[m] for x in xs], [100.0 * (r["per_corruption"][c] - base[c]) for c in corruptions],
                         ls="none", marker=markers[m], ms=5, color=colors[m])
            ax2.set_ylabel(f"minus {method_label(diff_ref)}\n(points)")
            ax2.grid(axis="y", alpha=0.3)
        ax.grid(axis="y", alpha=0.3)
    path = Path(path)
    plots.save_figure(fig, path, dpi=110, layout=False)  # constrained layout
    return path


def write_tables(results: Mapping[str, Any], out_dir: str | os.PathLike, *, plot: bool = True) -> dict[str, Path]:
    """Write ``tta_results.json``, ``tta_table_<setting>.md``, ``tta_summary.md`` and ``tta_accuracy.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"json": out / "tta_results.json", "summary": out / "tta_summary.md"}
    atomic_write_json(paths["json"], results)
    for setting in results["results"]:
        p = out / f"tta_table_{setting}.md"
        atomic_write_text(p, corruption_table(results, setting))
        paths[f"table_{setting}"] = p
    atomic_write_text(paths["summary"], summary_table(results))
    if plot:
        paths["png"] = plot_accuracy(results, out / "tta_accuracy.png")
    return paths
