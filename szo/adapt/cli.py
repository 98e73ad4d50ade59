"""``szo adapt ...`` and the ``kind: tta`` recipe stage.

Recipe (``recipes/*-tta.yaml``): the shared sections (``model``, ``data`` = the clean source
data set, ``loss``, ``bptt``, ``trajectory``, ``subspace.k``, ``szo.mu`` / ``szo.q``, ``seed``,
``device``, ``progress``) mean what they mean for ``kind: bp`` recipes; ``method`` is one of
``szo.adapt.METHODS`` or ``all``; ``setting`` is ``reset`` | ``continual`` | ``both``; the
``tta`` section (``szo.config.TTAConfig``) holds the rest. :func:`run_recipe` runs

1. the source model: ``tta.source_run`` (a ``szo recipe`` run directory: ``config.yaml`` +
   ``model.safetensors`` or ``checkpoints/last.pt``, and a trajectory; read by
   ``szo.pipeline.load_run_model``) or, with ``tta.train_source: true``, the BPTT stage run here
   (``szo.stages.bptt_stage`` into ``OUT/source``, no store subspace);
2. the adaptation subspace (``szo.adapt.subspace``): a store entry ``subspace.name`` if given,
   else a given fine-tuning trajectory (``tta.finetune.trajectory``) + PCA, else the
   ``tta.protocol`` (``szo.adapt.subspace.PROTOCOLS``): labelled BP fine-tuning on the
   corrupted *test* split of ``tta.finetune.corruption`` (``paper``: the labels of the
   evaluated test images leak into the subspace, and every output says so), on its *train*
   split (``train``, the default) or, per evaluated corruption, on the train splits of the 14
   others (``loco``: reset setting only; ``setting: both`` runs reset and says so, ``setting:
   continual`` is refused), each + PCA;
3. ``szo.adapt.runner.run_tta`` -> ``OUT/tta_results.json``, ``tta_table_*.md``,
   ``tta_summary.md``, ``tta_accuracy.png``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from szo.config import RecipeConfig, resolve, write_config
from szo.precision import PRECISIONS
from szo.runs import load_run_model
from szo.stages import bptt_stage, run_dir_guard
from szo.zo.scale import SCALES

from .methods import METHODS, PREDICT, SETTINGS, SUBSPACE_METHODS, TENT_OPTIMIZERS
from .subspace import LABEL_LEAK
from .tables import write_tables

__all__ = ["run_recipe", "register", "main", "train_source", "load_source"]

# --------------------------------------------------------------------------- source model
def train_source(cfg: Mapping[str, Any], run_dir: Path, device: str) -> tuple[torch.nn.Module, Path]:
    """BPTT-train the source model on the clean ``data`` set: ``szo.stages.bptt_stage``
    (the ``kind: bp`` stage: ``data``, ``loss``, ``bptt``, ``trajectory`` and ``seed`` sections,
    model init under ``fork_rng``; writes ``run_dir/model.safetensors``) without building a
    store subspace (``build=False``: the adaptation subspace is built from its trajectory
    here, nothing is written to a subspace store). Returns the model and its trajectory."""
    bptt_stage(cfg, run_dir, device=device, build=False)
    model, _ = load_run_model(run_dir, device)
    return model, Path(run_dir) / "trajectory"


def load_source(run_dir: str | os.PathLike, dataset_name: str, device: str = "cpu") -> torch.nn.Module:
    """The model of a ``szo recipe`` run directory (``szo.pipeline.load_run_model``), checked
    against the corrupted data set's number of classes."""
    from szo.data import dataset_info

    model, _ = load_run_model(run_dir, device)
    n = dataset_info(dataset_name).num_classes
    if model.num_classes != n:
        raise ValueError(f"source run {run_dir} has {model.num_classes} classes, the data set {dataset_name!r} {n}")
    return model


