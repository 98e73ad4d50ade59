"""docs/methods.md: every forward-only method of the seeds on digits and the same SNN, one command per row.

Each row is one ``szo`` command (spike_convnet, T = 4, seed 0, the digits-bp subspace k = 20 as
reference / basis, the recipe's method_defaults): ``szo recipe digits-scratch --set method=M
[--set ...]`` for most rows, ``szo recipe digits-fixed --set method=qzo-subspace`` for the subspace integer learner
and ``szo federated digits-scratch --clients 8`` for BAFFLE, each run in its own process with
OMP_NUM_THREADS=1. Recorded per row: best and final test accuracy, #FP and #BP of the whole run
(results.json), the fit's wall time, and two memory figures:

* ``step_alloc_peak_kb``: peak CPU tensor memory of one training step of that method (the
  allocator's alloc/free events, ``bench/common.cpu_alloc_peak``), on a batch of the recipe's
  size: what the method itself needs, deterministic (not for the integer learner and BAFFLE,
  which ``build_optimizer`` does not build);
* ``peak_rss_mb``: the peak RSS of the whole run's process (``ru_maxrss`` from ``wait4``: for
  BAFFLE the largest of the server and client processes), which includes the Python + torch
  baseline (~0.9 GB here) and the data.

The digits-bp subspace is built first if the store lacks it (not timed).

    python bench/methods.py                       # all rows -> bench/results/methods.json + a markdown table
    python bench/methods.py --rows fg fg-subspace  # some rows (merged into the saved JSON)
    python bench/methods.py --rows fg --name methods-fg   # into bench/results/methods-fg.json
    python bench/methods.py --table-only methods methods-fg   # print the table of saved JSONs (merged)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, cpu_alloc_peak, machine_info, median_time, write_result  # noqa: E402

from szo.pipeline import DIGITS_RGE_UNITS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "digits-scratch"
# row -> label, method, recipe and --set overrides beyond method=...; "federated": `szo federated` options
# instead of `szo recipe`. Every row is one command. The subspace methods with a relative default scale pin
# the absolute mu / lr their rows were measured with (App. G's mu 1 / lr 1; SZO-RGE / SZO-1pt: the demo's
# hand-tuned values, szo.pipeline).
ABSOLUTE = ["szo.scale=absolute"]
ROWS: dict[str, dict] = {
    "bp": {"label": "BP", "method": "bp"},
    "bp-subspace": {"label": "BP-Subspace", "method": "bp-subspace", "sets": ABSOLUTE},
    "szo-cge": {"label": "SZO-CGE", "method": "szo-cge", "sets": ABSOLUTE},
    "szo-rge": {"label": "SZO-RGE (q=1)", "method": "szo-rge", "sets": list(DIGITS_RGE_UNITS)},
    "szo-cge-1pt": {"label": "SZO-CGE (one-point), the paper's Table 13 ablation", "method": "szo-cge-1pt",
                    "sets": ABSOLUTE},
    "szo-cge-1pt-mu0.1": {"label": "the same with mu = 0.1", "method": "szo-cge-1pt",
                          "sets": [*ABSOLUTE, "szo.mu=0.1"]},
    "szo-1pt": {"label": "SZO one-point along q=1 random direction (szo's variant)", "method": "szo-1pt",
                "sets": list(DIGITS_RGE_UNITS)},
    "zo-cge": {"label": "full-space ZO-CGE (20 coords / step)", "method": "zo-cge"},
    "fg": {"label": "forward gradient, full space (q=1)", "method": "fg"},
    "fg-subspace": {"label": "forward gradient, subspace (q=1)", "method": "fg-subspace"},
    "asyncfgd": {"label": "AsyncFGD iterates, K = 2 stages (one process)", "method": "asyncfgd"},
    "asyncfgd-k1": {"label": "the same with K = 1: vanilla FGD, plain SGD", "method": "asyncfgd",
                    "sets": ["szo.stages=1"]},
    "asyncfgd-adam": {"label": "AsyncFGD-Adam (Algorithm 2), K = 2", "method": "asyncfgd-adam"},
    "tt-zo": {"label": "TT-ZO (rank 4, 4 cores, signRGE -> one-sided CGE: the paper's)", "method": "tt-zo"},
    "tt-zo-2c-central": {"label": "TT-ZO, 2 cores, central CGE (szo's earlier default)", "method": "tt-zo",
                         "sets": ["tt.cores=2", "tt.cge=central"]},
    "np-zo": {"label": "node perturbation, layer-wise (q=4 per layer)", "method": "np-zo"},
    "wp-zo": {"label": "weight perturbation, layer-wise (q=4 per layer)", "method": "wp-zo"},
    "awp-zo": {"label": "adaptive weight / node perturbation (q=4)", "method": "awp-zo"},
    "awp-zo-fc": {"label": "sparse: only `fc` (node perturbation, q=4)", "method": "awp-zo",
                  "sets": ["szo.layers=[fc]"]},
    "qzo": {"label": "quantized ZO, eq. 8, on SZO's subspace coordinates, integer forward (q=20)", "method": "qzo-subspace", "recipe": "digits-fixed",
            "sets": ["train.epochs=20"]},
    "mcu-zo": {"label": "seed 004's learner: int8 weights, 1-LSB Rademacher, adaptive WP/NP, eq. 8 (q=10)",
               "method": "mcu-zo", "recipe": "digits-fixed"},
    "baffle": {"label": "BAFFLE, 8 clients, subspace, K = 20, 100 rounds", "method": "baffle",
               "federated": ["--clients", "8", "--rounds", "100"]},
}


def _sets(row: dict) -> list[str]:
    return [] if "federated" in row else [f"method={row['method']}", *row.get("sets", [])]


def command(name: str, out: Path, root: Path) -> list[str]:
    row = ROWS[name]
    sets = [*_sets(row), f"subspace.root={root}", "progress=false"]
    head = (["federated", RECIPE, *row["federated"]] if "federated" in row
            else ["recipe", row.get("recipe", RECIPE)])
    return [sys.executable, "-m", "szo", *head, *sum((["--set", s] for s in sets), []), "--out", str(out)]


def short(name: str) -> str:
    """The row's command in the table's first column."""
    row = ROWS[name]
    if "federated" in row:
        return "`szo federated " + " ".join([RECIPE, *row["federated"]]) + "`"
    extra = "".join(f" + `{s}`" for s in row.get("sets", []))
    return f"`{row['method']}`{extra}" + (f" ({row['recipe']})" if "recipe" in row else "")


def _ensure_subspace(root: Path, runs: Path) -> None:
    from szo.build import subspace_store_for
    from szo.config import load_recipe
    from szo.pipeline import run_recipe

    cfg = load_recipe("digits-bp", [f"subspace.root={root}", "progress=false"])
    try:
        subspace_store_for(cfg).load(cfg["subspace"]["name"])
    except (ValueError, FileNotFoundError, KeyError):
        run_recipe(cfg, runs / "_bptt")


def step_peak(name: str, root: Path) -> int | None:
    """Allocator peak (bytes) of one step of row ``name``, set up as the recipe run sets it up
    (None for the integer learner and BAFFLE, which ``build_optimizer`` does not build)."""
    from szo.build import build_model, loss_for, subspace_store_for
    from szo.config import load_recipe
    from szo.data import get_dataset
    from szo.methods import QZO_METHODS
    from szo.optim import RunOptions, build_optimizer
    from szo.prepare import optimizer_options

    row = ROWS[name]
    if "federated" in row or row["method"] in QZO_METHODS:
        return None
    name = row["method"]
    cfg = load_recipe(row.get("recipe", RECIPE), [*_sets(row), f"subspace.root={root}", "progress=false"])
    model = build_model(cfg)
    sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=model)
    model.load_flat_params(sub.reference)
    tt = cfg["tt"]
    if name == "tt-zo":
        from szo.models.tt import tt_parametrize

        tt_parametrize(model, tt["rank"], cores=tt["cores"], min_params=tt["min_params"])
    opt = build_optimizer(name, model, subspace=sub, options=optimizer_options(cfg),
                          run=RunOptions(generator=torch.Generator().manual_seed(0)))
    ds = get_dataset("digits", "train")
    n = cfg["data"]["batch_size"]
    x = torch.stack([ds[i][0] for i in range(n)])
    y = torch.tensor([ds[i][1] for i in range(n)])
    loss_fn = loss_for(cfg)
    model.train()
    if getattr(opt, "forward_only", False):
        red = {"reduction": "none"} if opt.loss_reduction == "none" else {}  # per-sample node perturbation

        def closure():
            with torch.no_grad():
                return loss_fn(model(x), y, **red)
    else:
        def closure():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss
    opt.step(closure)  # warm-up (lazy init, scripted functions)
    return cpu_alloc_peak(lambda: opt.step(closure))


def jvp_over_forward(batch: int = 64, reps: int = 20) -> dict:
    """Time of one FG JVP pass (ForwardGradient step, q = 1, lr 0) / one plain no-grad forward, same process."""
    import szo.models as M
    from szo.losses import tet_loss
    from szo.optim import ForwardGradient

    torch.manual_seed(0)
    model = M.create("spike_convnet", num_classes=10, T=4).train()
    x, y = torch.rand(batch, 1, 8, 8) * 2, torch.randint(0, 10, (batch,))
    opt = ForwardGradient(model.parameters(), model=model, lr=0.0, momentum=0.0)
    closure = lambda: tet_loss(model(x), y)  # noqa: E731

    def plain():
        with torch.no_grad():
            closure()

    t_fwd, _ = median_time(plain, reps)
    t_jvp, _ = median_time(lambda: opt.step(closure), reps)
    return {"batch": batch, "forward_ms": 1e3 * t_fwd, "jvp_pass_ms": 1e3 * t_jvp, "ratio": t_jvp / t_fwd}


def run_row(name: str, runs: Path, root: Path) -> dict:
    out = runs / name
    cmd = command(name, out, root)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read() if proc.stderr else ""  # read before waiting: a full pipe would block the child
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"row {name!r} failed ({' '.join(cmd)}):\n{err[-2000:]}")
    res = json.loads((out / "results.json").read_text())
    peak = step_peak(name, root)
    return {"row": name, "method": ROWS[name]["method"], "label": ROWS[name]["label"],
            "command": "szo " + " ".join(cmd[3:-2]),
            "epochs": res.get("epochs"), "rounds": res.get("rounds"),
            "best_test_acc": res["best_test_acc"], "final_test_acc": res["final_test_acc"],
            "fp": res["fp"], "bp": res["bp"], "fit_wall_min": res["wall_time_min"],
            "train_time_min": res.get("train_time_min"), "process_wall_s": wall,
            "peak_rss_mb": usage.ru_maxrss / 1024, "step_alloc_peak_kb": None if peak is None else peak / 1024,
            "tt": res.get("tt"), "bytes_down_per_round": res.get("bytes_down_per_round"),
            "bytes_up_per_round": res.get("bytes_up_per_round"), "loadavg_1m_after": os.getloadavg()[0]}


def table(rows: list[dict]) -> str:
    lines = ["| `method=` | method | epochs | best / final test acc (%) | #FP | #BP | fit wall (min) "
             "| step alloc peak (KiB) | run peak RSS (MB) |", "|---|---|---|---|---|---|---|---|---|"]
    from szo.methods import FG_METHODS

    for r in rows:
        peak = "n/a" if r["step_alloc_peak_kb"] is None else f"{r['step_alloc_peak_kb']:,.0f}"
        epochs = r["epochs"] if r.get("epochs") is not None else f"({r['rounds']} rounds)"
        fp = f"{r['fp']:,}" + (" (JVP)" if r["method"] in FG_METHODS else "")
        rss = f"{r['peak_rss_mb']:,.0f}" + (" (largest process)" if "federated" in ROWS[r["row"]] else "")
        lines.append(f"| {short(r['row'])} | {r['label']} | {epochs} "
                     f"| {100 * r['best_test_acc']:.2f} / {100 * r['final_test_acc']:.2f} "
                     f"| {fp} | {r['bp']:,} | {r['fit_wall_min']:.2f} | {peak} | {rss} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--runs", default=str(ROOT / "runs" / "methods"), help="run directories")
    p.add_argument("--root", default=None, help="subspace store (default: RUNS/subspaces)")
    p.add_argument("--name", default="methods", help="result name (bench/results/NAME.json)")
    p.add_argument("--table-only", nargs="*", metavar="NAME",
                   help="print the table of saved results (several names are merged, later ones win)")
    args = p.parse_args(argv)
    path = RESULTS / f"{args.name}.json"
    if args.table_only is not None:
        merged: dict = {}
        for name in args.table_only or [args.name]:
            merged.update({r.get("row", r["method"]): r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]})
        print(table([merged[n] for n in ROWS if n in merged]))
        return
    torch.set_num_threads(1)
    runs = Path(args.runs)
    root = Path(args.root) if args.root else runs / "subspaces"
    _ensure_subspace(root, runs)
    old = {r.get("row", r["method"]): r for r in json.loads(path.read_text())["rows"]} if path.is_file() else {}
    for name in args.rows:
        old[name] = run_row(name, runs, root)
        print(f"{name}: {100 * old[name]['best_test_acc']:.2f} % best, #FP {old[name]['fp']:,}, "
              f"{old[name]['fit_wall_min']:.2f} min", flush=True)
        rows = [old[n] for n in ROWS if n in old]
        write_result(args.name, {"bench": "methods", "recipe": RECIPE, "machine": machine_info(), "rows": rows})
    ratio = jvp_over_forward()
    write_result(args.name, {"bench": "methods", "recipe": RECIPE, "machine": machine_info(), "rows": rows,
                             "jvp_over_forward": ratio})
    print(table(rows))
    print(f"one JVP pass = {ratio['ratio']:.2f} plain forwards ({ratio['jvp_pass_ms']:.1f} ms vs "
          f"{ratio['forward_ms']:.1f} ms, batch {ratio['batch']})")


if __name__ == "__main__":
    main()
