"""Run a recipe end to end: BPTT (+ trajectory) -> subspace -> training in the subspace.

``run_recipe(cfg, out_dir)``:

* ``kind: bp`` recipes run the BPTT stage in ``out_dir`` (trajectory in ``out_dir/trajectory``,
  final model ``out_dir/model.safetensors`` with BN buffers), build the subspace
  (``subspace.k / window / reference``) and save it in the store
  (``subspace.root`` or ``$SZO_SUBSPACE_ROOT`` or ``./subspaces``); its provenance records
  ``source_model`` (the model file) and ``source_run``.
* ``kind: subspace`` recipes first run that BPTT stage in ``out_dir/bptt`` if the store has
  no ``subspace.name`` yet (the BPTT stage of the recipe named by ``source`` when it is set: an
  adaptation recipe's clean pretraining), then train in the subspace in ``out_dir`` with ``method``:
  scratch runs start at the subspace reference (first trajectory sample) with fresh BN
  statistics; continual runs load the pretrained model (``provenance["source_model"]``,
  parameters and BN buffers) and set the parameters to the reference (last sample).

The stages themselves are public functions of ``szo.stages`` (``bptt_stage``,
``subspace_build_stage``, ``subspace_stage``, ``evaluate_stage``; what a subspace run trains is
prepared by ``szo.prepare``); this module composes them per
recipe kind (``kind: tta`` runs ``szo.adapt.stage.tta_stage``) and holds the digits quickstart.

Every run dir holds config.yaml (resolved), metrics.jsonl, checkpoints/, results.json and
training_curve.png. A run holds its directory's lock (``szo.rundir.run_lock``, rank 0 only);
a resumed stage first checks the config against the directory's config.yaml
(``szo.rundir.check_resume_config``). Both are decided on rank 0 and reported on every rank.
See docs/runs.md.

Multi-process (``torchrun --nproc_per_node=N -m szo recipe NAME``; the CLI initialises the
process group): only ``kind: subspace`` recipes with a forward-only method (``szo-cge``,
``szo-rge``, ``szo-1pt``) run, data- or perturbation-parallel (``distributed.mode``), and the
subspace must already be in the store on every node: the BPTT stage is backpropagation and runs
in one process (``szo recipe NAME --set kind=bp``, same ``--set`` options). Rank 0 writes the
run directory; each rank evaluates its shard of the test set. Model initialisation draws from torch's global RNG inside
``torch.random.fork_rng`` seeded with ``cfg.seed`` (the caller's RNG state is untouched);
everything else (data order, RGE directions) uses the run's own ``torch.Generator``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from szo import distributed as D
from szo.adapt.stage import tta_stage
from szo.build import build_model, load_run_model, subspace_store_for
from szo.config import RecipeConfig, load_recipe
from szo.demos.stage_pool import default_workers, run_stages
from szo.models.base import SpikingModel
from szo.prepare import optimizer_options, preflight
from szo.report import collect_runs, render, write_report
from szo.rundir import check_resume_config, run_lock
from szo.stages import (
    bptt_source,
    bptt_stage,
    check_store_entry,
    device_for,
    run_dir_guard,
    subspace_build_stage,
    subspace_stage,
)
from szo.train import TrainingDiverged

__all__ = ["run_recipe", "run_or_reuse", "run_demo_digits", "load_run_model", "run_bptt_stage", "run_subspace_stage",
           "build_store_subspace", "build_model", "subspace_store_for", "run_dir_guard", "check_store_entry",
           "optimizer_options"]

# the stage functions under the names this module always exported them
run_bptt_stage = bptt_stage
run_subspace_stage = subspace_stage
build_store_subspace = subspace_build_stage


def run_recipe(cfg: Mapping[str, Any], out_dir: str | os.PathLike, device: str | None = None,
               resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run a resolved recipe config (``szo.config.load_recipe``); returns the last stage's summary.
    ``callbacks``: extra ``szo.train.Callback`` objects for the subspace stage's training loop."""
    dev = device_for(cfg, device)
    out = Path(out_dir)
    with run_dir_guard(out, cfg, resume=resume):
        model = preflight(cfg)  # built once: the first stage trains it
        if D.env_world_size() > 1 or D.get_info().enabled:
            return _run_recipe_distributed(cfg, out, dev, resume, callbacks, model)
        return _run_recipe(cfg, out, dev, resume, callbacks, model)


