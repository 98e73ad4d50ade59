"""``szo adapt ...``: test-time adaptation of a trained source run from flags.

The flags stand for a ``kind: tta`` recipe (``szo.config``'s ``tta`` / ``szo`` sections and the top
level); each one is a shortcut for the schema key its help names, whose default it takes when not
given, so a default exists once (the schema). The stage itself is ``szo.adapt.stage.tta_stage``
(what the sections mean: its module doc), run under the run contract (the directory's lock,
config.yaml, a status in tta_results.json).
"""
from __future__ import annotations

import argparse
import typing
from pathlib import Path

from szo.config import RecipeConfig, SZOConfig, TTAConfig, resolve
from szo.schema_flags import add_schema_flags, flag_values
from szo.stages import run_dir_guard

from .methods import METHODS, SETTINGS, SUBSPACE_METHODS
from .runner import TTAOptions, resolve_methods
from .stage import tta_stage

__all__ = ["add_arguments", "main", "flags_config"]

# flag -> (schema section, key, what it is); the type, choices and default come from the schema
_FLAGS = {
    "data": ("tta", "data", "corrupted data set"), "data_dir": ("tta", "data_dir", "its directory"),
    "severity": ("tta", "severity", "corruption severity"), "batch_size": ("tta", "batch_size", "test batch"),
    "lr_reset": ("tta", "lr_reset", "subspace methods' lr, reset setting (null: szo.scale's; trajectory 0.03, absolute 1.0)"),
    "lr_continual": ("tta", "lr_continual",
                     "subspace methods' lr, continual setting (null: szo.scale's; trajectory 0.003, absolute 0.1)"),
    "predict": ("tta", "predict", "predict before or after the batch's adaptation step"),
    "tent_optimizer": ("tta", "tent_optimizer", "Tent's optimizer"), "tent_lr": ("tta", "tent_lr", "Tent's lr"),
    "max_batches": ("tta", "max_batches", "adapt on at most this many batches per corruption"),
    "mu": ("szo", "mu", "SZO perturbation scale (null: szo.scale's; trajectory 0.3, absolute 1.0)"),
    "q": ("szo", "q", "SZO-RGE directions per step"),
    "scale": ("szo", "scale", "units of --mu / --lr-*: absolute | trajectory | whitened (null: the methods' "
                               "default, trajectory for the subspace methods)"),
}
_SECTIONS = {"tta": TTAConfig, "szo": SZOConfig}
# flags whose test-time-adaptation default differs from the schema's training default: q = 10 directions
# (App. G; run_tta's and the *-tta recipes'), not szo.q's 1
_TTA_DEFAULTS = {"q": TTAOptions.q}


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``szo adapt``'s arguments and handler, added to its parser."""
    p.description = ("Adapt a trained source model on the 15 corruptions with none / bn / tent / bp-subspace / "
                     "szo-cge / szo-rge in the reset and/or continual setting; writes the paper's tables. Every "
                     "flag is a key of the kind: tta recipe schema (szo recipe digits-c-tta is the same stage).")
    p.add_argument("--source", required=True,
                   help="source run directory of a szo recipe run (config.yaml + model.safetensors or "
                        "checkpoints/last.pt): the model is rebuilt from its config (tta.source_run)")
    p.add_argument("--subspace", default=None, help="adaptation subspace: store entry name (subspace.name)")
    p.add_argument("--subspace-root", default=None,
                   help="subspace store root (subspace.root; default $SZO_SUBSPACE_ROOT or ./subspaces)")
    p.add_argument("--method", default=None, help=f"all or comma list of: {', '.join(METHODS)} (method; default all)")
    p.add_argument("--setting", default=None, help=f"both or one of: {', '.join(SETTINGS)} (setting; default both)")
    add_schema_flags(p, _FLAGS, _SECTIONS, defaults=_TTA_DEFAULTS)
    d = RecipeConfig()
    p.add_argument("--seed", type=int, default=None, help=f"seed (default {d.seed})")
    p.add_argument("--device", default=None, help=f"cpu | cuda | cuda:N (device; default {d.device})")
    p.add_argument("--precision", default=None, choices=typing.get_args(typing.get_type_hints(RecipeConfig)["precision"]),
                   help=f"arithmetic of adaptation and prediction (precision, szo.precision; default {d.precision})")
    p.add_argument("--out", required=True, help="output directory for the tables")
    p.set_defaults(func=main)


def flags_config(args: argparse.Namespace) -> RecipeConfig:
    """``szo adapt``'s flags as the ``kind: tta`` recipe config they stand for (config.yaml of the run);
    a flag not given leaves its key to the schema (--q: to test-time adaptation's 10, ``_TTA_DEFAULTS``)."""
    raw: dict = {"name": "adapt", "kind": "tta", "progress": True, "tta": {"source_run": args.source},
                 "subspace": {"name": args.subspace, "root": args.subspace_root}, "szo": {}}
    for key in ("method", "setting", "seed", "device", "precision"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    for section, values in flag_values(args, _FLAGS, _TTA_DEFAULTS).items():
        raw[section].update(values)
    return resolve(raw)


def main(args: argparse.Namespace) -> int:
    """``szo adapt`` entry point: the ``kind: tta`` recipe its flags describe, in ``--out`` under
    the run contract (the directory's lock, config.yaml, a status in tta_results.json)."""
    cfg = flags_config(args)
    if any(m in SUBSPACE_METHODS for m in resolve_methods(cfg["method"])) and args.subspace is None:
        raise ValueError(f"methods {' / '.join(SUBSPACE_METHODS)} need --subspace NAME "
                         "(build it with the *-tta recipe or szo.adapt.subspace.build_adaptation_subspace)")
    with run_dir_guard(args.out, cfg, resume=False):
        res = tta_stage(cfg, args.out, device=cfg["device"])
    print((Path(args.out) / "tta_summary.md").read_text())
    return 0 if res else 1
