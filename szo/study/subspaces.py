"""``szo study subspaces BP_RUN``: where does the subspace's power come from?

From a BPTT run directory (``kind: bp`` recipe: ``trajectory/`` and ``model.safetensors``)
this builds k-dimensional subspaces through the run's initial weights theta_0, all with the
same k:

* ``whole``: centered PCA of the whole trajectory (the paper),
* ``first{E}``: of the initial weights and the samples of the first E epochs of BPTT only (DLDR-style;
  :func:`first_epochs_window`),
* ``seed-{name}``: of another run's trajectory (same model, other seed), through this theta_0,
* ``random{s}``: a seeded random orthonormal basis carrying ``whole``'s total variance evenly, so that
  ``szo.scale: trajectory`` measures it in the same unit sigma (SubZero-style),
* ``bn-head``: the coordinates of every BN affine parameter and the classifier (k = their count),

saves each in the store as ``{prefix}-{variant}`` and reports, for each, the projected point
``theta_0 + P P^T (theta_BP - theta_0)``: its distance to theta_BP (absolute and relative to
``|theta_BP - theta_0|``) and its test accuracy (BN running statistics of the BP model).
With ``--train RECIPE`` it then trains from scratch in every variant (``szo recipe RECIPE
--set subspace.name=...``, one run directory per variant under ``--out``); the ``bn-head``
variant with BP-Subspace (:data:`BN_HEAD_METHOD`: a ZO step over its thousands of coordinates
would cost ~100x SZO's); with ``--refresh T0`` also ``random{s}-refresh{T0}``: the random
variant's basis redrawn every T0 steps (``szo.refresh``, SubZero / LOZO style; it has no fixed
subspace, so no projection row).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from subspace_store import bn_and_head_names, build_subspace, coordinate_subspace, project_point, random_subspace
from szo.build import load_run_model, loaders_for, loss_for, subspace_store_for
from szo.config import load_recipe
from szo.io import atomic_write_json
from szo.pipeline import run_recipe
from szo.rundir import run_lock
from szo.train.trainer import evaluate

__all__ = ["subspace_variants", "projection_rows", "study_subspaces", "first_epochs_window"]


def first_epochs_window(every: str | int, epochs: int) -> tuple[int, int]:
    """The trajectory window (``build_subspace(window=...)``) of the initial weights and the samples
    recorded in the first ``epochs`` epochs of BPTT: a sample recorded at an epoch's end carries that
    epoch's number (``every: epoch``), one recorded every n steps the number of epochs completed before
    its step (``szo.trajectory``: epoch 0 holds the first epoch's steps), so the window is ``(0, E)``
    or ``(0, E - 1)``."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"first epochs must be ints >= 1 (epochs of BPTT), got {epochs!r}")
    return (0, epochs) if every == "epoch" else (0, epochs - 1)


def _recorded_every(bp_run: str | os.PathLike) -> str | int:
    """``trajectory.every`` of the BPTT run (its resolved config.yaml)."""
    return load_recipe(Path(bp_run) / "config.yaml")["trajectory"]["every"]


def subspace_variants(bp_run: str | os.PathLike, k: int, *, first_epochs: Sequence[int] = (),
                      other_runs: Sequence[str | os.PathLike] = (), random_seeds: Sequence[int] = (0,),
                      bn_head: bool = True, progress: bool = False, model=None) -> dict[str, Any]:
    """``{variant: Subspace}`` for the BPTT run ``bp_run`` (see the module doc); ``model``: the
    run's model if the caller has it loaded already (``load_run_model``)."""
    traj = Path(bp_run) / "trajectory"
    if not traj.is_dir():
        raise ValueError(f"{bp_run} has no trajectory/ directory: pass the run directory of a kind: bp recipe")
    whole = build_subspace(traj, k, reference="first", progress=progress)
    theta0 = whole.reference
    meta = dict(layout=whole.layout, fingerprint=whole.fingerprint, model=whole.model)
    out: dict[str, Any] = {"whole": whole}
    every = _recorded_every(bp_run) if first_epochs else "epoch"
    for e in first_epochs:
        out[f"first{e}"] = build_subspace(traj, k, window=first_epochs_window(every, e), reference=theta0,
                                          progress=progress)
    for other in other_runs:
        out[f"seed-{Path(other).name}"] = build_subspace(Path(other) / "trajectory", k, reference=theta0,
                                                          progress=progress)
    for s in random_seeds:
        out[f"random{s}"] = random_subspace(theta0, k, int(s), variance=float(whole.eigenvalues.sum()), **meta)
    if bn_head:
        if model is None:
            model, _ = load_run_model(bp_run)
        out["bn-head"] = coordinate_subspace(whole.layout, bn_and_head_names(model), theta0,
                                             fingerprint=whole.fingerprint, model=whole.model)
    for sub in out.values():
        sub.provenance["source_run"] = str(Path(bp_run).resolve())
    return out


def projection_rows(bp_run: str | os.PathLike, variants: dict[str, Any], loaded=None) -> list[dict[str, Any]]:
    """For every variant: k, distance of the projected BP solution to theta_BP and its test accuracy;
    ``loaded``: ``load_run_model(bp_run)`` if the caller has it already."""
    model, cfg = loaded if loaded is not None else load_run_model(bp_run)
    theta_bp = model.flat_params().detach().clone()
    _, test = loaders_for(cfg, torch.Generator().manual_seed(0))
    loss_fn = loss_for(cfg)
    _, acc_bp = evaluate(model, test, loss_fn)
    rows = []
    for name, sub in variants.items():
        span = float(torch.linalg.vector_norm(theta_bp.double() - sub.reference.double()))
        point, dist = project_point(sub, theta_bp)
        model.load_flat_params(point)
        loss, acc = evaluate(model, test, loss_fn)
        rows.append({"variant": name, "k": sub.k, "distance": dist, "relative_distance": dist / span if span else 0.0,
                     "bp_distance_from_theta0": span, "projected_test_acc": acc, "projected_test_loss": loss,
                     "bp_test_acc": acc_bp})
    model.load_flat_params(theta_bp)
    return rows


def study_subspaces(bp_run: str | os.PathLike, k: int, *, prefix: str, first_epochs: Sequence[int] = (),
                    other_runs: Sequence[str | os.PathLike] = (), random_seeds: Sequence[int] = (0,),
                    bn_head: bool = True, overwrite: bool = False, train: str | None = None,
                    train_overrides: Sequence[str] = (), out: str | os.PathLike | None = None,
                    refresh: int | None = None) -> dict[str, Any]:
    """Build, store and measure the variants; optionally train ``train`` (a scratch recipe) in each, and
    (``refresh``) in every random variant redrawn every ``refresh`` steps. Writes ``subspaces.json`` to
    ``out`` (default ``BP_RUN/study-subspaces``)."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty store name prefix, got {prefix!r}")
    if refresh is not None and (isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1):
        raise ValueError(f"refresh must be a number of steps >= 1, got {refresh!r}")
    if refresh is not None and (not train or not random_seeds):
        raise ValueError("--refresh trains the random variants with their basis redrawn: it needs --train RECIPE "
                         "and at least one --random-seeds seed")
    model, cfg = load_run_model(bp_run)  # once, for every step below
    variants = subspace_variants(bp_run, k, first_epochs=first_epochs, other_runs=other_runs,
                                 random_seeds=random_seeds, bn_head=bn_head, model=model)
    store = subspace_store_for(cfg)
    names = {v: f"{prefix}-{v}" for v in variants}
    for v, sub in variants.items():
        store.save(names[v], sub, overwrite=overwrite)
    rows = projection_rows(bp_run, variants, loaded=(model, cfg))
    for r in rows:
        r["store_name"] = names[r["variant"]]
    out = Path(out or Path(bp_run) / "study-subspaces")
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):  # the study's directory; every training run in it holds its own
        result: dict[str, Any] = {"bp_run": str(Path(bp_run).resolve()), "k": k, "store": str(store.root),
                                  "projection": rows, "training": []}
        _train_variants(train, train_overrides, names, {v: sub.k for v, sub in variants.items()}, store, out, result,
                        refresh)
        atomic_write_json(out / "subspaces.json", result)
    return result


BN_HEAD_METHOD = "bp-subspace"
"""How ``--train`` trains the ``bn-head`` variant: its k is every BN affine parameter and the
classifier (thousands), so a CGE step there would cost ~100x SZO-CGE's 2k forwards at k = 20."""
TRAIN_SCALE = "szo.scale=absolute"
"""The units every ``--train`` variant trains in (before the study's ``--set`` items, which win): the
paper's, the one scale that means the same in every variant: a random or coordinate subspace has no
trajectory spread (zero eigenvalues) for ``szo.scale: trajectory`` to measure lengths in."""


def _train_variants(train: str | None, train_overrides: Sequence[str], names: dict[str, str], ks: dict[str, int],
                    store: Any, out: Path, result: dict[str, Any], refresh: int | None = None) -> None:
    if train:
        runs = [(v, name, []) for v, name in names.items()]
        if refresh is not None:  # the random variants again, their basis redrawn every `refresh` steps
            runs += [(f"{v}-refresh{refresh}", name, [f"szo.refresh={refresh}"]) for v, name in names.items()
                     if v.startswith("random")]
        for v, name, extra in runs:
            own = [f"subspace.name={name}", f"subspace.root={store.root}", f"subspace.k={ks[v.split('-refresh')[0]]}",
                   *extra]
            if v == "bn-head":
                own.append(f"method={BN_HEAD_METHOD}")
            tcfg = load_recipe(train, [TRAIN_SCALE, *train_overrides, *own])
            s = run_recipe(tcfg, out / v)
            result["training"].append({"variant": v, "run_dir": str(out / v), "method": tcfg["method"],
                                       "best_test_acc": s.get("best_test_acc"),
                                       "converged_epoch": s.get("converged_epoch")})