def run_or_reuse(cfg: Mapping[str, Any], run_dir: str | os.PathLike, device: str | None = None) -> dict[str, Any]:
    """A study's run: the summary in ``run_dir/results.json`` if that run completed with this
    config (a different config: one clear line), else the recipe run (resumed if it started)."""
    run_dir = Path(run_dir)
    res = run_dir / "results.json"
    if res.is_file():
        check_resume_config(run_dir, cfg)  # a different configuration: one clear line
        summary = json.loads(res.read_text(encoding="utf-8"))
        stage = cfg["bptt"] if cfg["kind"] == "bp" else cfg["train"]
        if summary.get("status", "completed") == "completed" and summary.get("epochs") == stage["epochs"]:
            return summary
    return run_recipe(cfg, run_dir, device=device, resume=(run_dir / "config.yaml").is_file())


def _run_recipe(cfg: RecipeConfig, out: Path, dev: str, resume: bool, callbacks: Sequence[Any] = (),
                model: SpikingModel | None = None) -> dict[str, Any]:
    """``model``: ``preflight``'s, given to the first stage that trains the recipe's own model."""
    if cfg.kind == "tta":
        return tta_stage(cfg, out, device=dev)
    if cfg.kind == "bp":
        return bptt_stage(cfg, out, device=dev, resume=resume, model=model)
    store = subspace_store_for(cfg)
    if not store.exists(cfg.subspace.name):
        check_store_entry(cfg)
        source = bptt_source(cfg)  # the recipe's, or its source's
        bptt_stage(source, out / "bptt", device=dev, resume=resume, model=model if source is cfg else None)
        model = None  # trained by BPTT: the subspace stage starts from its own
    return subspace_stage(cfg, out, device=dev, resume=resume, callbacks=callbacks, model=model)


def _run_recipe_distributed(cfg: RecipeConfig, out: Path, dev: str, resume: bool, callbacks: Sequence[Any] = (),
                            model: SpikingModel | None = None) -> dict[str, Any]:
    """One rank's part of a torchrun run: a subspace recipe whose subspace is already stored."""
    world = max(D.env_world_size(), D.get_info().world_size)
    if cfg["kind"] != "subspace":
        raise ValueError(f"multi-process runs train in a subspace (kind: subspace); recipe {cfg['name']!r} is kind: "
                         f"{cfg['kind']}: run it in one process (szo recipe {cfg['name']}), not under torchrun")
    store = subspace_store_for(cfg)
    name = cfg["subspace"]["name"]
    if not store.exists(name):
        raise ValueError(f"subspace {name!r} is not in the store {store.root} (needed on every node of a "
                         f"{world}-process run); its BPTT stage runs in one process: szo recipe {cfg['name']} "
                         f"--set kind=bp [same --set options], then rerun under torchrun")
    if dev.startswith("cuda"):  # one GPU per process
        dev = f"cuda:{D.get_info().local_rank}"
    return subspace_stage(cfg, out, device=dev, resume=resume, callbacks=callbacks, model=model)


#: the demo's subspace runs in the paper's units (``szo demo digits --scale absolute``), the settings its
#: README table was measured with before the relative scale became the default: App. G's mu 1 / lr 1 for
#: BP-Subspace / SZO-CGE (from scratch and continual); SZO-RGE hand-tuned on this 5k-parameter net, at q = 1
#: (lr 0.05 already diverges, README) and at q = k/2 (k/q times less noisy: a larger step). The bench
#: scripts that reproduce paper-unit tables on digits pin the same values from here.
PAPER_UNITS = ("szo.scale=absolute", "szo.mu=1", "train.lr=1")
DIGITS_RGE_UNITS = ("szo.scale=absolute", "szo.mu=0.3", "train.lr=0.02")
DIGITS_RGE_QK2_UNITS = ("szo.scale=absolute", "szo.mu=0.3", "train.lr=0.3")


