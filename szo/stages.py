"""The stages of a run as public functions: what ``szo.pipeline``, the adaptation, federated and
study commands compose. Each takes a resolved config (``szo.config.RecipeConfig``) and a run
directory, and keeps the run-directory contract (docs/runs.md): the lock, the resume check,
``config.yaml``, checksummed checkpoints, ``results.json`` with a status, the metric sinks.

* :func:`bptt_stage` -- BPTT with the trajectory recorder, the final model as safetensors, then
  (``build``) the subspace in the store (:func:`subspace_build_stage`);
* :func:`subspace_build_stage` -- the store entry ``cfg.subspace`` from a BPTT run's trajectory;
* :func:`subspace_stage` -- train ``cfg.method`` in the stored subspace (scratch or continual;
  float or fixed-point backend); ``szo.prepare`` prepares what it trains (the model, the optimizer
  options, ``mcu-zo``'s block selection) and the model a run starts from (``preflight``);
* :func:`evaluate_stage` -- a run directory's model on the recipe's test set;
* adaptation and export: ``szo.adapt.stage.tta_stage`` and ``szo.commands.export`` build on these.

Model initialisation draws from torch's global RNG inside ``torch.random.fork_rng`` seeded
with ``cfg.seed`` (``szo.build.build_model``); everything else (data order, RGE directions) uses
the run's own ``torch.Generator``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from subspace_store import Subspace, build_subspace
from szo import distributed as D
from szo.build import build_model, load_run_model, loaders_for, loss_for, subspace_store_for
from szo.config import RecipeConfig, source_config, write_config
from szo.hw.convert import FixedPointNetwork
from szo.io import save_weights
from szo.methods import get_method, method_label
from szo.models.base import SpikingModel
from szo.optim import RunOptions, build_optimizer
from szo.prepare import block_selection_stage, optimizer_options, subspace_model
from szo.rundir import check_pins, check_resume_config, run_lock, run_pins
from szo.train import Callback, TrajectoryCallback, checkpoint_path, evaluate, fit
from szo.train.callbacks import ResultFields, TensorBoardSink
from szo.trajectory import Trajectory, TrajectoryRecorder, planned_samples
from szo.zo import ProbePath, ReportsResults

__all__ = ["bptt_stage", "bptt_source", "subspace_build_stage", "subspace_stage", "evaluate_stage", "run_dir_guard",
           "check_store_entry", "check_distributed", "device_for", "parallel_for", "metric_sinks"]


def device_for(cfg: RecipeConfig, device: str | None = None) -> str:
    """``device`` or the recipe's; one line when CUDA is asked for and not there."""
    dev = device or cfg.device
    if str(dev).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {dev!r} requested but CUDA is not available here; valid: cpu")
    return str(dev)


def _set_forward(model: torch.nn.Module, cfg: RecipeConfig) -> None:
    """The recipe's ``compile`` and ``cuda_graphs`` settings on the model (every stage, so BPTT and
    SZO timings stay comparable)."""
    c = cfg.compile
    if c is not False:
        model.set_compile(True, backend="inductor" if c is True else c)
    if cfg.cuda_graphs:
        model.set_cuda_graphs(True)


def _scheduler(opt: torch.optim.Optimizer, stage: Mapping[str, Any]):
    if stage["scheduler"] == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=stage["t_max"] or stage["epochs"])
    return None


def metric_sinks(cfg: RecipeConfig, run_dir: str | os.PathLike) -> list[Callback]:
    """The metric sinks a run adds to metrics.jsonl: TensorBoard event files with ``log.tensorboard``."""
    return [TensorBoardSink(Path(run_dir) / "tensorboard")] if cfg.log.tensorboard else []


