"""``szo report RUN_DIR ...``: paper-style tables (Table 1: accuracy by method; Table 3:
converged epoch / time / #FP / #BP / max accuracy; the passes each method needs to reach 90 % and
95 % of the BPTT run's accuracy) as markdown and JSON, plus the test
accuracy vs epoch and vs training time of all runs on one figure (Fig. 3/4).

A RUN_DIR is any directory holding results.json (+ metrics.jsonl, config.yaml); a directory
without one is searched recursively (``szo report runs/demo``), symlinked directories included
(each real directory once, so a run linked twice counts once and a link loop ends). The files
are read only if they are regular files of a bounded size (``MAX_*_BYTES``): a results.json that
links to ``/dev/zero`` or a pipe is one error line, not a read until memory runs out. A federated
run (metrics by ``round``, with wall time) is plotted by round.

Only like runs share a cell: runs with the same dataset/model/label/mode whose resolved configs
(config.yaml) are equal except for the seed and the keys in ``IGNORED_KEYS`` (where files go,
progress bars). Such runs (e.g. several seeds) are reported as ``mean ± std (n=N)``. Runs with
the same label that differ in a setting (say ``train.epochs`` 60 and 3) get one column each,
named by the differing keys (``SZO-CGE (train.epochs=60)``), and :func:`like_runs` returns a
warning naming the keys, which the report prints and writes under "Notes". Runs without a
config.yaml (``szo.train.fit`` called directly) are compared on the settings results.json holds.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from szo.io import atomic_write_json, atomic_write_text, read_regular_bytes
from szo.plots import plot_runs
from szo.train.callbacks import parse_metrics

__all__ = ["collect_runs", "like_runs", "settings", "table1", "table3", "table_target", "first_reaching", "render",
           "write_report", "TARGET_FRACTIONS", "IGNORED_KEYS",
           "MAX_RESULTS_BYTES", "MAX_METRICS_BYTES", "MAX_CONFIG_BYTES"]

MAX_RESULTS_BYTES = 16 << 20
"""The largest results.json the report reads (szo writes a few KB)."""
MAX_METRICS_BYTES = 64 << 20
"""The largest metrics.jsonl the report reads (~100 000 epochs of records)."""
MAX_CONFIG_BYTES = 16 << 20
"""The largest config.yaml the report reads."""

#: config keys that do not change what a run trains (names, where files go, how progress is shown)
IGNORED_KEYS = ("name", "description", "kind", "seed", "progress", "data.data_dir", "data.download",
                "data.num_workers", "subspace.root", "bptt.checkpoint_every_steps",
                "train.checkpoint_every_steps", "distributed.timeout_s")
# the sections a BPTT run's training depends on (its config.yaml also holds the later stages')
_BPTT_SECTIONS = ("model", "data", "loss", "bptt", "device")
# without a config.yaml: the settings results.json records
_RESULT_SETTINGS = ("recipe", "method", "mode", "q", "k", "subspace", "backend", "bn_stats", "activation", "epochs")


#: what a run directory holds before its results.json is written (a run stopped, failed or still running)
_RUN_MARKS = ("config.yaml", "metrics.jsonl", "checkpoints", ".lock")


def _run_dirs(p: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """``p`` if it holds a results.json, else every directory under it that does (sorted),
    symlinked directories followed, each real directory once; and the run directories without a
    results.json (a run that stopped, failed or is still running), each with what it holds."""
    if os.path.lexists(p / "results.json"):
        return [p], []
    found, unfinished, seen = [], [], set()
    for root, dirs, files in os.walk(p, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # reached again through a link (or a link loop): once is enough
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        if "results.json" in files:
            found.append(Path(root))
            continue
        marks = [m for m in _RUN_MARKS if m in files or m in dirs]
        if marks and marks != [".lock"]:
            unfinished.append((Path(root), ", ".join(marks)))
    return sorted(found), sorted(unfinished)


def _unfinished_line(unfinished: Sequence[tuple[Path, str]]) -> str:
    return (f"left out {len(unfinished)} run(s) without results.json (stopped before its end, failed, or still "
            "running; `szo recipe ... --resume` finishes one): "
            + "; ".join(f"{d} (holds {what})" for d, what in unfinished))


def _text(path: Path, max_bytes: int, what: str) -> str:
    try:
        return read_regular_bytes(path, max_bytes, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e}); it is not an szo {what}") from None


def collect_runs(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Load results.json + metrics.jsonl of every run under ``paths`` (sorted by path)."""
    paths = list(paths)
    found: list[Path] = []
    unfinished: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"run directory {p} does not exist")
        done, left = _run_dirs(p)
        found += done
        unfinished += left
    if not found:
        more = f"; {_unfinished_line(unfinished)}" if unfinished else ""
        raise ValueError(f"no results.json under {', '.join(map(str, paths))}; valid: run directories written by szo "
                         f"recipe{more}")
    if unfinished:
        print(f"warning: {_unfinished_line(unfinished)}", file=sys.stderr)
    runs = []
    diverged = []
    unique: dict[str, Path] = {}
    for d in found:  # a run named twice (a path and a link to it) is one run
        unique.setdefault(os.path.realpath(d), d)
    for d in unique.values():
        res = _read_results(d / "results.json")
        if res.get("status") == "diverged":  # szo.train.fit stopped it: no figure to report
            diverged.append(str(d))
            continue
        hist = (parse_metrics(_text(d / "metrics.jsonl", MAX_METRICS_BYTES, "metrics file").splitlines())
                if os.path.lexists(d / "metrics.jsonl") else [])
        if not all(isinstance(h, dict) for h in hist):
            raise ValueError(f"{d / 'metrics.jsonl'} holds a line that is not a JSON object; it is not an szo metrics file")
        cfg = None
        if os.path.lexists(d / "config.yaml"):
            try:
                cfg = yaml.safe_load(_text(d / "config.yaml", MAX_CONFIG_BYTES, "config file"))
            except yaml.YAMLError as e:
                raise ValueError(f"{d / 'config.yaml'} is not valid YAML ({e}); fix or remove it") from None
        runs.append({"dir": str(d), "results": res, "history": hist, "config": cfg})
    if diverged:
        print(f"warning: left out {len(diverged)} diverged run(s) (results.json status 'diverged'): "
              + ", ".join(diverged), file=sys.stderr)
    if not runs:
        raise ValueError(f"every run under {', '.join(map(str, paths))} diverged; nothing to report")
    return runs