def _adaptation_subspaces(cfg: Mapping[str, Any], source: torch.nn.Module, src_traj: Path, out: Path, device: str,
                          progress: bool, seed: int) -> tuple[Any, dict[str, Any]]:
    """Step 2 of :func:`run_recipe`: the subspace (or ``{corruption: subspace}`` for loco) and the
    protocol's description for the results. Built subspaces are saved in ``out/subspaces``."""
    from subspace_store import SubspaceStore
    from szo.runs import loss_for

    from . import subspace as adapt_subspace

    t, ft = cfg["tta"], cfg["tta"]["finetune"]
    sub_cfg = cfg.get("subspace") or {}
    protocol, k = t["protocol"], int(sub_cfg.get("k", 20))
    declared = adapt_subspace.protocol_info(protocol)
    if sub_cfg.get("name"):
        declared["description"] = (f"subspace store entry {sub_cfg['name']!r}, declared as protocol {protocol!r}; "
                                   "its fine-tuning data are not known here")
        return SubspaceStore(sub_cfg.get("root")).load(sub_cfg["name"], model=source), declared
    store = SubspaceStore(out / "subspaces")
    if ft["trajectory"] is not None:
        declared["description"] = (f"given fine-tuning trajectory {ft['trajectory']}, declared as protocol "
                                   f"{protocol!r}; its fine-tuning data are not known here")
        sub = adapt_subspace.build_adaptation_subspace(source, src_traj, ft["trajectory"], k=k, n_source=t["n_source"],
                                                       progress=progress, provenance={"adapt_protocol": protocol})
        store.save("adapt", sub, overwrite=True)
        return sub, declared
    subs, info = adapt_subspace.protocol_subspaces(source, src_traj, t, run_dir=out, k=k, loss=loss_for(cfg),
                                                   seed=seed, device=device, progress=progress)
    if isinstance(subs, Mapping):
        for c, s in subs.items():
            store.save(f"adapt-loco-{c}", s, overwrite=True)
    else:
        store.save("adapt", subs, overwrite=True)
    return subs, info