def run_demo_digits(out_dir: str | os.PathLike = "runs/demo", *, device: str = "cpu", full_space: bool = True,
                    progress: bool = True, seed: int = 0, scale: str | None = None,
                    workers: int | None = None) -> dict[str, Any]:
    """The digits quickstart (``make demo``): BPTT with trajectory -> k=20 subspace -> BP-Subspace,
    SZO-CGE, SZO-RGE(q=1), SZO-RGE(q=k/2) from scratch, a continual SZO-CGE run in a last-epochs
    subspace, optionally full-space ZO-CGE (SNN and its ReLU ANN twin, same 2k forwards per step),
    then the Table 1/3-style report. The runs at SZO-CGE's budget take :data:`DEMO_EPOCHS` epochs.
    ``seed`` seeds every stage (the BPTT run, hence the subspace, and each SZO run). ``scale``: the subspace runs' ``szo.scale`` (None: the recipes' default,
    ``trajectory`` with its mu / lr; ``"absolute"``: the paper's units, :data:`PAPER_UNITS` and the
    hand-tuned SZO-RGE values). Every stage's config is loaded (and so checked) before any work.
    Re-running continues: finished runs are kept (a run directory trained with other settings is
    refused in one line), interrupted ones resume from their checkpoints. Returns {run name: summary}.
    ``workers``: processes for the subspace runs after the BPTT stage, one torch thread each
    (``szo.demos.stage_pool``; None: one per physical core on the CPU, 1: all in this process with
    the run's own thread policy)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive int (processes for the demo's subspace runs) or None, got {workers!r}")
    out = Path(out_dir)
    stages = _demo_configs(out, device, full_space, progress, seed, scale)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):  # the demo's directory; every stage in it holds its own
        return _demo_digits(out, device, progress, stages, workers)


#: the demo's epochs for the runs at SZO-CGE's budget (BP-Subspace, SZO-CGE, SZO-RGE(q = k/2) and both
#: full-space ZO-CGE runs, which take SZO-CGE's 2k + 1 forwards per step): half the digits-scratch recipe's
#: 20, so that the quick start fits in three minutes on two cores (issue 50). SZO-CGE converges by epoch 10
#: of the recipe's 20 (docs/guide.md); the full-space runs keep SZO-CGE's forward budget. SZO-RGE(q = 1)
#: keeps the recipe's 60 epochs (q = 1 is ~k times noisier per step; 3 forwards per step), the continual
#: run its recipe's 2.
DEMO_EPOCHS = 10


def _demo_configs(out: Path, device: str, full_space: bool, progress: bool, seed: int,
                  scale: str | None) -> list[tuple[str, RecipeConfig, int]]:
    """(stage name, config, its forwards: forwards per step x epochs, what orders the pool's jobs, longest
    first) of every demo stage, in the report's order: BPTT, the scratch runs, the continual run."""
    base = [f"subspace.root={(out / 'subspaces').resolve()}", f"progress={str(progress).lower()}", f"device={device}",
            f"seed={seed}"]

    def units(absolute: tuple[str, ...]) -> tuple[str, ...]:  # a subspace run's scale (absolute: with its mu / lr)
        return absolute if scale == "absolute" else (f"szo.scale={scale}",) if scale else ()

    bp_cfg = load_recipe("digits-bp", base)
    k = int(bp_cfg["subspace"]["k"])
    cge = f"train.epochs={DEMO_EPOCHS}"
    # (name, settings, forwards per step); RGE with q = k/2 directions is ~k/q times less noisy than q = 1:
    # the CGE epoch count; under the relative scale the same mu / lr serve both q (the signal fraction)
    runs = [("bp-subspace", ["method=bp-subspace", cge, *units(PAPER_UNITS)], 2),
            ("szo-cge", ["method=szo-cge", cge, *units(PAPER_UNITS)], 2 * k + 1),
            ("szo-rge-q1", ["method=szo-rge", "szo.q=1", *units(DIGITS_RGE_UNITS)], 3),
            (f"szo-rge-q{k // 2}", ["method=szo-rge", f"szo.q={k // 2}", cge, *units(DIGITS_RGE_QK2_UNITS)], k + 1)]
    if full_space:  # SZO-CGE's forwards per step: 2 x 20 coordinates (the recipe's coords_per_step = k)
        runs += [("zo-cge", ["method=zo-cge", cge], 2 * k + 1),
                 ("zo-cge-ann", ["method=zo-cge", "model.activation=relu", cge], 2 * k + 1)]
    stages = [("bp", bp_cfg, 2)]
    for name, sets, forwards in runs:
        cfg = load_recipe("digits-scratch", base + sets)
        stages.append((name, cfg, forwards * int(cfg["train"]["epochs"])))
    cont = load_recipe("digits-continual", [*base, *units(PAPER_UNITS)])
    return [*stages, ("continual-szo-cge", cont, (2 * int(cont["subspace"]["k"]) + 1) * int(cont["train"]["epochs"]))]


