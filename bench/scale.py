"""The scale table of docs/evidence.md ("Scale-free mu and lr", issue 34): for one data set, each
subspace method's accuracy in scratch, continual and test-time adaptation under

  (a) ``paper``:    the paper's absolute values (App. G: mu 1, lr 1; TTA lr 1 reset / 0.1 continual);
  (b) ``tuned``:    the best hand-tuned absolute values the recipes and docs/evidence.md had before
                    ``szo.scale`` existed (:data:`TUNED`; where none existed, the paper's);
  (c) ``relative``: ``szo.scale: trajectory`` with the methods' own defaults (nothing else set: what a
                    user who sets nothing gets).

One command per data set; every cell is a ``szo recipe`` run in its own directory under ``--root``,
skipped when it has finished (rerunning continues, a changed cell is refused by the run contract):

    python bench/scale.py digits                    # ~25 min per seed on one loaded core (2026-11-27)
    python bench/scale.py mnist5k --settings scratch,continual --methods szo-cge,szo-rge   # ~35 min per seed
    python bench/scale.py fmnist --seeds 0 --settings continual,scratch --methods szo-cge
                                                    # BPTT 24 min, then ~10 min per cell (needs Fashion-MNIST)
    python bench/scale.py mnist5k --settings tta --variants tuned,relative   # only (b) and (c)
    python bench/scale.py digits --table            # only print / write the table of what has run

Seed ``s`` is a whole chain: its own BPTT run (``{bp}-s{s}``: model, trajectory, the k = 20 scratch
subspace and the last-epochs continual subspace of the recipes), then the cells with ``seed=s``.
The TTA cells use the seed's BPTT run as their source (digits-c: the recipe trains its own).
Writes ``ROOT/DATA/scale.json`` and ``scale.md``; the step budgets each data set runs with are in
:data:`DATASETS` and printed under the table (fmnist / mnist5k: fewer steps than their recipes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from common import RESULTS, machine_info  # noqa: F401  (sys.path: this checkout's szo)

from szo.build import subspace_store_for
from szo.config import load_recipe
from szo.io import atomic_write_json, atomic_write_text
from szo.methods import method_label
from szo.pipeline import DIGITS_RGE_UNITS, PAPER_UNITS
from szo.stages import subspace_build_stage


@dataclass(frozen=True)
class DataSet:
    """The recipes of one data set and the budget its cells run with (``--set`` items)."""

    bp: str
    scratch: str
    continual: str
    tta: str
    scratch_methods: tuple[str, ...]
    budget: dict[str, tuple[str, ...]] = field(default_factory=dict)  # setting -> extra --set items
    tta_own_source: bool = False  # the TTA recipe trains its own source model (digits-c-tta)
    note: str = ""


TTA_METHODS = ("none", "bn", "bp-subspace", "szo-cge", "szo-rge")
CONTINUAL_METHODS = ("szo-cge", "bp-subspace")

DATASETS: dict[str, DataSet] = {
    "digits": DataSet("digits-bp", "digits-scratch", "digits-continual", "digits-c-tta",
                      ("szo-cge", "szo-rge", "bp-subspace", "szo-1pt", "szo-cge-1pt"), budget={"rge": ("train.epochs=60",)},
                      tta_own_source=True,
                      note="recipe budgets: scratch 20 epochs (SZO-RGE / SZO-1pt: 60, q = 1), continual 2 epochs"),
    "mnist5k": DataSet("mnist5k-bp", "mnist5k-scratch", "mnist5k-continual", "mnist5k-c-tta",
                       ("szo-cge", "szo-rge", "bp-subspace", "szo-1pt", "szo-cge-1pt"),
                       budget={"scratch": ("train.epochs=2",), "continual": ("train.epochs=1",),
                               "rge": ("szo.q=10",)},
                       note="scratch 2 epochs (recipe: 4), continual 1 epoch (recipe: 2), SZO-RGE / SZO-1pt q = 10"),
    "fmnist": DataSet("fmnist-cpu-bp", "fmnist-scratch", "fmnist-continual", "fmnist-c-tta",
                      ("szo-cge", "szo-rge", "bp-subspace", "szo-1pt", "szo-cge-1pt"),
                      budget={"scratch": ("train.max_steps_per_epoch=100",),
                              "continual": ("train.max_steps_per_epoch=50",), "rge": ("szo.q=10",)},
                      note="scratch 100 steps (recipe: one epoch, 469), continual 50 steps (recipe: 469), "
                           "SZO-RGE / SZO-1pt q = 10"),
}

PAPER = {"train": PAPER_UNITS,
         "tta": ("szo.scale=absolute", "szo.mu=1.0", "tta.lr_reset=1.0", "tta.lr_continual=0.1")}

#: (b): the hand-tuned absolute values of the recipes and docs/evidence.md before szo.scale; a cell not
#: listed had none (the paper's values were the recipe's)
TUNED: dict[tuple[str, str, str], tuple[str, ...]] = {
    # digits-scratch method_defaults: SZO-RGE / SZO-1pt mu 0.3, lr 0.02 (60 epochs: their budget, kept)
    ("digits", "scratch", "szo-rge"): DIGITS_RGE_UNITS,
    ("digits", "scratch", "szo-1pt"): DIGITS_RGE_UNITS,
    # digits-c-tta: mu 0.1, lr 0.1 (reset) / 0.002 (continual), the recipe's own values
    ("digits", "tta", "*"): ("szo.mu=0.1", "tta.lr_reset=0.1", "tta.lr_continual=0.002"),
    # mnist5k-scratch method_defaults (q = 10, docs/evidence.md Table 1)
    ("mnist5k", "scratch", "szo-rge"): ("szo.mu=0.3", "train.lr=0.3"),
    # docs/evidence.md: continual lr 0.1 (96.30 vs 92.70 at lr 1)
    ("mnist5k", "continual", "*"): ("train.lr=0.1",),
    # docs/evidence.md, the lr sensitivity check on mnist5k-c: lr 0.1 reset / 0.01 continual
    ("mnist5k", "tta", "*"): ("tta.lr_reset=0.1", "tta.lr_continual=0.01"),
    # fmnist-scratch method_defaults (q = 10)
    ("fmnist", "scratch", "szo-rge"): ("szo.mu=0.3", "train.lr=0.3"),
    # docs/evidence.md: the only continual setting that kept the model (87.98 %)
    ("fmnist", "continual", "*"): ("szo.mu=0.1", "train.lr=0.01"),
    # no fmnist-c recipe existed: mnist5k-c's lr 0.1 / 0.01 with the shift study's mu 0.1 (szo study shift)
    ("fmnist", "tta", "*"): ("szo.mu=0.1", "tta.lr_reset=0.1", "tta.lr_continual=0.01"),
}

def relative(setting: str) -> tuple[str, ...]:
    """The (c) overrides: szo.scale trajectory and the recipe's pinned absolute mu / lr unset, so the
    library's own defaults apply (the method's relative mu / lr, ``MethodSpec.relative``; TTA continual a
    tenth of reset, ``TTAOptions.lr_of``): what a user who sets nothing but the scale gets."""
    lrs = ("tta.lr_reset=null", "tta.lr_continual=null") if setting == "tta" else ("train.lr=null",)
    return ("szo.scale=trajectory", "szo.mu=null", *lrs)


VARIANTS = ("paper", "tuned", "relative")
SETTINGS = ("scratch", "continual", "tta")


def tuned(data: str, setting: str, method: str) -> tuple[str, ...] | None:
    """The (b) overrides of a cell, None where the recipe had no hand-tuned value (then (b) = (a))."""
    return TUNED.get((data, setting, method), TUNED.get((data, setting, "*")))


def overrides(data: str, setting: str, method: str, variant: str) -> tuple[str, ...]:
    """The ``--set`` items of one cell's variant (absolute variants pin ``szo.scale=absolute``)."""
    if variant == "paper":
        return PAPER["tta" if setting == "tta" else "train"]
    if variant == "tuned":
        base = PAPER["tta" if setting == "tta" else "train"]
        return base + (tuned(data, setting, method) or ())
    return relative(setting)


