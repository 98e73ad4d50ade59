"""The ``kind: tta`` stage: a source model, its adaptation subspace(s), test-time adaptation.

Recipe (``recipes/*-tta.yaml``): the shared sections (``model``, ``data`` = the clean source
data set, ``loss``, ``bptt``, ``trajectory``, ``subspace.k``, ``szo.mu`` / ``szo.q``, ``seed``,
``device``, ``progress``) mean what they mean for ``kind: bp`` recipes; ``method`` is one of
``szo.adapt.METHODS`` or ``all``; ``setting`` is ``reset`` | ``continual`` | ``both``; the
``tta`` section (``szo.config.TTAConfig``) holds the rest. :func:`tta_stage` runs

1. the source model: ``tta.source_run`` (a ``szo recipe`` run directory: ``config.yaml`` +
   ``model.safetensors`` or ``checkpoints/last.pt``, and a trajectory; read by
   ``szo.build.load_run_model``) or, with ``tta.train_source: true``, the BPTT stage run here
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

import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from subspace_store import SubspaceStore
from szo.build import load_run_model, loss_for
from szo.config import AdaptationConfig, RecipeConfig, resolve, write_config
from szo.data import dataset_info
from szo.stages import bptt_stage

from . import subspace as adapt_subspace
from .methods import SUBSPACE_METHODS
from .runner import resolve_methods, resolve_settings, run_tta
from .subspace import LABEL_LEAK
from .tables import write_tables

__all__ = ["tta_stage", "train_source", "load_source"]


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
    """The model of a ``szo recipe`` run directory (``szo.build.load_run_model``), checked
    against the corrupted data set's number of classes."""
    model, _ = load_run_model(run_dir, device)
    n = dataset_info(dataset_name).num_classes
    if model.num_classes != n:
        raise ValueError(f"source run {run_dir} has {model.num_classes} classes, the data set {dataset_name!r} {n}")
    return model


def _adaptation_subspaces(cfg: Mapping[str, Any], source: torch.nn.Module, src_traj: Path, out: Path, device: str,
                          progress: bool, seed: int) -> tuple[Any, dict[str, Any]]:
    """Step 2 of :func:`tta_stage`: the subspace (or ``{corruption: subspace}`` for loco) and the
    protocol's description for the results. Built subspaces are saved in ``out/subspaces``."""
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
def tta_stage(cfg: Mapping[str, Any], out_dir: str | os.PathLike, device: str = "cpu") -> dict[str, Any]:
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
    sz = cfg.szo
    res = run_tta(
        source, sub, t.data, cfg.method, settings, **t.select(AdaptationConfig), seed=seed, out_dir=out,
        mu=float(sz.mu), q=int(sz.q), scale=sz.scale, device=device, dataset_kwargs=t.kwargs, progress=progress,
        write=False, precision=cfg.precision, info={"recipe": cfg.name, "source_trajectory": str(src_traj)})
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
