"""``szo recipe NAME|FILE.yaml [--set key=value ...] [--out DIR] [--device D] [--resume]``: one recipe's
pipeline (``szo.pipeline.run_recipe``) under torchrun's launch (``szo.distributed.launch``).

``szo recipe --list`` never comes here: ``szo.cli`` answers it from the recipe files
(``szo.recipes``), without importing what a run needs.
"""
from __future__ import annotations

import argparse

from szo.config import RecipeConfig, load_recipe
from szo.distributed import launch
from szo.pipeline import run_recipe
from szo.rundir import default_run_dir, resumed_config

__all__ = ["run", "recipe_config"]


def recipe_config(args: argparse.Namespace) -> tuple[RecipeConfig, list[str]]:
    """The resolved config of ``szo recipe``'s arguments and the overrides it was loaded with."""
    # --device is one more override, so it is validated like the rest and lands in config.yaml
    sets = (args.set or []) + ([f"device={args.device}"] if args.device else [])
    return load_recipe(args.name, sets), sets


def run(args: argparse.Namespace) -> int:
    """Run recipe ``args.name`` in ``args.out`` (default ``runs/NAME``); rank 0 prints the summary line."""
    cfg, sets = recipe_config(args)
    out = args.out or default_run_dir(cfg["name"])
    with launch(device=cfg["device"], timeout_s=cfg["distributed"]["timeout_s"]) as info:
        if args.resume:  # the run's own config.yaml (+ --set); stages refuse what changes the run
            cfg = resumed_config(out, cfg, sets)
        s = run_recipe(cfg, out, resume=args.resume, callbacks=args.callbacks)
    if info.rank != 0:
        return 0
    acc = s.get("best_test_acc") if isinstance(s, dict) else None
    if acc is None:
        print(f"{cfg['name']} done in {out}")
        return 0
    print(f"{cfg['name']} [{s.get('label')}] done in {out}: max test acc {100 * acc:.2f}% at epoch "
          f"{s.get('converged_epoch')}, #FP {s.get('fp')}, #BP {s.get('bp')}")
    conv = s.get("conversion")
    if conv and "arithmetics" in conv:  # backend fixed: the pretrained model in both integer arithmetics
        runs = "; ".join(f"{k} {100 * r['test_acc']:.2f}%" for k, r in conv["arithmetics"].items())
        print(f"  pretrained model, test acc: float {100 * conv['float_test_acc']:.2f}%; {runs}")
    return 0