# --------------------------------------------------------------------------- recipe stage
def run_recipe(cfg: Mapping[str, Any], out_dir: str | os.PathLike, device: str = "cpu") -> dict[str, Any]:
    """Run a ``kind: tta`` recipe into ``out_dir``; returns the TTA results dict."""
    cfg = cfg if isinstance(cfg, RecipeConfig) else resolve(cfg)
    t, out = cfg["tta"], Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_config(cfg, out / "config.yaml")
    seed = int(cfg.get("seed", 0))
    progress = bool(cfg.get("progress", True))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    # 1. source model + its trajectory
    if t["source_run"] is None:
        if not t["train_source"]:
            raise ValueError("this recipe needs a source model: set tta.source_run=RUN_DIR (a szo recipe BPTT run "
                             "directory: config.yaml, model.safetensors and trajectory/), or tta.train_source=true "
                             "to train it here")
        source, src_traj = train_source(cfg, out / "source", device)
    else:
        source = load_source(t["source_run"], t["data"], device)
        src_traj = Path(t["source_trajectory"] or Path(t["source_run"]) / "trajectory")
    source.eval()
    timings["source_s"] = time.perf_counter() - t0
    # 2. adaptation subspace(s)
    t1 = time.perf_counter()
    from .runner import resolve_methods, resolve_settings, run_tta

    settings = resolve_settings(cfg["setting"])
    notes: list[str] = []
    sub, protocol = None, None
    if any(m in SUBSPACE_METHODS for m in resolve_methods(cfg["method"])):
        sub, protocol = _adaptation_subspaces(cfg, source, src_traj, out, device, progress, seed)
        if protocol["name"] == "loco" and "continual" in settings:
            settings = ["reset"]
            notes.append("protocol loco: the reset setting only (one subspace per corruption; the continual "
                         "setting sees every corruption, so leave-one-corruption-out is undefined there)")
        for line in notes + ([f"protocol paper: {LABEL_LEAK}"] if protocol.get("label_leak") else []):
            print(f"[tta] NOTE {line}", file=sys.stderr)
    timings["subspace_s"] = time.perf_counter() - t1
    # 3. TTA
    t2 = time.perf_counter()
    szo_cfg = cfg.get("szo") or {}
    res = run_tta(
        source, sub, t["data"], cfg["method"], settings, severity=t["severity"], batch_size=t["batch_size"],
        lr_reset=t["lr_reset"], lr_continual=t["lr_continual"], data_dir=t["data_dir"], seed=seed, out_dir=out,
        corruptions=t["corruptions"], mu=float(szo_cfg["mu"]), momentum=t["momentum"],
        q=int(szo_cfg.get("q", 10)), scale=szo_cfg["scale"], predict=t["predict"], tent_optimizer=t["tent_optimizer"],
        tent_lr=t["tent_lr"],
        tent_momentum=t["tent_momentum"], device=device, max_batches=t["max_batches"],
        dataset_kwargs=t["kwargs"], download=t["download"], progress=progress, write=False, precision=cfg["precision"],
        info={"recipe": cfg.get("name"), "source_trajectory": str(src_traj)})
    timings["tta_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - t0
    res["timings"] = timings
    if protocol is not None:
        res["protocol"] = protocol
    if notes:
        res["notes"] = notes
    res["status"] = "completed"
    write_tables(res, out)  # tta_results.json (with the timings), tables, tta_accuracy.png
    return res


# --------------------------------------------------------------------------- CLI
def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``szo adapt`` to the ``szo`` CLI."""
    p = subparsers.add_parser(
        "adapt", help="test-time adaptation on a corrupted test set (paper Sec. 6.3)",
        description="Adapt a trained source model on the 15 corruptions with none / bn / tent / bp-subspace / "
                    "szo-cge / szo-rge in the reset and/or continual setting; writes the paper's tables.")
    p.add_argument("--source", required=True,
                   help="source run directory of a szo recipe run (config.yaml + model.safetensors or "
                        "checkpoints/last.pt): the model is rebuilt from its config")
    p.add_argument("--subspace", default=None, help="adaptation subspace: store entry name")
    p.add_argument("--subspace-root", default=None, help="subspace store root (default $SZO_SUBSPACE_ROOT or ./subspaces)")
    p.add_argument("--data", default="digits-c", help="corrupted data set (digits-c, cifar10-c, cifar100-c, imagenet-c)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--method", default="all", help=f"all or comma list of: {', '.join(METHODS)}")
    p.add_argument("--setting", default="both", help=f"both or one of: {', '.join(SETTINGS)}")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--scale", default=None, choices=SCALES,
                   help="units of --mu / --lr-* (szo.scale; default trajectory for the subspace methods)")
    p.add_argument("--lr-reset", type=float, default=None, help="default: the scale's (absolute: 1.0, App. G)")
    p.add_argument("--lr-continual", type=float, default=None, help="default: the scale's (absolute: 0.1, App. G)")
    p.add_argument("--mu", type=float, default=None, help="default: the scale's (absolute: 1.0, App. G)")
    p.add_argument("--q", type=int, default=10)
    p.add_argument("--predict", default="before", choices=PREDICT)
    p.add_argument("--tent-optimizer", default="adam", choices=TENT_OPTIMIZERS)
    p.add_argument("--tent-lr", type=float, default=1e-3)
    p.add_argument("--max-batches", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="arithmetic of adaptation and prediction (szo.precision; default auto)")
    p.add_argument("--out", required=True, help="output directory for the tables")
    p.set_defaults(func=main)
    return p


def flags_config(args: argparse.Namespace) -> RecipeConfig:
    """``szo adapt``'s flags as the ``kind: tta`` recipe config they stand for (config.yaml of the run)."""
    return resolve({
        "name": "adapt", "kind": "tta", "method": args.method, "setting": args.setting, "seed": args.seed,
        "device": args.device, "precision": args.precision, "progress": True, "subspace": {"name": args.subspace, "root": args.subspace_root},
        "szo": {"mu": args.mu, "q": args.q, "scale": args.scale},
        "tta": {"data": args.data, "data_dir": args.data_dir, "severity": args.severity, "batch_size": args.batch_size,
                "lr_reset": args.lr_reset, "lr_continual": args.lr_continual, "predict": args.predict,
                "tent_optimizer": args.tent_optimizer, "tent_lr": args.tent_lr, "max_batches": args.max_batches,
                "source_run": args.source}})


def main(args: argparse.Namespace) -> int:
    """``szo adapt`` entry point: the ``kind: tta`` recipe its flags describe, in ``--out`` under
    the run contract (the directory's lock, config.yaml, a status in tta_results.json)."""
    from .runner import resolve_methods

    cfg = flags_config(args)
    if any(m in SUBSPACE_METHODS for m in resolve_methods(args.method)) and args.subspace is None:
        raise ValueError(f"methods {' / '.join(SUBSPACE_METHODS)} need --subspace NAME "
                         "(build it with the *-tta recipe or szo.adapt.subspace.build_adaptation_subspace)")
    with run_dir_guard(args.out, cfg, resume=False):
        res = run_recipe(cfg, args.out, device=args.device)
    print((Path(args.out) / "tta_summary.md").read_text())
    return 0 if res else 1