# ----------------------------------------------------------------------------- the chain of one seed
class Chain:
    def __init__(self, data: str, seed: int, root: Path, python: str):
        self.data, self.seed, self.ds = data, seed, DATASETS[data]
        self.root, self.py = root, python
        self.store = root / "store"
        self.bp_dir = root / f"{data}-bp-s{seed}"
        self.scratch_name, self.continual_name = f"{data}-k20-s{seed}", f"{data}-cont-s{seed}"

    def common(self, recipe: str) -> list[str]:
        return [f"subspace.root={self.store}", "progress=false", f"seed={self.seed}"]

    def szo(self, recipe: str, out: Path, sets: list[str]) -> None:
        if (out / "results.json").is_file() and json.loads((out / "results.json").read_text()).get("status") in (
                "completed", "diverged"):  # a diverged run is a result of its cell (the paper's values on digits)
            return
        if (out / "tta_results.json").is_file():
            return
        resume = ["--resume"] if (out / "checkpoints" / "last.pt").is_file() else []
        cmd = [self.py, "-m", "szo", "recipe", recipe, "--out", str(out), *resume]
        for s in self.common(recipe) + sets:
            cmd += ["--set", s]
        print("==", " ".join(cmd[3:]), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc not in (0, 4):  # 4: training diverged, recorded in its results.json
            raise SystemExit(f"scale: {' '.join(cmd[3:])} failed with status {rc}")

    def prepare(self) -> None:
        """The seed's BPTT run, its scratch subspace and its continual (last-epochs) subspace."""
        self.szo(self.ds.bp, self.bp_dir, [f"subspace.name={self.scratch_name}"])
        cfg = load_recipe(self.ds.continual, [f"subspace.root={self.store}", f"subspace.name={self.continual_name}",
                                              "progress=false", f"seed={self.seed}"])
        if not subspace_store_for(cfg).exists(self.continual_name):
            subspace_build_stage(cfg, self.bp_dir, progress=False)

    def cell_dir(self, setting: str, method: str, variant: str) -> Path:
        return self.root / self.data / setting / f"{method}-{variant}-s{self.seed}"

    def train(self, setting: str, method: str, variant: str) -> None:
        recipe = self.ds.scratch if setting == "scratch" else self.ds.continual
        name = self.scratch_name if setting == "scratch" else self.continual_name
        sets = [f"method={method}", f"subspace.name={name}", *self.ds.budget.get(setting, ())]
        if method in ("szo-rge", "szo-1pt"):
            sets += list(self.ds.budget.get("rge", ()))
        self.szo(recipe, self.cell_dir(setting, method, variant), sets + list(overrides(self.data, setting, method,
                                                                                        variant)))

    def tta(self, variant: str) -> None:
        sets = [f"method={','.join(TTA_METHODS)}", "setting=both"]
        if not self.ds.tta_own_source:
            sets.append(f"tta.source_run={self.bp_dir}")
        self.szo(self.ds.tta, self.cell_dir("tta", "all", variant), sets + list(overrides(self.data, "tta", "*",
                                                                                              variant)))


def distinct_variants(data: str, setting: str, method: str) -> list[str]:
    """The variants to run: (b) equals (a) where nothing was hand-tuned (run once, shown twice)."""
    return [v for v in VARIANTS if not (v == "tuned" and tuned(data, setting, method) is None)]


def run(data: str, seeds: list[int], root: Path, settings: list[str], python: str,
        methods: list[str] | None = None, variants: list[str] | None = None) -> None:
    ds = DATASETS[data]

    def chosen(setting: str, method: str) -> list[str]:
        return [v for v in distinct_variants(data, setting, method) if not variants or v in variants]

    for seed in seeds:
        ch = Chain(data, seed, root, python)
        ch.prepare()
        for setting in settings:
            if setting == "tta":
                for v in chosen("tta", "*"):
                    ch.tta(v)
                continue
            for method in (ds.scratch_methods if setting == "scratch" else CONTINUAL_METHODS):
                if methods and method not in methods:
                    continue
                for v in chosen(setting, method):
                    ch.train(setting, method, v)


# ----------------------------------------------------------------------------- the table
def _acc(chain: Chain, setting: str, method: str, variant: str) -> dict | None:
    v = variant if variant in distinct_variants(chain.data, setting, method if setting != "tta" else "*") else "paper"
    if setting == "tta":
        p = chain.cell_dir("tta", "all", v) / "tta_results.json"
        if not p.is_file():
            return None
        res = json.loads(p.read_text())["results"]
        return {s: 100 * res[s][method]["average"] for s in ("reset", "continual") if method in res.get(s, {})}
    p = chain.cell_dir(setting, method, v) / "results.json"
    if not p.is_file():
        return None
    r = json.loads(p.read_text())
    if r.get("status") != "completed":
        return {"": float("nan")}
    return {"": 100 * r["best_test_acc"]}


def table(data: str, seeds: list[int], root: Path) -> dict:
    ds = DATASETS[data]
    rows = []
    for setting in SETTINGS:
        methods = (ds.scratch_methods if setting == "scratch" else CONTINUAL_METHODS if setting == "continual"
                   else TTA_METHODS[2:])
        for method in methods:
            subs = ("reset", "continual") if setting == "tta" else ("",)
            for sub in subs:
                row = {"setting": setting + (f" ({sub})" if sub else ""), "method": method}
                for v in VARIANTS:
                    vals = []
                    for s in seeds:
                        a = _acc(Chain(data, s, root, sys.executable), setting, method, v)
                        vals.append(None if a is None else a.get(sub))
                    row[v] = vals
                rows.append(row)
    ref = []
    for s in seeds:  # no adaptation / BN adaptation, for the TTA rows: the same in every variant that ran
        ch = Chain(data, s, root, sys.executable)
        a = {m: next((x for v in VARIANTS if (x := _acc(ch, "tta", m, v))), None) for m in ("none", "bn")}
        ref.append(a)
    return {"data": data, "seeds": seeds, "rows": rows, "tta_reference": ref, "note": ds.note}


def _fmt(vals: list) -> str:
    done = [v for v in vals if v is not None]
    if not done:
        return "-"
    cell = " / ".join("diverged" if v != v else f"{v:.2f}" for v in done)  # nan: the run diverged
    m = mean(done)
    return (f"{'diverged' if m != m else f'{m:.2f}'} ({cell})") if len(done) > 1 else cell


def render(t: dict) -> str:
    lines = [f"### {t['data']}: accuracy (%), mean (seed {' / '.join(map(str, t['seeds']))})", "",
             "| setting | method | (a) paper, absolute | (b) hand-tuned, absolute | (c) trajectory, defaults | (c) - (b) |",
             "|---|---|---|---|---|---|"]
    for r in t["rows"]:
        if all(v is None for variant in VARIANTS for v in r[variant]):
            continue  # a cell this data set's run left out (--settings / --methods)
        b = [v for v in r["tuned"] if v is not None]
        c = [v for v in r["relative"] if v is not None]
        diff = f"{mean(c) - mean(b):+.2f}" if b and c and len(b) == len(c) else "-"
        label = method_label(r["method"])
        lines.append(f"| {r['setting']} | {label} | {_fmt(r['paper'])} | {_fmt(r['tuned'])} | {_fmt(r['relative'])} "
                     f"| {diff} |")
    refs = t.get("tta_reference") or []
    if any(r.get(m) for r in refs for m in ("none", "bn")):  # the TTA rows' yardsticks (the same in each setting)
        cell = lambda m: " / ".join("-" if not r.get(m) else f"{r[m]['reset']:.2f}" for r in refs)  # noqa: E731
        lines += ["", f"TTA without adaptation: {cell('none')}; BN adaptation: {cell('bn')} (seed "
                      f"{' / '.join(map(str, t['seeds']))})."]
    lines += ["", f"Budgets: {t['note']}. Max test accuracy (scratch, continual); TTA: mean over the 15 corruptions "
                  "(severity 5) of the accuracy before each batch's step."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", choices=sorted(DATASETS))
    p.add_argument("--seeds", default="0,1", help="comma list (default 0,1)")
    p.add_argument("--root", default="runs/scale", help="run root (default runs/scale)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of scratch, continual, tta")
    p.add_argument("--methods", default=None,
                   help="comma list: run only these methods' scratch / continual cells (default: all of the data set's)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}: run only these (default: all; the table shows what has run)")
    p.add_argument("--table", action="store_true", help="only write / print the table of the cells that have run")
    a = p.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {a.seeds!r}")
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not seeds:
        p.error(f"--settings: unknown {bad}; valid: {', '.join(SETTINGS)}" if bad else "--seeds: none given")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()] if a.methods else None
    known = set(DATASETS[a.data].scratch_methods) | set(CONTINUAL_METHODS)
    if methods is not None and (not methods or set(methods) - known):
        p.error(f"--methods: got {a.methods!r}; valid for {a.data}: a comma list of {', '.join(sorted(known))}")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: got {a.variants!r}; valid: a comma list of {', '.join(VARIANTS)}")
    root = Path(a.root).resolve()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not a.table:
        run(a.data, seeds, root, settings, sys.executable, methods, variants)
    t = table(a.data, seeds, root)
    md = render(t)
    out = root / a.data
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "scale.json", t)
    atomic_write_text(out / "scale.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
