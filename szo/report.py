"""``szo report RUN_DIR ...``: paper-style tables (Table 1: accuracy by method; Table 3:
converged epoch / time / #FP / #BP / max accuracy) as markdown and JSON, plus the test
accuracy vs epoch and vs training time of all runs on one figure (Fig. 3/4).

A RUN_DIR is any directory holding results.json (+ metrics.jsonl); a directory without one
is searched recursively (``szo report runs/demo``). Runs with the same dataset/model/label
(e.g. several seeds) are reported as mean +- std.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from szo.io import atomic_write_json, atomic_write_text

__all__ = ["collect_runs", "table1", "table3", "render", "write_report"]


def collect_runs(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Load results.json + metrics.jsonl of every run under ``paths`` (sorted by path)."""
    from szo.train.callbacks import read_metrics

    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"run directory {p} does not exist")
        if (p / "results.json").is_file():
            found.append(p)
        else:
            found += sorted(r.parent for r in p.rglob("results.json"))
    if not found:
        raise ValueError(f"no results.json under {', '.join(map(str, paths))}; valid: run directories written by szo recipe")
    runs = []
    for d in dict.fromkeys(found):
        res = json.loads((d / "results.json").read_text(encoding="utf-8"))
        hist = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
        runs.append({"dir": str(d), "results": res, "history": hist})
    return runs


def _group(r: dict[str, Any]) -> str:
    res = r["results"]
    return f"{res.get('dataset', '?')} / {res.get('model', '?')}"


def _label(r: dict[str, Any]) -> str:
    return str(r["results"].get("label") or r["results"].get("method") or Path(r["dir"]).name)


def _fmt(vals: Sequence[float], scale: float = 1.0, nd: int = 2) -> str:
    vals = [v * scale for v in vals if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{nd}f}"
    return f"{statistics.mean(vals):.{nd}f}±{statistics.stdev(vals):.{nd}f}"


def _params(d: Any) -> str:
    if not isinstance(d, int):
        return "-"
    return f"{d / 1e6:.2f}M" if d >= 1e5 else f"{d / 1e3:.1f}K"


def table1(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Accuracy (%) by method (paper Table 1): one row per dataset/model, one column per label.
    Uses the maximum test accuracy of each run; scratch and BPTT runs only."""
    runs = [r for r in runs if r["results"].get("mode") in ("bptt", "scratch", None)]
    labels = list(dict.fromkeys(_label(r) for r in runs))
    header = ["Dataset", "Model", "Params", *labels]
    rows = []
    for g in dict.fromkeys(_group(r) for r in runs):
        rs = [r for r in runs if _group(r) == g]
        ds, model = g.split(" / ")
        row = [ds, model, _params(rs[0]["results"].get("d"))]
        for lab in labels:
            row.append(_fmt([r["results"].get("best_test_acc") for r in rs if _label(r) == lab], 100.0))
        rows.append(row)
    return header, rows


_T3 = ("converged epoch", "converged time (min)", "#FP", "#BP", "max acc (%)")


def table3(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Training cost to the maximum accuracy (paper Table 3), continual and from-scratch halves.
    BPTT runs count as from scratch."""
    header = ["Dataset / Model", "Method", *(f"continual: {c}" for c in _T3), *(f"scratch: {c}" for c in _T3)]
    rows = []
    for g in dict.fromkeys(_group(r) for r in runs):
        rs = [r for r in runs if _group(r) == g]
        for lab in dict.fromkeys(_label(r) for r in rs):
            row = [g, lab]
            for modes in (("continual",), ("scratch", "bptt", None)):
                sel = [r["results"] for r in rs if _label(r) == lab and r["results"].get("mode") in modes]
                if not sel:
                    row += ["-"] * len(_T3)
                    continue
                row += [
                    _fmt([s.get("converged_epoch") for s in sel], nd=0 if len(sel) == 1 else 1),
                    _fmt([s.get("converged_time_min") for s in sel]),
                    _fmt([s.get("converged_fp") for s in sel], nd=0),
                    _fmt([s.get("converged_bp") for s in sel], nd=0),
                    _fmt([s.get("best_test_acc") for s in sel], 100.0),
                ]
            rows.append(row)
    return header, rows


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


Table = tuple[list[str], list[list[str]]]


def render(runs: Sequence[dict[str, Any]]) -> str:
    """Both tables as markdown."""
    return _render(table1(runs), table3(runs))


def _render(t1: Table, t3: Table) -> str:
    (h1, r1), (h3, r3) = t1, t3
    out = ["## Accuracy (%) by method (max test accuracy; layout of paper Table 1)", "", _markdown(h1, r1), "",
           "## Training cost to the maximum accuracy (layout of paper Table 3)", "",
           "Converged epoch = epoch of the maximum test accuracy; time = training time to it (evaluation "
           "excluded); #FP / #BP = forward / backward passes to it.", "", _markdown(h3, r3), ""]
    return "\n".join(out)


def write_report(runs: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> dict[str, Path]:
    """report.md, report.json and accuracy.png in ``out_dir``."""
    from szo.plots import plot_runs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t1, t3 = table1(runs), table3(runs)  # computed once for both files
    (h1, r1), (h3, r3) = t1, t3
    atomic_write_text(out / "report.md", _render(t1, t3))
    atomic_write_json(out / "report.json", {
        "table1": [dict(zip(h1, r)) for r in r1], "table3": [dict(zip(h3, r)) for r in r3],
        "runs": [{"dir": r["dir"], **r["results"]} for r in runs],
    })
    labelled = {}
    for r in runs:
        key = f"{_label(r)} [{r['results'].get('mode', '')}]"
        while key in labelled:
            key += "'"
        labelled[key] = r["history"]
    plot_runs(labelled, out / "accuracy.png", title=", ".join(dict.fromkeys(_group(r) for r in runs)))
    return {"markdown": out / "report.md", "json": out / "report.json", "plot": out / "accuracy.png"}
