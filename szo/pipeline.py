"""Run a recipe end to end: BPTT (+ trajectory) -> subspace -> training in the subspace.

``run_recipe(cfg, out_dir)``:

* ``kind: bp`` recipes run the BPTT stage in ``out_dir`` (trajectory in ``out_dir/trajectory``,
  final model ``out_dir/model.safetensors`` with BN buffers), build the subspace
  (``subspace.k / window / reference``) and save it in the store
  (``subspace.root`` or ``$SZO_SUBSPACE_ROOT`` or ``./subspaces``); its provenance records
  ``source_model`` (the model file) and ``source_run``.
* ``kind: subspace`` recipes first run that BPTT stage in ``out_dir/bptt`` if the store has
  no ``subspace.name`` yet, then train in the subspace in ``out_dir`` with ``method``:
  scratch runs start at the subspace reference (first trajectory sample) with fresh BN
  statistics; continual runs load the pretrained model (``provenance["source_model"]``,
  parameters and BN buffers) and set the parameters to the reference (last sample).

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

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from szo.config import write_config
from szo.hw.convert import FixedPointNetwork
from szo.io import atomic_save_safetensors
from szo.methods import get_method, list_methods, method_label
from szo.optim import HybridZO, IntegerLearnerOptions, OptimizerOptions, RunOptions, TTOptions, build_optimizer
from szo.runs import build_model, load_run_model, loaders_for, loss_for, subspace_store_for
from szo.train.callbacks import ResultFields

__all__ = ["run_recipe", "run_demo_digits", "load_run_model", "run_bptt_stage", "run_subspace_stage", "build_store_subspace", "build_model",
           "subspace_store_for", "run_dir_guard", "check_store_entry"]


def _device(cfg: Mapping[str, Any], device: str | None) -> str:
    dev = device or cfg["device"]
    if str(dev).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {dev!r} requested but CUDA is not available here; valid: cpu")
    return str(dev)


def _set_compile(model: torch.nn.Module, cfg: Mapping[str, Any]) -> None:
    """The recipe's ``compile`` setting on the model (every stage, so BPTT and SZO timings stay comparable)."""
    c = cfg["compile"]
    if c is not False:
        model.set_compile(True, backend="inductor" if c is True else c)


def _scheduler(opt: torch.optim.Optimizer, stage: Mapping[str, Any]):
    if stage["scheduler"] == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=stage["epochs"])
    return None


@contextlib.contextmanager
def run_dir_guard(run_dir: str | os.PathLike, cfg: Mapping[str, Any], *, resume: bool, stage: str | None = None):
    """Hold ``run_dir``'s lock for the block (rank 0 of a multi-process run; re-entrant) and,
    when resuming a directory that holds a checkpoint, refuse a config that changes what
    ``stage`` trains. Decided on rank 0; every rank raises the same one-line error."""
    from szo.distributed import main_decides
    from szo.rundir import check_resume_config, run_lock
    from szo.train import checkpoint_path

    with contextlib.ExitStack() as stack:
        def decide() -> None:
            stack.enter_context(run_lock(run_dir))
            if resume and stage is not None and checkpoint_path(run_dir).exists():
                check_resume_config(run_dir, cfg, stage)

        main_decides(decide)
        yield


def check_store_entry(cfg: Mapping[str, Any]) -> None:
    """A store entry directory without its manifest (an interrupted or foreign write) blocks
    the name: say so before any compute, with the way out."""
    store = subspace_store_for(cfg)
    name = cfg["subspace"]["name"]
    if name is not None and store.path(name).exists() and not store.exists(name):
        raise ValueError(f"subspace store entry {name!r} in {store.root} is incomplete (no manifest.json: an "
                         f"interrupted or foreign write); remove it (szo subspace rm {name} --root {store.root}) "
                         f"or pass --set subspace.name=OTHER")


