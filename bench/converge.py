"""Time and forward passes to reach a target test accuracy on digits (paper Table 3 on the embedded default).

Runs the digits quickstart's training stages with their recipe settings, one after the other
in this process (BPTT with trajectory -> k=20 subspace -> BP-Subspace, SZO-CGE, SZO-RGE(q=1)
from scratch), then reads each run's metrics.jsonl: the first epoch whose test accuracy
reaches ``--target``, the training time to it (evaluation excluded, as in Table 3) and #FP /
#BP to it, plus the maximum accuracy. BP's time counts only its own training; the subspace
methods' time does not include the BPTT stage that built their subspace (the paper's Table 3
convention: "measured starting from the beginning of the ... training stage").

Writes bench/results/converge.json and converge.png (test accuracy against #FP and against
training time). Runs live in bench/results/converge/ and are reused when complete (delete the
directory for fresh timings).

    python bench/converge.py                 # target 95 %, full recipe settings (~8 min, one thread)
    python bench/converge.py --quick         # fewer epochs (smoke test)
    python bench/converge.py --compile       # the same with compile=true (compile time included)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from common import RESULTS, machine_info, set_threads, write_result

from szo.pipeline import DIGITS_RGE_UNITS, PAPER_UNITS

METHODS = {  # name -> (recipe, overrides); the paper's units (App. G's mu 1 / lr 1, SZO-RGE's hand-tuned
    # absolute values: the demo's, szo.pipeline) and the subspace methods' default scale, nothing set
    "BP": ("digits-bp", []),
    "BP-Subspace": ("digits-scratch", ["method=bp-subspace", *PAPER_UNITS]),
    "SZO-CGE": ("digits-scratch", ["method=szo-cge", *PAPER_UNITS]),
    "SZO-RGE(q=1)": ("digits-scratch", ["method=szo-rge", "szo.q=1", *DIGITS_RGE_UNITS]),
    "BP-Subspace, default scale": ("digits-scratch", ["method=bp-subspace"]),
    "SZO-CGE, default scale": ("digits-scratch", ["method=szo-cge"]),
    "SZO-RGE(q=1), default scale": ("digits-scratch", ["method=szo-rge", "szo.q=1"]),
}


def first_reaching(history: list[dict], target: float) -> dict | None:
    for r in history:
        if r.get("test_acc") is not None and r["test_acc"] >= target:
            return r
    return None


def run_all(out: Path, quick: bool, compile_: bool = False) -> dict[str, list[dict]]:
    from szo.config import load_recipe
    from szo.pipeline import run_recipe, run_subspace_stage

    base = [f"subspace.root={(out / 'subspaces').resolve()}", "progress=false", f"compile={str(compile_).lower()}"]
    if quick:
        base += ["bptt.epochs=3", "train.epochs=2", "subspace.k=6"]
    histories = {}
    for name, (recipe, sets) in METHODS.items():
        run_dir = out / re.sub(r"[^0-9A-Za-z]+", "-", name).strip("-")
        if not (run_dir / "results.json").is_file():
            cfg = load_recipe(recipe, base + sets)
            print(f"[converge] {name} ...", flush=True)
            if recipe == "digits-bp":
                run_recipe(cfg, run_dir, resume=True)
            else:
                run_subspace_stage(cfg, run_dir, resume=True)
        histories[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return histories


def plot(histories: dict[str, list[dict]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, h in histories.items():
        pts = [r for r in h if r.get("test_acc") is not None]
        axes[0].plot([r["fp"] for r in pts], [100 * r["test_acc"] for r in pts], marker=".", label=name)
        axes[1].plot([r["train_time_s"] for r in pts], [100 * r["test_acc"] for r in pts], marker=".", label=name)
    for ax, xl in zip(axes, ("forward passes (#FP)", "training time (s)")):
        ax.axhline(100 * target, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"digits (spike_convnet): time to {100 * target:.0f} % test accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=0.95, help="target test accuracy in [0, 1] (default 0.95)")
    ap.add_argument("--quick", action="store_true", help="a few epochs only (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--compile", action="store_true",
                    help="every stage with compile=true (torch.compile; its compile time counts as training time)")
    a = ap.parse_args(argv)
    if not 0.0 < a.target <= 1.0:
        ap.error(f"--target must be in (0, 1], got {a.target}")
    set_threads(a.threads)
    result = ("converge-quick" if a.quick else "converge") + ("-compile" if a.compile else "")
    out = RESULTS / result
    histories = run_all(out, a.quick, a.compile)
    rows = []
    for name, h in histories.items():
        hit = first_reaching(h, a.target)
        best = max((r for r in h if r.get("test_acc") is not None), key=lambda r: r["test_acc"])
        rows.append({"method": name, "target": a.target, "reached": hit is not None,
                     "epoch": hit["epoch"] if hit else None, "train_time_s": hit["train_time_s"] if hit else None,
                     "fp": hit["fp"] if hit else None, "bp": hit["bp"] if hit else None,
                     "max_acc": best["test_acc"], "max_acc_epoch": best["epoch"], "epochs_run": h[-1]["epoch"]})
    print(f"\ntime to {100 * a.target:.0f} % test accuracy on digits (training time, evaluation excluded)\n")
    print("| method | epoch | time (s) | #FP | #BP | max acc (%) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["reached"]:
            print(f"| {r['method']} | {r['epoch']} | {r['train_time_s']:.1f} | {r['fp']} | {r['bp']} | "
                  f"{100 * r['max_acc']:.2f} |")
        else:
            print(f"| {r['method']} | not reached in {r['epochs_run']} | - | - | - | {100 * r['max_acc']:.2f} |")
    path = write_result(result,
                        {"machine": machine_info(), "target": a.target, "rows": rows})
    png = path.with_suffix(".png")
    plot(histories, a.target, png)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