@contextlib.contextmanager
def run_dir_guard(run_dir: str | os.PathLike, cfg: RecipeConfig, *, resume: bool,
                  stage: str | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (rank 0 of a multi-process run; re-entrant) and,
    when resuming a directory that holds a checkpoint, refuse a config that changes what
    ``stage`` trains. Decided on rank 0; every rank raises the same one-line error."""
    with contextlib.ExitStack() as stack:
        def decide() -> None:
            stack.enter_context(run_lock(run_dir))
            if resume and stage is not None and checkpoint_path(run_dir).exists():
                check_resume_config(run_dir, cfg, stage)

        D.main_decides(decide)
        yield


def bptt_source(cfg: RecipeConfig) -> RecipeConfig:
    """The config whose BPTT stage builds a subspace recipe's store entry: the recipe itself, or the
    recipe its ``source`` names with this recipe's model, BPTT, trajectory, subspace and run settings
    (``szo.config.source_config``: an adaptation recipe's clean pretraining)."""
    return cfg if cfg.source is None else source_config(cfg)


def check_store_entry(cfg: RecipeConfig) -> None:
    """A store entry directory without its manifest (an interrupted or foreign write) blocks
    the name: say so before any compute, with the way out."""
    store = subspace_store_for(cfg)
    name = cfg.subspace.name
    if name is not None and store.path(name).exists() and not store.exists(name):
        raise ValueError(f"subspace store entry {name!r} in {store.root} is incomplete (no manifest.json: an "
                         f"interrupted or foreign write); remove it (szo subspace rm {name} --root {store.root}) "
                         f"or pass --set subspace.name=OTHER")


def _check_trajectory_size(cfg: RecipeConfig, steps_per_epoch: int) -> None:
    """``subspace.k`` against the samples the BPTT stage will record (k <= N - 1), before it runs."""
    st, tr, sp = cfg.bptt, cfg.trajectory, cfg.subspace
    spe = min(steps_per_epoch, st["max_steps_per_epoch"] or steps_per_epoch)
    n = planned_samples(st["epochs"], spe, every=tr["every"], record_initial=tr["record_initial"], window=sp["window"])
    if sp["k"] > n - 1:
        win = f", subspace.window={sp['window']}" if sp["window"] is not None else ""
        raise ValueError(f"subspace.k={sp['k']} needs at least k+1 = {sp['k'] + 1} trajectory samples, but the BPTT "
                         f"stage will record N = {n} (bptt.epochs={st['epochs']} x {spe} steps, trajectory.every="
                         f"{tr['every']}, record_initial={str(tr['record_initial']).lower()}{win}); choose "
                         f"subspace.k <= {max(n - 1, 1)} or record more samples (smaller trajectory.every, "
                         "more bptt.epochs)")


def _info(cfg: RecipeConfig, method: str, mode: str) -> dict[str, Any]:
    """What results.json says of the run besides its numbers."""
    q = cfg.szo.q if get_method(method).q_labeled else None
    label = method_label(method, q, cfg.model.activation)
    return {"recipe": cfg.name, "label": label, "method": method, "mode": mode, "dataset": cfg.data.name,
            "model": cfg.model.name, "activation": cfg.model.activation, "q": q, "seed": cfg.seed,
            "name": f"{cfg.name} {label}"}


# ----------------------------------------------------------------------------- BPTT + subspace build
def subspace_build_stage(cfg: RecipeConfig, bptt_dir: str | os.PathLike, *, overwrite: bool = False,
                         progress: bool = True) -> Subspace:
    """Build ``cfg.subspace`` from the trajectory in ``bptt_dir`` and save it in the store."""
    bptt_dir = Path(bptt_dir).resolve()
    s = cfg.subspace
    sub = build_subspace(bptt_dir / "trajectory", s["k"], window=s["window"], reference=s["reference"],
                         progress=progress)
    sub.provenance["source_model"] = str(bptt_dir / "model.safetensors")
    sub.provenance["source_run"] = str(bptt_dir)
    subspace_store_for(cfg).save(s["name"], sub, overwrite=overwrite)
    return sub


def bptt_stage(cfg: RecipeConfig, run_dir: str | os.PathLike, *, device: str = "cpu", resume: bool = False,
               build: bool = True, model: SpikingModel | None = None) -> dict[str, Any]:
    """BPTT with the trajectory recorder, final model as safetensors, then (``build``) the subspace.
    ``model``: the recipe's model as ``build_model(cfg)`` returns it (``preflight``'s), else built here.

    Before any training: the run directory's lock, the resume config check, the store entry
    (not taken, not incomplete), ``subspace.k`` against the planned number of trajectory
    samples, and on resume every recorded sample's sha256."""
    with run_dir_guard(run_dir, cfg, resume=resume, stage="bptt"):
        return _bptt(cfg, Path(run_dir), device=device, resume=resume, build=build, model=model)


def _bptt(cfg: RecipeConfig, run_dir: Path, *, device: str, resume: bool, build: bool,
          model: SpikingModel | None) -> dict[str, Any]:
    store = subspace_store_for(cfg)
    name = cfg.subspace.name
    if build and name is not None and store.exists(name) and not resume:
        raise ValueError(f"subspace {name!r} already exists in {store.root}; remove it "
                         f"(szo subspace rm {name}) or pass --set subspace.name=OTHER")
    if build:
        check_store_entry(cfg)
    g = torch.Generator().manual_seed(int(cfg.seed))
    train, test = loaders_for(cfg, g)
    if build and name is not None and not store.exists(name):
        _check_trajectory_size(cfg, len(train))
    if resume and (run_dir / "trajectory" / "manifest.json").is_file():
        Trajectory(run_dir / "trajectory", verify=True)  # a damaged sample stops the run now, not after it
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, run_dir / "config.yaml")
    model = (build_model(cfg) if model is None else model).to(device)
    _set_forward(model, cfg)
    st = cfg.bptt
    opt = build_optimizer("bp", model, lr=st["lr"], momentum=st["momentum"], weight_decay=st["weight_decay"])
    rec = TrajectoryRecorder(run_dir / "trajectory", model, model_name=cfg.model.name,
                             every=cfg.trajectory.every, record_initial=cfg.trajectory.record_initial)
    summary = fit(model, train, test, opt, epochs=st["epochs"], loss_fn=loss_for(cfg), scheduler=_scheduler(opt, st),
                  device=device, run_dir=run_dir, callbacks=[TrajectoryCallback(rec), *metric_sinks(cfg, run_dir)],
                  generator=g, resume=resume, eval_every=st["eval_every"], progress=cfg.progress,
                  max_steps_per_epoch=st["max_steps_per_epoch"], checkpoint_every_steps=st["checkpoint_every_steps"],
                  info=_info(cfg, "bp", "bptt"), pins=run_pins(cfg), precision=cfg.precision, threads=cfg.threads,
                  check_pins=lambda saved: check_pins(run_dir, saved, cfg, "bptt"))
    save_weights(run_dir / "model.safetensors", model.state_dict(),
                 {"model": cfg.model.name, "fingerprint": model.fingerprint()})
    if build and name is not None and not store.exists(name):
        subspace_build_stage(cfg, run_dir, progress=cfg.progress)
    return summary


# ----------------------------------------------------------------------------- the subspace stage
def parallel_for(cfg: RecipeConfig) -> Any:
    """``szo.distributed.Parallel`` for this rank when the process group spans > 1 process, else None."""
    if not D.get_info().enabled:
        if D.env_world_size() > 1:
            raise ValueError(f"launched by torchrun (WORLD_SIZE={D.env_world_size()}) but torch.distributed is not "
                             "initialised; run `szo recipe` (the CLI sets it up) or wrap the call in "
                             "szo.distributed.launch()")
        return None
    check_distributed(cfg)
    dc = cfg.distributed
    return D.Parallel(mode=dc["mode"], sync_bn=dc["sync_bn"])


def check_distributed(cfg: RecipeConfig) -> None:
    """Everything a multi-process run does not support, checked before any work starts: the probe
    path with its torchrun mode (``szo.zo.ProbePath``: the method's modes, the engine, streaming,
    synchronised BN with compile or CUDA graphs) and the float learner."""
    ProbePath.from_recipe(cfg, parallel=True).check(recipe=True)
    if cfg.hw.learner == "integer":
        raise ValueError("multi-process (torchrun) runs do not support hw.learner 'integer': use 'float', or run in "
                         "one process")


def subspace_stage(cfg: RecipeConfig, run_dir: str | os.PathLike, *, device: str = "cpu", resume: bool = False,
                   callbacks: Sequence[Callback] = (), model: SpikingModel | None = None,
                   log_prefix: str = "") -> dict[str, Any]:
    """Train ``cfg.method`` in the stored subspace ``cfg.subspace.name`` (scratch or continual),
    holding the run directory's lock (a resume first checks the config against its config.yaml);
    on every rank of a multi-process run (only rank 0 writes ``run_dir``). ``callbacks``: extra
    ``szo.train.Callback`` objects for the training loop; ``model``: the recipe's model as
    ``build_model(cfg)`` returns it (``preflight``'s), else built here. ``log_prefix``: the prefix of
    its progress lines (``szo.train.fit``).

    ``backend: fixed`` trains through the Loihi-style integer forward (``szo.hw.to_fixed``, same
    parameters); ``hw.learner: integer`` trains with the integer on-chip learner
    (``szo.hw.optim.onchip.OnChipSZO``, built by ``build_optimizer`` like every method).
    """
    par = parallel_for(cfg)
    with run_dir_guard(run_dir, cfg, resume=resume, stage="subspace"):
        run_dir = Path(run_dir)
        if par is None or par.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_config(cfg, run_dir / "config.yaml")
        g = torch.Generator().manual_seed(int(cfg.seed))
        train, test = loaders_for(cfg, g, par)
        sm = subspace_model(cfg, test, model=model)
        sm.net.to(device)
        _set_forward(sm.model, cfg)
        tr, sz = cfg.train, cfg.szo
        sm.model.set_streaming(sz["time_chunk"], sz["stream_bn"])  # probes and evaluation, if asked for
        run = RunOptions(generator=g, distributed=par.mode if par is not None else None,
                         sync_bn=par.sync_bn if par is not None else True, start="current")  # at sub.reference already
        options, hw = optimizer_options(cfg), cfg.hw
        if hw.blocks is not None:  # mcu-zo: seed 004's BP-free block selection, then only that block trains
            sel = block_selection_stage(sm.net, train.dataset, blocks=hw.blocks, epochs=hw.select_epochs,
                                        heldout=hw.heldout, batch_size=cfg.data.batch_size, q=options.q,
                                        lr=options.lr, seed=int(cfg.seed), loss_fn=loss_for(cfg), device=device,
                                        run_dir=run_dir)
            options = options.replace(layers=list(sel["layers"]))
            sm.extra["block_selection"] = {k: sel[k] for k in ("block", "layers", "blocks", "gains", "baseline",
                                                               "forwards", "steps_per_block", "heldout_samples")}
        opt = build_optimizer(cfg.method, sm.net, subspace=sm.subspace, options=options, run=run)
        info = _info(cfg, cfg.method, cfg.mode)
        info.update(subspace=cfg.subspace.name, k=sm.subspace.k, **sm.extra)
        late = ResultFields(lambda: _late_results(sm.net, opt, sm.extra))
        digest = subspace_store_for(cfg).digest(cfg.subspace.name)
        return fit(sm.net, train, test, opt, epochs=tr["epochs"], loss_fn=loss_for(cfg), scheduler=_scheduler(opt, tr),
                   device=device, run_dir=run_dir, generator=g, resume=resume, eval_every=tr["eval_every"],
                   progress=cfg.progress, max_steps_per_epoch=tr["max_steps_per_epoch"],
                   checkpoint_every_steps=tr["checkpoint_every_steps"], info=info, bn_stats=cfg.bn_stats,
                   parallel=par, callbacks=[late, *metric_sinks(cfg, run_dir), *callbacks], precision=cfg.precision, threads=cfg.threads,
                   log_prefix=log_prefix, pins=run_pins(cfg, digest), check_pins=lambda saved: check_pins(run_dir, saved, cfg, "subspace", digest))


def _late_results(net: torch.nn.Module, opt: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """What is known only after training: the model's CUDA-graph counts and every clamp of its
    integer forwards (backend fixed), and what the optimizer reports of itself
    (``szo.zo.ReportsResults``: a tensor-train run's switch step, a subspace method's units, seed
    004's learner's modes and clamps), merged into the stage's own record under the same key."""
    out: dict[str, Any] = {}
    if isinstance(net, SpikingModel) and net.cuda_graphs is not None:  # captures, replays, eager forwards by reason
        out["cuda_graphs"] = net.cuda_graphs.stats.as_dict()
    if isinstance(net, FixedPointNetwork):
        out.update(saturations=net.saturation_counts(), saturations_total=net.counter.total())
    if isinstance(opt, ReportsResults):
        for key, value in opt.result_fields().items():
            mine = extra.get(key)
            out[key] = {**mine, **value} if isinstance(mine, Mapping) and isinstance(value, Mapping) else value
    return out


# ----------------------------------------------------------------------------- evaluation
def evaluate_stage(run_dir: str | os.PathLike, *, device: str = "cpu") -> dict[str, Any]:
    """The model a run directory holds, evaluated on its recipe's test set: ``{"test_loss",
    "test_acc", "samples"}`` (eval-mode BN, the recipe's loss)."""
    model, cfg = load_run_model(run_dir, device)
    _, test = loaders_for(cfg, torch.Generator().manual_seed(int(cfg.seed)))
    loss, acc = evaluate(model, test, loss_for(cfg), device)
    return {"test_loss": loss, "test_acc": acc, "samples": len(test.dataset)}
