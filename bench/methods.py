"""docs/methods.md: every forward-only method of the seeds on digits and the same SNN, one command per row.

Each row is ``szo recipe digits-scratch --set method=M [--set ...]`` (spike_convnet, T = 4,
the digits-bp subspace k = 20 as reference / basis, the recipe's method_defaults), run in its
own process with OMP_NUM_THREADS=1. Recorded per row: best and final test accuracy, #FP and
#BP of the whole run (results.json), the fit's wall time, and two memory figures:

* ``step_alloc_peak_kb``: peak CPU tensor memory of one training step of that method (the
  allocator's alloc/free events, ``bench/common.cpu_alloc_peak``), on a batch of the recipe's
  size: what the method itself needs, deterministic;
* ``peak_rss_mb``: the peak RSS of the whole run's process (``ru_maxrss`` from ``wait4``),
  which includes the Python + torch baseline (~0.3 GB) and the data.

The digits-bp subspace is built first if the store lacks it (not timed).

    python bench/methods.py                       # all rows -> bench/results/methods.json + a markdown table
    python bench/methods.py --rows fg fg-subspace  # some rows
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

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "digits-scratch"
# name -> (label, --set overrides beyond method=name); every row is one `szo recipe` command
ROWS: dict[str, tuple[str, list[str]]] = {
    "bp": ("BP", []),
    "bp-subspace": ("BP-Subspace", []),
    "szo-cge": ("SZO-CGE", []),
    "szo-rge": ("SZO-RGE (q=1)", []),
    "zo-cge": ("full-space ZO-CGE", []),
    "fg": ("forward gradient, full space (q=1)", []),
    "fg-subspace": ("forward gradient, subspace (q=1)", []),
    "tt-zo": ("TT-ZO (rank 4, signRGE -> CGE)", []),
}
# rows of issue 14 parts 3-4, measured by their own commands when those methods land
PENDING = ["node perturbation", "quantized ZO (MCU, integer update)", "BAFFLE-federated (8 clients)"]


def command(name: str, out: Path, root: Path) -> list[str]:
    sets = [f"method={name}", *ROWS[name][1], f"subspace.root={root}", "progress=false"]
    return [sys.executable, "-m", "szo", "recipe", RECIPE, *sum((["--set", s] for s in sets), []), "--out", str(out)]


def _ensure_subspace(root: Path, runs: Path) -> None:
    from szo.config import load_recipe
    from szo.pipeline import run_recipe, subspace_store_for

    cfg = load_recipe("digits-bp", [f"subspace.root={root}", "progress=false"])
    try:
        subspace_store_for(cfg).load(cfg["subspace"]["name"])
    except (ValueError, FileNotFoundError, KeyError):
        run_recipe(cfg, runs / "_bptt")


def step_peak(name: str, root: Path) -> int | None:
    """Allocator peak (bytes) of one step of method ``name``, set up as the recipe run sets it up."""
    from szo.config import load_recipe
    from szo.data import get_dataset
    from szo.optim import build_optimizer
    from szo.pipeline import _loss, build_model, subspace_store_for

    cfg = load_recipe(RECIPE, [f"method={name}", *ROWS[name][1], f"subspace.root={root}", "progress=false"])
    model = build_model(cfg)
    sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=model)
    model.load_flat_params(sub.reference)
    tt = cfg["tt"]
    if name == "tt-zo":
        from szo.models.tt import tt_parametrize

        tt_parametrize(model, tt["rank"], cores=tt["cores"], min_params=tt["min_params"])
    tr, sz = cfg["train"], cfg["szo"]
    opt = build_optimizer(name, model, subspace=sub, lr=tr["lr"], momentum=tr["momentum"],
                          weight_decay=tr["weight_decay"], mu=sz["mu"], q=sz["q"],
                          coords_per_step=sz["coords_per_step"], generator=torch.Generator().manual_seed(0),
                          tt={k: tt[k] for k in ("sign_lr", "sign_q", "sign_mu", "window", "tol", "switch_step")})
    ds = get_dataset("digits", "train")
    n = cfg["data"]["batch_size"]
    x = torch.stack([ds[i][0] for i in range(n)])
    y = torch.tensor([ds[i][1] for i in range(n)])
    loss_fn = _loss(cfg)
    model.train()
    if getattr(opt, "forward_only", False):
        def closure():
            with torch.no_grad():
                return loss_fn(model(x), y)
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
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read() if proc.stderr else ""
    if status != 0:
        raise RuntimeError(f"row {name!r} failed ({' '.join(cmd)}):\n{err[-2000:]}")
    res = json.loads((out / "results.json").read_text())
    peak = step_peak(name, root)
    return {"method": name, "label": ROWS[name][0], "command": "szo recipe " + " ".join(cmd[4:-2]),
            "epochs": res["epochs"], "best_test_acc": res["best_test_acc"], "final_test_acc": res["final_test_acc"],
            "fp": res["fp"], "bp": res["bp"], "fit_wall_min": res["wall_time_min"],
            "train_time_min": res["train_time_min"], "process_wall_s": wall,
            "peak_rss_mb": usage.ru_maxrss / 1024, "step_alloc_peak_kb": None if peak is None else peak / 1024,
            "tt": res.get("tt")}


def table(rows: list[dict]) -> str:
    lines = ["| method | epochs | best / final test acc (%) | #FP | #BP | fit wall (min) | step alloc peak (KiB) "
             "| run peak RSS (MB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "n/a" if r["step_alloc_peak_kb"] is None else f"{r['step_alloc_peak_kb']:,.0f}"
        lines.append(f"| {r['label']} | {r['epochs']} | {100 * r['best_test_acc']:.2f} / {100 * r['final_test_acc']:.2f} "
                     f"| {r['fp']:,} | {r['bp']:,} | {r['fit_wall_min']:.2f} | {peak} | {r['peak_rss_mb']:.0f} |")
    for p in PENDING:
        lines.append(f"| {p} | to be measured (issue 14) | | | | | | |")
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
            merged.update({r["method"]: r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]})
        print(table([merged[n] for n in ROWS if n in merged]))
        return
    torch.set_num_threads(1)
    runs = Path(args.runs)
    root = Path(args.root) if args.root else runs / "subspaces"
    _ensure_subspace(root, runs)
    old = {r["method"]: r for r in json.loads(path.read_text())["rows"]} if path.is_file() else {}
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
