"""One training loop for every method: ``loss = optimizer.step(closure)``.

* Forward-only optimizers (``optimizer.forward_only is True``: SZO-CGE/RGE, full-space ZO)
  get a closure that runs a no-grad forward on the current batch and returns the loss; the
  optimizer calls it once per probe and counts the calls in ``optimizer.forward_passes``.
* Every other optimizer (``torch.optim.SGD`` for BP, ``BPSubspace``) gets a closure that
  does ``zero_grad``, forward, ``backward`` and returns the loss: 1 FP + 1 BP per step.

Train loss / accuracy of a step come from its unperturbed forward when it has one: the
forward-only optimizers' BN forward of theta_{t+1} (``bn_update="recompute"``, the default,
with BN in train mode; ``optimizer.last_outputs_unperturbed``), and for BP the step's own
forward. Otherwise (``bn_update="probe-mean"``, or no train-mode BN) they are averaged over
the step's perturbed probes (the batched engine returns no outputs: no train accuracy then).

Resume semantics (``resume=True``): the run continues from ``run_dir/checkpoints/last.pt``,
written at every epoch end and every ``checkpoint_every_steps`` steps. A mid-epoch
checkpoint stores the generator state at the start of that epoch and the generator state
after its last completed step. On resume the epoch's batch order is redrawn from the
epoch-start state (the same permutation as before), the already-completed batches are
skipped without being loaded, and the generator is set to the post-step state, so that RGE
directions and later epochs see the same random numbers. A resumed run therefore
reproduces the uninterrupted run exactly (same data order, same directions, same
parameters). The loader must shuffle with the run generator passed to ``fit``.

Multi-process runs (``parallel=szo.distributed.Parallel(...)``, forward-only optimizers
built with the same ``distributed`` mode): every rank draws the same global batch order from
the same generator; in data mode each rank loads only its contiguous shard of every batch
(``Parallel.shard``) and the closure weights its shard loss by ``W * n_shard / n_batch``, so
the all-reduced mean of the shard losses is the loss of the whole batch (all losses here are
batch means). Rank 0 decides about resuming and broadcasts its checkpoint's bytes, every rank
loads them (and the parameters are broadcast once), so mid-epoch resume stays exact. Train
accuracy counts and the (sharded) evaluation sums are all-reduced at checkpoints and epoch
ends; in perturbation mode the train accuracy averages each rank's own probes. Only rank 0
writes metrics.jsonl, checkpoints, results.json and the plot, and shows progress.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm

from szo.distributed import main_decides
from szo.functional.zo import NonFiniteLossError
from szo.io import atomic_write_json
from szo.plots import plot_training_curve
from szo.train.callbacks import Callback, MetricsLogger
from szo.train.checkpoint import checkpoint_from_bytes, checkpoint_path, read_checkpoint_bytes, save_checkpoint
from szo.zo import HasSubspace, bn_layers, is_forward_only

__all__ = ["fit", "evaluate", "evaluate_sums", "TrainingDiverged", "DIVERGE_FACTOR"]

DIVERGE_FACTOR = 1.0e4
"""A run has diverged when a step's training loss exceeds this many times ``max(|first loss|, 1)``
(the first step's loss of the run), or the loss or a parameter is not finite."""


class TrainingDiverged(ValueError):
    """Training diverged (non-finite or exploding loss, non-finite parameters); results.json
    of the run says ``"status": "diverged"``."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _epoch_loader(loader: DataLoader, batches: Sequence[list[int]], generator: torch.Generator) -> DataLoader:
    """A DataLoader over an explicit list of index batches, with ``loader``'s data settings."""
    kw: dict[str, Any] = dict(
        batch_sampler=batches,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        generator=generator,
    )
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
        kw["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(loader.dataset, **kw)


@torch.no_grad()
def evaluate_sums(model: nn.Module, loader: Iterable, loss_fn: LossFn, device: str | torch.device = "cpu",
                   progress: bool = False) -> tuple[float, int, int]:
    """(sum of per-sample losses, correct, samples) of ``model`` in eval mode over ``loader``."""
    was_training = model.training
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    try:
        for x, y in tqdm(loader, desc="eval", leave=False, disable=not progress):
            x, y = x.to(device), y.to(device)
            out = model(x)
            n = y.shape[0]
            loss_sum += float(loss_fn(out, y)) * n
            correct += int((out.mean(0).argmax(1) == y).sum())
            seen += n
    finally:
        model.train(was_training)
    return loss_sum, correct, seen


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, loss_fn: LossFn, device: str | torch.device = "cpu",
             progress: bool = False) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` in eval mode over ``loader``."""
    loss_sum, correct, seen = evaluate_sums(model, loader, loss_fn, device, progress)
    if seen == 0:
        raise ValueError("the test loader yielded no samples")
    return loss_sum / seen, correct / seen


def fit(
    model: nn.Module,
    train_loader: DataLoader,
    test_loader: Iterable | None,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    loss_fn: LossFn,
    scheduler: Any = None,
    device: str | torch.device = "cpu",
    run_dir: str | os.PathLike,
    callbacks: Sequence[Callback] = (),
    generator: torch.Generator,
    resume: bool = False,
    start_epoch: int = 0,
    eval_every: int = 1,
    progress: bool = True,
    max_steps_per_epoch: int | None = None,
    checkpoint_every_steps: int | None = None,
    info: dict[str, Any] | None = None,
    plot: bool = True,
    bn_stats: str = "batch",
    parallel: Any = None,
    diverge_factor: float | None = DIVERGE_FACTOR,
) -> dict[str, Any]:
    """Train ``model`` for ``epochs`` epochs (total, counted from 0) and return the summary.

    Writes to ``run_dir``: metrics.jsonl (one line per epoch), checkpoints/last.pt,
    results.json (the summary) and training_curve.png. ``scheduler`` is stepped once per
    epoch. ``start_epoch`` numbers the first epoch of a fresh run (ignored on resume).
    ``info`` (e.g. method, recipe, k) is merged into the summary. ``bn_stats="deployed"``
    keeps every BatchNorm layer in eval mode while training (normalise with the running
    statistics, never update them: the BN of a chip that folds it into the weights);
    ``"batch"`` is ordinary train-mode BN. ``parallel`` (``szo.distributed.Parallel``) runs
    this rank's part of a multi-process run (see the module docstring); the test loader
    should then hold this rank's shard of the test set.

    Divergence (a non-finite loss or parameter, or a loss above ``diverge_factor`` times
    ``max(|first loss|, 1)``; ``None`` checks finiteness only) stops the run with one
    :class:`TrainingDiverged` line naming the step, after writing results.json with
    ``"status": "diverged"``. A resumed run refuses a checkpoint written by another method or
    optimizer class, and says where it continues.
    """
    if bn_stats not in ("batch", "deployed"):
        raise ValueError(f"unknown bn_stats {bn_stats!r}; valid: batch, deployed")
    _positive_int("epochs", epochs)
    _positive_int("eval_every", eval_every)
    _positive_int("max_steps_per_epoch", max_steps_per_epoch, allow_none=True)
    _positive_int("checkpoint_every_steps", checkpoint_every_steps, allow_none=True)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(train_loader, DataLoader):
        raise ValueError(f"train_loader must be a torch DataLoader, got {type(train_loader).__name__}")
    if isinstance(train_loader.sampler, RandomSampler) and train_loader.sampler.generator is not generator:
        raise ValueError("train_loader must shuffle with the run generator passed to fit "
                         "(make_loader(..., shuffle=True, generator=generator)) so runs are reproducible")
    if isinstance(start_epoch, bool) or not isinstance(start_epoch, int) or not 0 <= start_epoch < epochs:
        raise ValueError(f"start_epoch must be an int in [0, epochs), got {start_epoch!r}")
    forward_only = is_forward_only(optimizer)
    par = parallel if parallel is not None and parallel.enabled else None
    main = par is None or par.is_main
    if par is not None:
        if not forward_only or optimizer.distributed != par.mode:
            raise ValueError(f"a multi-process run needs a forward-only optimizer built with "
                             f"distributed={par.mode!r} (szo.optim.build_optimizer(..., distributed=...))")
        par.check_batches(int(train_loader.batch_size or 0) or len(next(iter(train_loader.batch_sampler))),
                          len(train_loader.dataset), max_steps_per_epoch)  # type: ignore[arg-type]
        progress = progress and main
    shard = par is not None and par.shards_batches
    # accuracy denominator: in perturbation mode every rank counts the whole batch for its probes
    acc_ranks = par.world_size if par is not None and not par.shards_batches else 1

    run_dir = Path(run_dir)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = checkpoint_path(run_dir)
    logger = MetricsLogger(run_dir / "metrics.jsonl") if main else None
    model.to(device)

    # ---------------------------------------------------------------- state
    history: list[dict[str, Any]] = []
    epoch, step, fp, bp = start_epoch, 0, 0, 0
    train_time, wall_time = 0.0, 0.0
    mid: dict[str, Any] | None = None
    resumed = False
    method = (info or {}).get("method")
    opt_kind = type(optimizer).__name__
    first_loss: float | None = None
    st, ckpt_sha = _load_start_state(ckpt_path, run_dir, resume, par)
    if st is not None:
        _check_checkpoint_kind(st, ckpt_path, method, opt_kind)
        model.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        if scheduler is not None and st.get("scheduler") is not None:
            scheduler.load_state_dict(st["scheduler"])
        generator.set_state(st["generator"])
        epoch, step, fp, bp = int(st["epoch"]), int(st["step"]), int(st["fp"]), int(st["bp"])
        train_time, wall_time = float(st["train_time_s"]), float(st["wall_time_s"])
        history = list(st["history"])
        mid = st.get("in_epoch")
        first_loss = st.get("first_loss")
        resumed = True
        if main:
            n_steps = len(train_loader.batch_sampler)  # type: ignore[arg-type]
            if max_steps_per_epoch is not None:
                n_steps = min(n_steps, max_steps_per_epoch)
            into = f", {int(mid['batches_done'])} of its {n_steps} steps done" if mid is not None else ""
            where = (f"epoch {epoch + 1} of {epochs}{into}" if epoch < epochs
                     else f"all {epochs} epochs were done already")
            print(f"resuming {run_dir} after step {step}: {where}{f' (method {method})' if method else ''}", flush=True)
    if par is not None:
        par.broadcast_model(model)  # once; afterwards identical updates keep the ranks in sync
    if logger is not None:
        logger.reset(history)

    def checkpoint(in_epoch: dict[str, Any] | None) -> None:
        nonlocal ckpt_sha
        if not main:
            return
        ckpt_sha = save_checkpoint(ckpt_path, {
            "method": method, "optimizer_class": opt_kind, "first_loss": first_loss,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "generator": generator.get_state(),
            "epoch": epoch, "step": step, "fp": fp, "bp": bp,
            "train_time_s": train_time, "wall_time_s": wall_time + (time.perf_counter() - t_wall0),
            "history": history, "in_epoch": in_epoch,
        }, previous_sha256=ckpt_sha)

    cbs: list[Callback] = ([logger] if logger is not None else []) + list(callbacks)
    for cb in cbs:
        cb.on_train_start(epoch=epoch, step=step, resumed=resumed)

    t_wall0 = time.perf_counter()
    x_cur: dict[str, Any] = {"scale": 1.0}
    acc_buf: dict[str, Any] = {}

    def _record(out: torch.Tensor) -> None:
        m = out.detach().mean(0)
        acc_buf["sum"] = m if acc_buf.get("sum") is None else acc_buf["sum"] + m
        acc_buf["last"] = m

    def closure() -> torch.Tensor:
        x, y = x_cur["x"], x_cur["y"]
        if forward_only:
            with torch.no_grad():
                out = model(x)
                loss = loss_fn(out, y)
                if x_cur["scale"] != 1.0:  # unequal shards: the mean over ranks = the batch mean
                    loss = loss * x_cur["scale"]
        else:
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
        _record(out)
        return loss

    def accuracy_known() -> bool:
        """The batched engine returns probe losses only (no outputs): train accuracy only from
        the unperturbed BN forward then (``bn_update="recompute"`` with train-mode BN)."""
        return not forward_only or optimizer.train_outputs

    acc_known = accuracy_known()
    correct_local = 0  # this rank's correct predictions since the last reduction

    def reduce_correct() -> float:
        """All ranks' correct count since the last call (a collective: every rank calls it)."""
        nonlocal correct_local
        got = par.sum_([correct_local])[0] / acc_ranks if par is not None else correct_local
        correct_local = 0
        return got

    def diverged(why: str) -> None:
        """Close the progress bar (the error gets its own line), mark results.json, stop."""
        bar.close()
        if progress and not sys.stderr.isatty():  # a log file keeps the bar's text: end its line
            sys.stderr.write("\n")
            sys.stderr.flush()
        msg = (f"training diverged at step {step + 1} (epoch {epoch + 1} of {epochs}"
               f"{f', method {method}' if method else ''}): {why}; lower the learning rate"
               + (" (train.lr) or the perturbation scale (szo.mu)" if forward_only else ""))
        if main:
            summary = summarize(history, model=model, optimizer=optimizer, info=info)
            summary.update(status="diverged", error=msg, diverged_step=step + 1)
            atomic_write_json(run_dir / "results.json", summary)
        raise TrainingDiverged(msg)

    # ---------------------------------------------------------------- loop
    while epoch < epochs:
        if mid is not None:
            generator.set_state(mid["generator_epoch_start"])
        gen_epoch_start = generator.get_state()
        batches = list(train_loader.batch_sampler)
        if max_steps_per_epoch is not None:
            batches = batches[:max_steps_per_epoch]
        if not batches:
            raise ValueError("the train loader yields no batches (dataset smaller than batch_size with drop_last?)")
        done = int(mid["batches_done"]) if mid is not None else 0
        loss_sum = float(mid["loss_sum"]) if mid is not None else 0.0
        correct = float(mid["correct"]) if mid is not None else 0.0  # all ranks' count (reduced)
        seen = int(mid["seen"]) if mid is not None else 0
        epoch_train_time = float(mid["epoch_train_time_s"]) if mid is not None else 0.0
        todo = batches[done:]
        it = iter(_epoch_loader(train_loader, [par.shard(b) for b in todo] if shard else todo, generator))
        if mid is not None:
            generator.set_state(mid["generator"])
        mid = None
        lr = float(optimizer.param_groups[0]["lr"])
        model.train()
        if bn_stats == "deployed":
            for m in bn_layers(model):
                m.eval()
        acc_known = accuracy_known()
        bar = tqdm(total=len(batches), initial=done, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                   disable=not progress, dynamic_ncols=True)
        t_last = time.perf_counter()
        for (x, y), global_batch in zip(it, todo):
            n = len(global_batch)  # samples of the global batch (this rank may hold a shard)
            x_cur["x"], x_cur["y"] = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            closure.batch = (x_cur["x"], x_cur["y"], loss_fn)  # type: ignore[attr-defined]  # batched engine
            x_cur["scale"] = par.world_size * int(y.shape[0]) / n if shard else 1.0
            acc_buf["sum"] = acc_buf["last"] = None
            try:
                loss_t = optimizer.step(closure)
            except NonFiniteLossError as e:  # a forward-only optimizer's probe
                diverged(str(e).split(";")[0].replace("returned a non-finite loss", "gave a non-finite loss"))
            done_step = optimizer.last_step if forward_only else None
            if done_step is not None:
                fp += done_step.forwards
            else:
                fp += 1
                bp += 1
            loss = float(loss_t.detach()) if isinstance(loss_t, torch.Tensor) else float(loss_t)
            if first_loss is None:  # the scale to compare later losses with: the loss before any update
                # the probes' loss at theta_t (bn_update=recompute returns theta_{t+1}'s)
                ref = done_step.reference_loss if done_step is not None else loss
                if math.isfinite(ref):
                    first_loss = ref
            why = _diverged(loss, model, first_loss, diverge_factor)
            if why is not None:
                diverged(why)
            loss_sum += loss * n
            # accuracy of the unperturbed forward when the step ran one, else of all its probes
            acc_out = acc_buf["last"] if done_step is not None and done_step.unperturbed else acc_buf["sum"]
            correct_local += int((acc_out.argmax(1) == x_cur["y"]).sum()) if acc_out is not None else 0
            seen += n
            step += 1
            done += 1
            dt = time.perf_counter() - t_last
            train_time += dt
            epoch_train_time += dt
            bar.update(1)
            if progress:
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}",
                                **({"acc": f"{(correct + correct_local) / seen:.3f}"} if acc_known else {}),
                                refresh=False)
            for cb in cbs:
                cb.on_step_end(step, epoch, loss)
            if checkpoint_every_steps is not None and step % checkpoint_every_steps == 0 and done < len(batches):
                correct += reduce_correct()  # every rank takes part, rank 0 writes
                checkpoint({
                    "generator_epoch_start": gen_epoch_start, "generator": generator.get_state(),
                    "batches_done": done, "loss_sum": loss_sum, "correct": correct, "seen": seen,
                    "epoch_train_time_s": epoch_train_time,
                })
            t_last = time.perf_counter()
        bar.close()
        correct += reduce_correct()
        if scheduler is not None:
            scheduler.step()
        epoch += 1
        test_loss = test_acc = None
        eval_time = 0.0
        if test_loader is not None and (epoch % eval_every == 0 or epoch == epochs):
            t0 = time.perf_counter()
            sums = evaluate_sums(model, test_loader, loss_fn, device)
            if par is not None:  # every rank evaluated its shard of the test set
                sums = par.sum_(sums)
            if sums[2] == 0:
                raise ValueError("the test loader yielded no samples")
            test_loss, test_acc = sums[0] / sums[2], sums[1] / sums[2]
            eval_time = time.perf_counter() - t0
        if par is not None:
            par.check_in_sync(model)
        record = {
            "epoch": epoch, "step": step,
            "train_loss": loss_sum / seen, "train_acc": correct / seen if acc_known else None,
            "test_loss": test_loss, "test_acc": test_acc, "lr": lr,
            "epoch_train_time_s": epoch_train_time, "eval_time_s": eval_time,
            "train_time_s": train_time, "wall_time_s": wall_time + (time.perf_counter() - t_wall0),
            "fp": fp, "bp": bp,
        }
        if par is not None:
            record.update(_comm_stats(optimizer.bytes_communicated, step))
        history.append(record)
        if progress:
            tqdm.write(f"epoch {epoch}/{epochs}: train loss {record['train_loss']:.4f}"
                       + (f" acc {record['train_acc']:.4f}" if acc_known else "")
                       + (f" | test acc {test_acc:.4f}" if test_acc is not None else "")
                       + f" | lr {lr:.4g} | #FP {fp} #BP {bp}")
        for cb in cbs:
            cb.on_epoch_end(epoch, step, record)
        checkpoint(None)

    wall_time += time.perf_counter() - t_wall0
    summary = summarize(history, model=model, optimizer=optimizer, info=info)
    summary["status"] = "completed"
    summary["wall_time_min"] = wall_time / 60.0
    if par is not None:
        summary["distributed"] = {**par.describe(), **_comm_stats(optimizer.bytes_communicated, step),
                                  "startup_bytes": par.startup_bytes}
    if not main:  # other ranks write nothing
        for cb in cbs:
            cb.on_train_end(summary)
        return summary
    atomic_write_json(run_dir / "results.json", summary)
    if plot:
        plot_training_curve(history, run_dir / "training_curve.png", title=str((info or {}).get("name", run_dir.name)))
    for cb in cbs:
        cb.on_train_end(summary)
    return summary


def _comm_stats(total: int, step: int) -> dict[str, Any]:
    """Bytes this rank's optimizer put into collectives so far (probe losses, BN statistics)."""
    return {"bytes_communicated": total, "bytes_per_step": total / step if step else 0.0}


def _load_start_state(ckpt_path: Path, run_dir: Path, resume: bool, par: Any
                      ) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint to continue from (checked against its sha256 record) and its sha256, or
    (None, None) for a fresh start. Multi-process: rank 0 looks at its run directory and
    broadcasts the verified file's bytes (or its one-line error); every rank loads them."""
    def read() -> bytes | None:
        if not ckpt_path.exists():
            return None
        if not resume:
            raise ValueError(f"{run_dir} already holds a checkpoint ({ckpt_path}); "
                             f"pass resume=True (--resume) or use another run directory")
        return read_checkpoint_bytes(ckpt_path)[0]

    blob = main_decides(read, par.group) if par is not None else read()
    if blob is None:
        return None, None
    if par is not None:
        par.startup_bytes += len(blob) + 17  # header + tag + the checkpoint's bytes
    return checkpoint_from_bytes(blob, ckpt_path), hashlib.sha256(blob).hexdigest()


def _check_checkpoint_kind(st: dict[str, Any], where: Path, method: str | None, opt_kind: str) -> None:
    """Refuse a checkpoint written by another method or optimizer class (e.g. a BPTT last.pt
    copied into an SZO run)."""
    for what, got, want in (("method", st.get("method"), method), ("optimizer", st.get("optimizer_class"), opt_kind)):
        if got is not None and want is not None and got != want:
            raise ValueError(f"checkpoint {where} was written by {what} {got!r}, this run trains with {want!r}: "
                             "a run resumes only its own checkpoint; use another run directory")


def _diverged(loss: float, model: nn.Module, first_loss: float | None, factor: float | None) -> str | None:
    """Why the run counts as diverged after this step, or None."""
    if not math.isfinite(loss):
        return f"the training loss is {loss}"
    if factor is not None and first_loss is not None and abs(loss) > factor * max(abs(first_loss), 1.0):
        return (f"the training loss {loss:.4g} is more than {factor:g} times the first step's "
                f"({first_loss:.4g})")
    params = [p for p in model.parameters() if p.is_floating_point()]
    if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):  # one sync
        bad = next(n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all())
        return f"parameter {bad} is not finite"
    return None


def summarize(history: Sequence[dict[str, Any]], *, model: nn.Module | None = None,
              optimizer: Any = None, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """results.json: best / final test accuracy, converged epoch (= epoch of the best test
    accuracy, paper Table 3) with its training time and #FP / #BP, totals, d and k."""
    evals = [r for r in history if r.get("test_acc") is not None]
    best = max(evals, key=lambda r: r["test_acc"]) if evals else None  # first epoch reaching the max
    last = history[-1] if history else {}
    out: dict[str, Any] = {
        "epochs": last.get("epoch", 0), "steps": last.get("step", 0),
        "best_test_acc": best["test_acc"] if best else None,
        "final_test_acc": evals[-1]["test_acc"] if evals else None,
        "converged_epoch": best["epoch"] if best else None,
        "converged_time_min": best["train_time_s"] / 60.0 if best else None,
        "converged_fp": best["fp"] if best else None,
        "converged_bp": best["bp"] if best else None,
        "fp": last.get("fp", 0), "bp": last.get("bp", 0),
        "train_time_min": last.get("train_time_s", 0.0) / 60.0,
    }
    if model is not None:
        out["d"] = int(sum(p.numel() for p in model.parameters()))
    k = optimizer.k if isinstance(optimizer, HasSubspace) else None
    out["k"] = int(k) if isinstance(k, int) else None
    out.update(info or {})
    return out