_NUMBERS = ("best_test_acc", "final_test_acc", "fp", "bp", "steps", "epochs", "train_time_min", "wall_time_min",
            "converged_fp", "converged_bp", "converged_time_min", "d", "k", "q")


def _read_results(path: Path) -> dict[str, Any]:
    """A results.json checked for the shape the report reads: a JSON object whose figures are numbers."""
    try:
        res = json.loads(_text(path, MAX_RESULTS_BYTES, "results file"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it is not an szo results file") from None
    if not isinstance(res, dict):
        raise ValueError(f"{path} is a JSON {type(res).__name__}, not an object; it is not an szo results file")
    for key in _NUMBERS:
        v = res.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{path}: {key!r} is {v!r}, not a number; it is not an szo results file")
    return res


def _group(r: dict[str, Any]) -> str:
    """``dataset / model`` from results.json, else from config.yaml (a federated run's results
    name neither)."""
    res, cfg = r["results"], r.get("config")
    cfg = cfg if isinstance(cfg, dict) else {}

    def from_cfg(section: str) -> Any:
        sec = cfg.get(section)
        return sec.get("name") if isinstance(sec, dict) else None

    return f"{res.get('dataset') or from_cfg('data') or '?'} / {res.get('model') or from_cfg('model') or '?'}"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _curve(hist: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records the accuracy plot reads (``epoch``, ``train_time_s``, ``test_acc``): a federated
    run's records count rounds, its ``round`` and ``wall_time_s`` stand in; a record without the
    three numbers (not evaluated, or not an szo record) is not plotted."""
    out = []
    for h in hist:
        x = h.get("epoch", h.get("round"))
        t = h.get("train_time_s", h.get("wall_time_s"))
        if _number(x) and _number(t) and _number(h.get("test_acc")):
            out.append({"epoch": x, "train_time_s": t, "test_acc": h["test_acc"]})
    return out


def _base_label(r: dict[str, Any]) -> str:
    return str(r["results"].get("label") or r["results"].get("method") or Path(r["dir"]).name)


def _label(r: dict[str, Any]) -> str:
    """The column a run is reported in (:func:`like_runs` names the variants of a label)."""
    return r.get("column") or _base_label(r)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return {k.rstrip("."): v for k, v in out.items()}


def settings(r: dict[str, Any]) -> dict[str, Any]:
    """What a run trained with, as flat ``section.key`` values: its config.yaml without the
    seed, ``IGNORED_KEYS`` and the sections its stage does not use (plus the number of
    processes, which changes the times)."""
    res, cfg = r["results"], r.get("config")
    world = int((res.get("distributed") or {}).get("world_size", 1))
    if not isinstance(cfg, dict):
        flat = {k: res.get(k) for k in _RESULT_SETTINGS if k in res}
    else:
        if res.get("mode") == "bptt":
            cfg = {k: v for k, v in cfg.items() if k in _BPTT_SECTIONS}
        else:
            cfg = {k: v for k, v in cfg.items() if k not in ("bptt", "trajectory")}
            if cfg.get("backend") != "fixed":
                cfg.pop("hw", None)
            if world == 1:
                cfg.pop("distributed", None)
        flat = {k: v for k, v in _flatten(cfg).items() if k not in IGNORED_KEYS}
    flat["processes"] = world
    return flat


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) or v is None else str(v)


# differing keys are named in this order (then alphabetically): the likeliest reasons first
_KEY_ORDER = ("train.epochs", "bptt.epochs", "train.max_steps_per_epoch", "bptt.max_steps_per_epoch", "szo.q",
              "szo.mu", "train.lr", "bptt.lr", "subspace.name", "subspace.k", "processes", "device")


def _variant_names(sets: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """``k=v, ...`` per settings dict, naming only keys that tell variants apart (taken in
    ``keys`` order while they split a group further)."""
    def sig(st, ks):
        return json.dumps([st.get(k, "-") for k in ks], default=str)

    distinct = len({sig(st, keys) for st in sets})
    chosen: list[str] = []
    for k in keys:
        if len({sig(st, chosen + [k]) for st in sets}) > len({sig(st, chosen) for st in sets}):
            chosen.append(k)
        if len({sig(st, chosen) for st in sets}) == distinct:
            break
    return [", ".join(f"{k}={_show(st.get(k, '-'))}" for k in chosen) for st in sets]


def like_runs(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs with ``column`` set so that a column holds only like runs, and one warning per
    label whose runs differ in settings (those are split into one column per variant, named by
    the fewest differing keys that tell the variants apart)."""
    runs = [dict(r) for r in runs]
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        r.pop("column", None)
        cells.setdefault((_group(r), _base_label(r), r["results"].get("mode")), []).append(r)
    warnings: list[str] = []
    for (group, label, mode), rs in cells.items():
        sets = [settings(r) for r in rs]
        keys = sorted({k for st in sets for k in st if any(o.get(k, "-") != st.get(k, "-") for o in sets)},
                      key=lambda k: (_KEY_ORDER.index(k) if k in _KEY_ORDER else len(_KEY_ORDER), k))
        if not keys:
            continue
        variants: dict[str, int] = {}
        for r, name in zip(rs, _variant_names(sets, keys)):
            r["column"] = f"{label} ({name})"
            variants[r["column"]] = variants.get(r["column"], 0) + 1
        warnings.append(f"{group}: the {len(rs)} {label} runs ({mode or '?'}) differ in {', '.join(keys)}; "
                        f"reported apart, not averaged: " + "; ".join(f"{v} (n={n})" for v, n in variants.items()))
    return runs, warnings


def _fmt(vals: Sequence[float], scale: float = 1.0, nd: int = 2, n: bool = False) -> str:
    """``mean ± std`` of the values (just the value for one run); ``n`` appends ``(n=N)``."""
    vals = [v * scale for v in vals if _number(v)]  # a figure a run could not give ("n/a") is left out
    if not vals:
        return "-"
    if len(vals) == 1:
        out = f"{vals[0]:.{nd}f}"
    else:
        out = f"{statistics.mean(vals):.{nd}f} ± {statistics.stdev(vals):.{nd}f}"
    return f"{out} (n={len(vals)})" if n else out


def _params(d: Any) -> str:
    if not isinstance(d, int):
        return "-"
    return f"{d / 1e6:.2f}M" if d >= 1e5 else f"{d / 1e3:.1f}K"


def table1(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Accuracy (%) by method (paper Table 1): one row per dataset/model, one column per label.
    Uses the maximum test accuracy of each run; scratch and BPTT runs only. A cell is
    ``mean ± std (n=N)`` over like runs (:func:`like_runs`)."""
    runs = [r for r in like_runs(runs)[0] if r["results"].get("mode") in ("bptt", "scratch", None)]
    labels = list(dict.fromkeys(_label(r) for r in runs))
    header = ["Dataset", "Model", "Params", *labels]
    rows = []
    for g in dict.fromkeys(_group(r) for r in runs):
        rs = [r for r in runs if _group(r) == g]
        ds, model = g.split(" / ")
        row = [ds, model, _params(rs[0]["results"].get("d"))]
        for lab in labels:
            row.append(_fmt([r["results"].get("best_test_acc") for r in rs if _label(r) == lab], 100.0, n=True))
        rows.append(row)
    return header, rows


_T3 = ("converged epoch", "converged time (min)", "#FP", "#BP", "max acc (%)")


def table3(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Training cost to the maximum accuracy (paper Table 3), continual and from-scratch halves.
    BPTT runs count as from scratch. Cells are mean ± std over like runs; ``max acc`` says n."""
    runs = like_runs(runs)[0]
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
                    _fmt([s.get("best_test_acc") for s in sel], 100.0, n=True),
                ]
            rows.append(row)
    return header, rows


TARGET_FRACTIONS = (0.9, 0.95)
"""The targets of :func:`table_target`: these fractions of the BPTT run's maximum test accuracy."""


def first_reaching(history: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluated record of ``history`` whose test accuracy is at least ``target`` (a fraction),
    or None when the run never got there. Its ``fp`` / ``bp`` are the passes spent up to it."""
    return next((h for h in history if _number(h.get("test_acc")) and h["test_acc"] >= target), None)


def table_target(runs: Sequence[dict[str, Any]],
                 fractions: Sequence[float] = TARGET_FRACTIONS) -> tuple[list[str], list[list[str]]]:
    """Passes to a fraction of BP's accuracy: per dataset / model whose runs include a BPTT run (its
    maximum test accuracy, the mean over like BPTT runs, is BP's), for every method the forwards
    (#FP) and backwards (#BP) up to the first evaluation at or above each fraction of it. A cell is
    the mean over the like runs that got there; ``(r of n)`` when only r of the n did, ``not reached``
    when none did. Groups without a BPTT run have no target and no rows."""
    runs = like_runs(runs)[0]
    header = ["Dataset / Model", "Method", "mode", "BP max acc (%)"]
    for f in fractions:
        header += [f"#FP to {100 * f:g} % of BP", f"#BP to {100 * f:g} % of BP"]
    rows = []
    for g in dict.fromkeys(_group(r) for r in runs):
        rs = [r for r in runs if _group(r) == g]
        ref = [r["results"].get("best_test_acc") for r in rs if r["results"].get("mode") == "bptt"]
        ref = [v for v in ref if _number(v)]
        if not ref:
            continue
        bp_acc = statistics.mean(ref)
        for lab, mode in dict.fromkeys((_label(r), r["results"].get("mode")) for r in rs):
            sel = [r for r in rs if _label(r) == lab and r["results"].get("mode") == mode]
            row = [g, lab, str(mode or "-"), f"{100 * bp_acc:.2f}"]
            for f in fractions:
                hits = [h for h in (first_reaching(r["history"], f * bp_acc) for r in sel) if h is not None]
                if not hits:
                    row += ["not reached", "-"]
                    continue
                part = "" if len(hits) == len(sel) else f" ({len(hits)} of {len(sel)})"
                row += [_fmt([h.get("fp") for h in hits], nd=0) + part, _fmt([h.get("bp") for h in hits], nd=0)]
            rows.append(row)
    return header, rows


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


Table = tuple[list[str], list[list[str]]]


def render(runs: Sequence[dict[str, Any]]) -> str:
    """Both tables as markdown (with the :func:`like_runs` warnings as notes)."""
    return _render(table1(runs), table3(runs), like_runs(runs)[1], table_target(runs))


def _render(t1: Table, t3: Table, notes: Sequence[str] = (), tt: Table | None = None) -> str:
    (h1, r1), (h3, r3) = t1, t3
    out = ["## Accuracy (%) by method (max test accuracy; layout of paper Table 1)", "",
           "Each cell: mean ± std over n runs with the same settings except the seed.", "",
           _markdown(h1, r1), "",
           "## Training cost to the maximum accuracy (layout of paper Table 3)", "",
           "Converged epoch = epoch of the maximum test accuracy; time = training time to it (evaluation "
           "excluded); #FP / #BP = forward / backward passes to it.", "", _markdown(h3, r3), ""]
    if tt is not None and tt[1]:
        out += ["## Passes to a fraction of BP's accuracy", "",
                "BP = the maximum test accuracy of the BPTT run of the same dataset / model; #FP / #BP = forward / "
                "backward passes up to the first evaluation at or above the fraction of it.", "",
                _markdown(*tt), ""]
    if notes:
        out += ["## Notes", "", *(f"* {n}" for n in notes), ""]
    return "\n".join(out)


def write_report(runs: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> dict[str, Path]:
    """report.md, report.json and accuracy.png in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t1, t3, tt = table1(runs), table3(runs), table_target(runs)  # computed once for both files
    (h1, r1), (h3, r3), (ht, rt) = t1, t3, tt
    labelled, notes = like_runs(runs)
    atomic_write_text(out / "report.md", _render(t1, t3, notes, tt))
    atomic_write_json(out / "report.json", {
        "table1": [dict(zip(h1, r)) for r in r1], "table3": [dict(zip(h3, r)) for r in r3],
        "target": [dict(zip(ht, r)) for r in rt], "notes": notes,
        "runs": [{"dir": r["dir"], "column": _label(r), **r["results"]} for r in labelled],
    })
    groups = list(dict.fromkeys(_group(r) for r in labelled))
    curves: dict[str, list] = {}
    for r in labelled:
        mode = r["results"].get("mode")
        key = _label(r) + (f" [{mode}]" if mode else "") + (f" {_group(r)}" if len(groups) > 1 else "")
        curves.setdefault(key, []).append(_curve(r["history"]))
    plot_runs(curves, out / "accuracy.png", title=", ".join(groups))
    return {"markdown": out / "report.md", "json": out / "report.json", "plot": out / "accuracy.png"}