def _demo_digits(out: Path, device: str, progress: bool, stages: list[tuple[str, RecipeConfig, int]],
                 workers: int | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    summaries: dict[str, Any] = {}

    def report(name: str, s: Mapping[str, Any]) -> None:
        print(f"[demo] {name}: max test acc {100 * s['best_test_acc']:.2f}% (epoch {s['converged_epoch']}), "
              f"#FP {s['fp']}, #BP {s['bp']}, {time.perf_counter() - t0:.0f} s elapsed", flush=True)

    jobs: list[tuple[str, RecipeConfig, int]] = []  # the subspace runs still to do: independent of each other
    for name, cfg, cost in stages:
        res = out / name / "results.json"
        kind = "bptt" if cfg["kind"] == "bp" else "subspace"
        if res.is_file():
            check_resume_config(out / name, cfg, kind)  # a run of other settings: one line, not its old numbers
            summaries[name] = json.loads(res.read_text(encoding="utf-8"))
            if summaries[name].get("status") == "diverged":  # the same settings would diverge again
                raise TrainingDiverged(f"demo stage {name} diverged in an earlier run ({summaries[name].get('error')}); "
                                       f"remove {out / name} to run it again")
            print(f"[demo] {name}: already done ({res})")
            continue
        if kind == "bptt":
            print(f"[demo] {name} ...", flush=True)
            summaries[name] = run_recipe(cfg, out / name, device=device, resume=True)
            report(name, summaries[name])
            continue
        if not subspace_store_for(cfg).exists(cfg["subspace"]["name"]):  # the continual window subspace
            subspace_build_stage(cfg, out / "bp", progress=progress)  # of the same BPTT run
        jobs.append((name, cfg, cost))
    jobs.sort(key=lambda job: -job[2])  # longest first: the last job to start is a short one
    n = default_workers(len(jobs), device) if workers is None else workers
    if n > 1:  # cores spent across runs, one thread each (szo.demos.stage_pool)
        print(f"[demo] {', '.join(name for name, *_ in jobs)} ... ({n} worker processes, one torch thread each)",
              flush=True)
        summaries.update(run_stages([(name, subspace_stage, (cfg, out / name),
                                      {"device": device, "resume": True, "log_prefix": f"[{name}] "})
                                     for name, cfg, _ in jobs], n, done=report))
    else:
        for name, cfg, _ in jobs:
            print(f"[demo] {name} ...", flush=True)
            summaries[name] = subspace_stage(cfg, out / name, device=device, resume=True, log_prefix=f"[{name}] ")
            report(name, summaries[name])
    summaries = {name: summaries[name] for name, *_ in stages}
    runs_found = collect_runs([out / n for n in summaries])
    md = render(runs_found)
    write_report(runs_found, out)
    print(md)
    print(f"[demo] done in {time.perf_counter() - t0:.0f} s; report: {out / 'report.md'}, plot: {out / 'accuracy.png'}")
    return summaries