def _check_trajectory_size(cfg: Mapping[str, Any], steps_per_epoch: int) -> None:
    """``subspace.k`` against the samples the BPTT stage will record (k <= N - 1), before it runs."""
    from szo.trajectory import planned_samples

    st, tr, sp = cfg["bptt"], cfg["trajectory"], cfg["subspace"]
    spe = min(steps_per_epoch, st["max_steps_per_epoch"] or steps_per_epoch)
    n = planned_samples(st["epochs"], spe, every=tr["every"], record_initial=tr["record_initial"], window=sp["window"])
    if sp["k"] > n - 1:
        win = f", subspace.window={sp['window']}" if sp["window"] is not None else ""
        raise ValueError(f"subspace.k={sp['k']} needs at least k+1 = {sp['k'] + 1} trajectory samples, but the BPTT "
                         f"stage will record N = {n} (bptt.epochs={st['epochs']} x {spe} steps, trajectory.every="
                         f"{tr['every']}, record_initial={str(tr['record_initial']).lower()}{win}); choose "
                         f"subspace.k <= {max(n - 1, 1)} or record more samples (smaller trajectory.every, "
                         "more bptt.epochs)")


def _info(cfg: Mapping[str, Any], method: str, mode: str, model: torch.nn.Module) -> dict[str, Any]:
    q = cfg["szo"]["q"] if get_method(method).q_labeled else None
    return {"recipe": cfg["name"], "label": method_label(method, q, cfg["model"]["activation"]), "method": method,
            "mode": mode, "dataset": cfg["data"]["name"], "model": cfg["model"]["name"],
            "activation": cfg["model"]["activation"], "q": q, "seed": cfg["seed"],
            "name": f"{cfg['name']} {method_label(method, q, cfg['model']['activation'])}"}


def build_store_subspace(cfg: Mapping[str, Any], bptt_dir: str | os.PathLike, *, overwrite: bool = False,
                         progress: bool = True):
    """Build ``cfg.subspace`` from the trajectory in ``bptt_dir`` and save it in the store."""
    from subspace_store import build_subspace

    bptt_dir = Path(bptt_dir).resolve()
    s = cfg["subspace"]
    sub = build_subspace(bptt_dir / "trajectory", s["k"], window=s["window"], reference=s["reference"],
                         progress=progress)
    sub.provenance["source_model"] = str(bptt_dir / "model.safetensors")
    sub.provenance["source_run"] = str(bptt_dir)
    store = subspace_store_for(cfg)
    store.save(s["name"], sub, overwrite=overwrite)
    return sub


def run_bptt_stage(cfg: Mapping[str, Any], run_dir: str | os.PathLike, *, device: str = "cpu",
                   resume: bool = False, build: bool = True) -> dict[str, Any]:
    """BPTT with the trajectory recorder, final model as safetensors, then (``build``) the subspace.

    Before any training: the run directory's lock, the resume config check, the store entry
    (not taken, not incomplete), ``subspace.k`` against the planned number of trajectory
    samples, and on resume every recorded sample's sha256."""
    with run_dir_guard(run_dir, cfg, resume=resume, stage="bptt"):
        return _bptt_stage(cfg, Path(run_dir), device=device, resume=resume, build=build)


def _bptt_stage(cfg: Mapping[str, Any], run_dir: Path, *, device: str, resume: bool, build: bool) -> dict[str, Any]:
    from szo.train import TrajectoryCallback, fit
    from szo.trajectory import Trajectory, TrajectoryRecorder

    store = subspace_store_for(cfg)
    name = cfg["subspace"]["name"]
    if build and name is not None and store.exists(name) and not resume:
        raise ValueError(f"subspace {name!r} already exists in {store.root}; remove it "
                         f"(szo subspace rm {name}) or pass --set subspace.name=OTHER")
    if build:
        check_store_entry(cfg)
    g = torch.Generator().manual_seed(int(cfg["seed"]))
    train, test = loaders_for(cfg, g)
    if build and name is not None and not store.exists(name):
        _check_trajectory_size(cfg, len(train))
    if resume and (run_dir / "trajectory" / "manifest.json").is_file():
        Trajectory(run_dir / "trajectory", verify=True)  # a damaged sample stops the run now, not after it
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, run_dir / "config.yaml")
    model = build_model(cfg).to(device)
    _set_compile(model, cfg)
    st = cfg["bptt"]
    opt = build_optimizer("bp", model, lr=st["lr"], momentum=st["momentum"], weight_decay=st["weight_decay"])
    rec = TrajectoryRecorder(run_dir / "trajectory", model, model_name=cfg["model"]["name"],
                             every=cfg["trajectory"]["every"], record_initial=cfg["trajectory"]["record_initial"])
    summary = fit(model, train, test, opt, epochs=st["epochs"], loss_fn=loss_for(cfg), scheduler=_scheduler(opt, st),
                  device=device, run_dir=run_dir, callbacks=[TrajectoryCallback(rec)], generator=g, resume=resume,
                  eval_every=st["eval_every"], progress=cfg["progress"], max_steps_per_epoch=st["max_steps_per_epoch"],
                  checkpoint_every_steps=st["checkpoint_every_steps"], info=_info(cfg, "bp", "bptt", model))
    atomic_save_safetensors(run_dir / "model.safetensors", model.state_dict(),
                            {"model": cfg["model"]["name"], "fingerprint": model.fingerprint()})
    if build and name is not None and not store.exists(name):
        build_store_subspace(cfg, run_dir, progress=cfg["progress"])
    return summary


def _source_state(cfg: Mapping[str, Any], sub) -> dict[str, torch.Tensor]:
    """The pretrained model (parameters + BN buffers) the subspace was built from."""
    from safetensors.torch import load_file

    src = sub.provenance.get("source_model")
    if not src or not Path(src).is_file():
        need = "continual training" if cfg["mode"] == "continual" else "bn_stats 'deployed'"
        raise ValueError(f"{need} needs the pretrained model: subspace {cfg['subspace']['name']!r} "
                         f"has provenance source_model={src!r}, which is not a file")
    return load_file(src)


@torch.no_grad()
def _conversion_check(model: torch.nn.Module, test_loader, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Test accuracy of the pretrained model with the float and the fixed-point forward (eval-mode BN).

    ``fixed_test_acc`` is the configured ``hw.arithmetic`` / ``hw.reset``; ``arithmetics`` has
    both arithmetics with each LIF's own reset and with the standard Loihi LIF's hard reset.
    """
    from szo.hw import to_fixed
    from szo.hw.train import evaluate_fixed
    from szo.train import evaluate

    hw = cfg["hw"]
    _, acc_float = evaluate(model, test_loader, loss_for(cfg))
    runs = {}
    for arithmetic in ("szo", "loihi"):
        for reset in (None, "zero"):
            net = to_fixed(model, weight_bits=hw["weight_bits"], arithmetic=arithmetic, reset=reset)
            runs[f"{arithmetic}, reset={reset or 'own'}"] = {
                "test_acc": evaluate_fixed(net, test_loader), "overflows": net.counter.total()}
    chosen = runs[f"{hw['arithmetic']}, reset={hw['reset'] or 'own'}"]
    if hw["reset"] == "subtract":  # not among the four above
        net = to_fixed(model, weight_bits=hw["weight_bits"], arithmetic=hw["arithmetic"], reset="subtract")
        chosen = {"test_acc": evaluate_fixed(net, test_loader), "overflows": net.counter.total()}
    return {"float_test_acc": acc_float, "fixed_test_acc": chosen["test_acc"], "saturations": chosen["overflows"],
            "arithmetic": hw["arithmetic"], "reset": hw["reset"], "arithmetics": runs}


def _parallel(cfg: Mapping[str, Any]):
    """``szo.distributed.Parallel`` for this rank when the process group spans > 1 process, else None."""
    from szo import distributed as D

    if not D.get_info().enabled:
        if D.env_world_size() > 1:
            raise ValueError(f"launched by torchrun (WORLD_SIZE={D.env_world_size()}) but torch.distributed is not "
                             "initialised; run `szo recipe` (the CLI sets it up) or wrap the call in "
                             "szo.distributed.launch()")
        return None
    _check_distributed(cfg)
    dc = cfg["distributed"]
    return D.Parallel(mode=dc["mode"], sync_bn=dc["sync_bn"])


def _check_distributed(cfg: Mapping[str, Any]) -> None:
    """Everything a multi-process run does not support, checked before any work starts."""
    if cfg["distributed"]["mode"] not in get_method(cfg["method"]).parallel:
        raise ValueError(f"method {cfg['method']!r} does not run on several processes; multi-process (torchrun) "
                         f"runs support: {', '.join(list_methods(parallel=cfg['distributed']['mode']))} "
                         "(or run it in one process)")
    sz = cfg["szo"]
    for bad, what in ((sz["time_chunk"] is not None, "szo.time_chunk (streaming forward): leave it null"),
                      (sz["engine"] != "loop", "szo.engine 'batched': use 'loop'"),
                      (cfg["hw"]["learner"] == "integer", "hw.learner 'integer': use 'float'"),
                      # a compiled graph does not see forward hooks added after it was traced, and
                      # synchronised BN all-reduces the batch statistics from such hooks
                      (cfg["compile"] is not False and cfg["distributed"]["mode"] == "data"
                       and cfg["distributed"]["sync_bn"],
                       "compile with distributed.mode 'data' and distributed.sync_bn: set compile=false, "
                       "distributed.sync_bn=false or distributed.mode=perturbation")):
        if bad:
            raise ValueError(f"multi-process (torchrun) runs do not support {what}, or run in one process")


def run_subspace_stage(cfg: Mapping[str, Any], run_dir: str | os.PathLike, *, device: str = "cpu",
                       resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train ``cfg.method`` in the stored subspace (see :func:`_subspace_stage`), holding the run
    directory's lock; a resume first checks the config against the directory's config.yaml.
    ``callbacks``: extra ``szo.train.Callback`` objects for the training loop."""
    par = _parallel(cfg)
    with run_dir_guard(run_dir, cfg, resume=resume, stage="subspace"):
        return _subspace_stage(cfg, run_dir, device=device, resume=resume, par=par, callbacks=callbacks)


def optimizer_options(cfg: Mapping[str, Any]) -> OptimizerOptions:
    """The :class:`szo.optim.OptimizerOptions` a resolved subspace-recipe config sets (``train`` /
    ``szo`` / ``tt`` / ``hw`` sections), for the subspace stage and for tools that build the same
    optimizer outside a run (``bench/methods.py``)."""
    tr, sz, tt, hw = cfg["train"], cfg["szo"], cfg["tt"], cfg["hw"]
    integer = None
    if hw["learner"] == "integer":  # the on-chip learner's state widths, its XORShift32 seed from the run's
        integer = IntegerLearnerOptions(basis_bits=hw["basis_bits"] or 16, coord_bits=hw["coord_bits"],
                                        coord_frac=hw["coord_frac"], ref_bits=hw["ref_bits"],
                                        seed=int(cfg["seed"]) % 0xFFFFFFFF + 1)
    return OptimizerOptions(
        lr=tr["lr"], momentum=tr["momentum"], weight_decay=tr["weight_decay"], mu=sz["mu"], q=sz["q"],
        coords_per_step=sz["coords_per_step"], engine=sz["engine"], chunk=sz["chunk"], bn_update=sz["bn_update"],
        layers=None if sz["layers"] is None else tuple(sz["layers"]), stages=sz["stages"],
        tt=TTOptions(**{k: tt[k] for k in ("sign_lr", "sign_q", "sign_mu", "window", "tol", "switch_step")}),
        integer=integer)


def _subspace_stage(cfg: Mapping[str, Any], run_dir: str | os.PathLike, *, device: str, resume: bool,
                    par: Any, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train ``cfg.method`` in the stored subspace ``cfg.subspace.name`` (scratch or continual);
    on every rank of a multi-process run (only rank 0 writes ``run_dir``).

    ``backend: fixed`` trains through the Loihi-style integer forward (``szo.hw.to_fixed``, same
    parameters): the pretrained model is first evaluated with both forwards, the basis is stored
    at ``hw.basis_bits`` (per-column scale), and ``hw.learner: integer`` replaces the float
    coordinate state by :class:`szo.hw.train.OnChipSZO` (integer c / momentum; ``szo-rge`` then
    draws seed-004 Rademacher directions from XORShift32).
    """
    from szo.train import fit

    run_dir = Path(run_dir)
    if par is None or par.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(cfg, run_dir / "config.yaml")
    g = torch.Generator().manual_seed(int(cfg["seed"]))
    train, test = loaders_for(cfg, g, par)
    model = build_model(cfg)
    sub = subspace_store_for(cfg).load(cfg["subspace"]["name"], model=model)
    extra: dict[str, Any] = {"backend": cfg["backend"], "bn_stats": cfg["bn_stats"]}
    if cfg["mode"] == "continual" or cfg["bn_stats"] == "deployed":
        state = _source_state(cfg, sub)
        if cfg["mode"] == "continual":
            model.load_state_dict(state)
        else:  # scratch with deployed statistics: only the BN buffers of the pretrained model
            names = {n for n, _ in model.named_parameters()}
            model.load_state_dict({n: t for n, t in state.items() if n not in names}, strict=False)
        if cfg["backend"] == "fixed":
            model.load_state_dict(state)
            extra["conversion"] = _conversion_check(model, test, cfg)
    model.load_flat_params(sub.reference)
    net = model
    hw = cfg["hw"]
    if cfg["backend"] == "fixed":
        from szo.hw import to_fixed
        from szo.hw.train import basis_error, quantized_subspace

        net = to_fixed(model, weight_bits=hw["weight_bits"], arithmetic=hw["arithmetic"], reset=hw["reset"])
        extra["hw"] = dict(hw)
        if hw["basis_bits"] is not None:
            if hw["learner"] == "float":
                sub = quantized_subspace(sub, hw["basis_bits"])  # records its error in the provenance
                extra["basis_rel_error"] = sub.provenance["basis_quantization"]["rel_frobenius_error"]
            else:  # OnChipSZO quantises the basis itself
                extra["basis_rel_error"] = basis_error(sub.basis, hw["basis_bits"])
    tt = cfg["tt"]
    if get_method(cfg["method"]).family == "tensor-train-zo":  # the large weights become TT cores (TT-SVD of the start)
        from szo.models.tt import tt_parametrize

        extra["tt"] = tt_parametrize(net, tt["rank"], cores=tt["cores"], min_params=tt["min_params"])
    net.to(device)
    _set_compile(model, cfg)
    tr, sz = cfg["train"], cfg["szo"]
    # forward-only methods: probes and evaluation run the streaming forward if asked for
    model.set_streaming(sz["time_chunk"], sz["stream_bn"])
    run = RunOptions(generator=g, distributed=par.mode if par is not None else None,
                     sync_bn=par.sync_bn if par is not None else True,
                     start="current")  # already at sub.reference (loaded above)
    opt = build_optimizer(cfg["method"], net, subspace=sub, options=optimizer_options(cfg), run=run)
    info = _info(cfg, cfg["method"], cfg["mode"], model)
    info.update(subspace=cfg["subspace"]["name"], k=sub.k, **extra)
    report = ResultFields(lambda: _late_results(net, opt, extra))
    return fit(net, train, test, opt, epochs=tr["epochs"], loss_fn=loss_for(cfg), scheduler=_scheduler(opt, tr),
               device=device, run_dir=run_dir, generator=g, resume=resume, eval_every=tr["eval_every"],
               progress=cfg["progress"], max_steps_per_epoch=tr["max_steps_per_epoch"],
               checkpoint_every_steps=tr["checkpoint_every_steps"], info=info, bn_stats=cfg["bn_stats"],
               parallel=par, callbacks=[report, *callbacks])


def _late_results(net: torch.nn.Module, opt: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """What is known only after training: every clamp of the integer forwards (backend fixed) and
    when a tensor-train run left signRGE for CGE (``HybridZO.hybrid_state``)."""
    out: dict[str, Any] = {}
    if isinstance(net, FixedPointNetwork):
        out.update(saturations=net.saturation_counts(), saturations_total=net.counter.total())
    if isinstance(opt, HybridZO):
        out["tt"] = dict(extra.get("tt", {}), switched_at_step=opt.hybrid_state["switched_at"])
    return out


def run_recipe(cfg: Mapping[str, Any], out_dir: str | os.PathLike, device: str | None = None,
               resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run a resolved recipe config (``szo.config.load_recipe``); returns the last stage's summary.
    ``callbacks``: extra ``szo.train.Callback`` objects for the subspace stage's training loop."""
    from szo import distributed as D

    dev = _device(cfg, device)
    out = Path(out_dir)
    with run_dir_guard(out, cfg, resume=resume):
        if D.env_world_size() > 1 or D.get_info().enabled:
            return _run_recipe_distributed(cfg, out, dev, resume, callbacks)
        return _run_recipe(cfg, out, dev, resume, callbacks)


def _run_recipe(cfg: Mapping[str, Any], out: Path, dev: str, resume: bool,
                callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    if cfg["kind"] == "tta":
        from szo.adapt.cli import run_recipe as run_tta_recipe  # noqa: PLC0415 (adapt builds on the stages here)

        return run_tta_recipe(cfg, out, device=dev)
    if cfg["kind"] == "bp":
        return run_bptt_stage(cfg, out, device=dev, resume=resume)
    store = subspace_store_for(cfg)
    if not store.exists(cfg["subspace"]["name"]):
        check_store_entry(cfg)
        run_bptt_stage(cfg, out / "bptt", device=dev, resume=resume)
    return run_subspace_stage(cfg, out, device=dev, resume=resume, callbacks=callbacks)


def _run_recipe_distributed(cfg: Mapping[str, Any], out: Path, dev: str, resume: bool,
                            callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """One rank's part of a torchrun run: a subspace recipe whose subspace is already stored."""
    from szo import distributed as D

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
    return run_subspace_stage(cfg, out, device=dev, resume=resume, callbacks=callbacks)


def run_demo_digits(out_dir: str | os.PathLike = "runs/demo", *, device: str = "cpu", full_space: bool = True,
                    progress: bool = True) -> dict[str, Any]:
    """The digits quickstart (``make demo``): BPTT with trajectory -> k=20 subspace -> BP-Subspace,
    SZO-CGE, SZO-RGE(q=1), SZO-RGE(q=k/2) from scratch, a continual SZO-CGE run in a last-epochs
    subspace, optionally full-space ZO-CGE (SNN and its ReLU ANN twin, same 2k forwards per step),
    then the Table 1/3-style report. Re-running continues: finished runs are kept, interrupted
    ones resume from their checkpoints. Returns {run name: summary}."""
    import json
    import time

    from szo.config import load_recipe
    from szo.report import collect_runs, render, write_report

    out = Path(out_dir)
    base = [f"subspace.root={(out / 'subspaces').resolve()}", f"progress={str(progress).lower()}", f"device={device}"]
    t0 = time.perf_counter()
    summaries: dict[str, Any] = {}

    def stage(name: str, fn) -> None:
        res = out / name / "results.json"
        if res.is_file():
            summaries[name] = json.loads(res.read_text(encoding="utf-8"))
            if summaries[name].get("status") == "diverged":  # the same settings would diverge again
                from szo.train import TrainingDiverged

                raise TrainingDiverged(f"demo stage {name} diverged in an earlier run ({summaries[name].get('error')}); "
                                       f"remove {out / name} to run it again")
            print(f"[demo] {name}: already done ({res})")
            return
        print(f"[demo] {name} ...", flush=True)
        summaries[name] = fn(out / name)
        s = summaries[name]
        print(f"[demo] {name}: max test acc {100 * s['best_test_acc']:.2f}% (epoch {s['converged_epoch']}), "
              f"#FP {s['fp']}, #BP {s['bp']}, {time.perf_counter() - t0:.0f} s elapsed", flush=True)

    bp_cfg = load_recipe("digits-bp", base)
    stage("bp", lambda d: run_recipe(bp_cfg, d, device=device, resume=True))
    k = int(bp_cfg["subspace"]["k"])
    # RGE with q = k/2 directions is ~k/q times less noisy than q = 1: a larger step (lr 0.3)
    # and the CGE epoch count; q = 1 takes the recipe's method_defaults (lr 0.02, 60 epochs).
    runs = [("bp-subspace", ["method=bp-subspace"]), ("szo-cge", ["method=szo-cge"]),
            ("szo-rge-q1", ["method=szo-rge", "szo.q=1"]),
            (f"szo-rge-q{k // 2}", ["method=szo-rge", f"szo.q={k // 2}", "train.lr=0.3", "train.epochs=20"])]
    if full_space:
        runs += [("zo-cge", ["method=zo-cge"]), ("zo-cge-ann", ["method=zo-cge", "model.activation=relu"])]
    for name, sets in runs:
        cfg = load_recipe("digits-scratch", base + sets)
        stage(name, lambda d, cfg=cfg: run_subspace_stage(cfg, d, device=device, resume=True))
    cont = load_recipe("digits-continual", base)
    if not subspace_store_for(cont).exists(cont["subspace"]["name"]):
        build_store_subspace(cont, out / "bp", progress=progress)  # the same BPTT run, last-epochs window
    stage("continual-szo-cge", lambda d: run_subspace_stage(cont, d, device=device, resume=True))
    runs_found = collect_runs([out / n for n in summaries])
    md = render(runs_found)
    write_report(runs_found, out)
    print(md)
    print(f"[demo] done in {time.perf_counter() - t0:.0f} s; report: {out / 'report.md'}, plot: {out / 'accuracy.png'}")
    return summaries
