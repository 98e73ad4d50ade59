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

import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm

from szo.distributed import main_decides
from szo.exits import TrainingDiverged
from szo.functional.zo import NonFiniteLossError
from szo.io import atomic_write_json
from szo.methods import current_name
from szo.plots import plot_training_curve
from szo.precision import check_precision, precision_policy
from szo.threads import ThreadChoice, check_threads, choose_threads, fit_workload
from szo.train.callbacks import Callback, MetricsLogger
from szo.train.checkpoint import checkpoint_from_bytes, checkpoint_path, read_checkpoint_bytes, save_checkpoint
from szo.zo import Batch, HasSubspace, bn_layers, is_forward_only

__all__ = ["fit", "FitOptions", "Trainer", "RunState", "StepStrategy", "evaluate", "evaluate_sums", "TrainingDiverged",
           "DIVERGE_FACTOR"]

DIVERGE_FACTOR = 1.0e4
"""A run has diverged when a step's training loss exceeds this many times ``max(|first loss|, 1)``
(the first step's loss of the run), or the loss or a parameter is not finite."""


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
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


@dataclass
class FitOptions:
    """What ``fit`` is told besides the model, loaders and optimizer (see :func:`fit`)."""

    epochs: int
    loss_fn: LossFn
    run_dir: str | os.PathLike
    generator: torch.Generator
    scheduler: Any = None
    device: str | torch.device = "cpu"
    callbacks: Sequence[Callback] = ()
    resume: bool = False
    start_epoch: int = 0
    eval_every: int = 1
    progress: bool = True
    max_steps_per_epoch: int | None = None
    checkpoint_every_steps: int | None = None
    info: dict[str, Any] | None = None
    plot: bool = True
    bn_stats: str = "batch"
    parallel: Any = None
    diverge_factor: float | None = DIVERGE_FACTOR
    pins: Mapping[str, Any] | None = None
    check_pins: Callable[[Mapping[str, Any]], None] | None = None
    precision: str = "auto"
    threads: Any = "auto"
    log_prefix: str = ""

    def check(self, train_loader: Any) -> None:
        """One ValueError for a bad setting, before anything runs."""
        check_precision(self.precision)
        check_threads(self.threads)
        if not isinstance(self.log_prefix, str):
            raise ValueError(f"log_prefix must be a str (the prefix of the progress lines), got {self.log_prefix!r}")
        if self.bn_stats not in ("batch", "deployed"):
            raise ValueError(f"unknown bn_stats {self.bn_stats!r}; valid: batch, deployed")
        positive_int("epochs", self.epochs)
        positive_int("eval_every", self.eval_every)
        positive_int("max_steps_per_epoch", self.max_steps_per_epoch, allow_none=True)
        positive_int("checkpoint_every_steps", self.checkpoint_every_steps, allow_none=True)
        if not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(self.generator).__name__}")
        if not isinstance(train_loader, DataLoader):
            raise ValueError(f"train_loader must be a torch DataLoader, got {type(train_loader).__name__}")
        if isinstance(train_loader.sampler, RandomSampler) and train_loader.sampler.generator is not self.generator:
            raise ValueError("train_loader must shuffle with the run generator passed to fit "
                             "(make_loader(..., shuffle=True, generator=generator)) so runs are reproducible")
        s = self.start_epoch
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.epochs:
            raise ValueError(f"start_epoch must be an int in [0, epochs), got {s!r}")


@dataclass
class RunState:
    """Where a run stands (what a checkpoint restores): epochs / steps done, forwards and
    backwards counted, times, the metrics history, a mid-epoch position, the first step's loss."""

    epoch: int = 0
    step: int = 0
    fp: int = 0
    bp: int = 0
    train_time: float = 0.0
    wall_time: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    mid: dict[str, Any] | None = None
    first_loss: float | None = None

    @classmethod
    def from_checkpoint(cls, st: Mapping[str, Any]) -> "RunState":
        return cls(epoch=int(st["epoch"]), step=int(st["step"]), fp=int(st["fp"]), bp=int(st["bp"]),
                   train_time=float(st["train_time_s"]), wall_time=float(st["wall_time_s"]),
                   history=list(st["history"]), mid=st.get("in_epoch"), first_loss=st.get("first_loss"))


def _check_per_sample_loss(loss_fn: LossFn) -> None:
    """An optimizer that asks for one loss per sample (``loss_reduction == "none"``) needs a loss
    function that takes ``reduction="none"``: one line now, not a TypeError at the first probe."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no readable signature (a builtin): its first call will say
        return
    if not any(p.name == "reduction" or p.kind is p.VAR_KEYWORD for p in params):
        raise ValueError("this optimizer needs one loss per sample (per-sample node perturbation, seed 004 "
                         "Algorithm 1): the loss function must take reduction='none' (szo.losses do), or use the "
                         "batch-mean form (LayerwiseZO(..., per_sample=False))")


class StepStrategy:
    """How one optimizer step runs and is counted: the closure the optimizer gets, the forwards
    and backwards it cost, the loss before the update, which outputs give the train accuracy."""

    def __init__(self, model: nn.Module, optimizer: Any, loss_fn: LossFn):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.forward_only = is_forward_only(optimizer)
        self.per_sample = self.forward_only and optimizer.loss_reduction == "none"
        if self.per_sample:
            _check_per_sample_loss(loss_fn)
        self._outs: list[torch.Tensor] = []  # the mean-over-T outputs of this step's closure calls

    @property
    def accuracy_known(self) -> bool:
        """The batched engine returns probe losses only (no outputs): train accuracy only from
        the unperturbed BN forward then (``bn_update="recompute"`` with train-mode BN)."""
        return not self.forward_only or self.optimizer.train_outputs

    def closure(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
        """The step's closure; ``scale`` != 1: a shard's share of the batch loss (data-parallel)."""
        model, loss_fn, opt, outs = self.model, self.loss_fn, self.optimizer, self._outs
        outs.clear()
        kw = {"reduction": "none"} if self.per_sample else {}

        def closure() -> torch.Tensor:
            if self.forward_only:
                with torch.no_grad():
                    out = model(x)
                    loss = loss_fn(out, y, **kw)
                    if scale != 1.0:  # unequal shards: the mean over ranks = the batch mean
                        loss = loss * scale
            else:
                opt.zero_grad(set_to_none=True)
                out = model(x)
                loss = loss_fn(out, y)
                loss.backward()
            outs.append(out.detach().mean(0))
            return loss

        return closure

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> Any:
        """One optimizer step on ``(x, y)``: a forward-only optimizer gets the closure and, explicitly,
        the batch (``szo.zo.Batch``: what the batched engine folds its probes over)."""
        closure = self.closure(x, y, scale)
        if self.forward_only:
            return self.optimizer.step(closure, batch=Batch(x, y, self.loss_fn))
        return self.optimizer.step(closure)

    def counts(self) -> tuple[int, int]:
        """(forwards, backwards) of the step just taken."""
        info = self.optimizer.last_step if self.forward_only else None
        return (info.forwards, 0) if info is not None else (1, 1)

    def reference_loss(self, loss: float) -> float:
        """The loss before the update (a forward-only step's probes at theta_t; ``bn_update=recompute``
        returns theta_{t+1}'s)."""
        info = self.optimizer.last_step if self.forward_only else None
        return info.reference_loss if info is not None else loss

    def accuracy_outputs(self) -> torch.Tensor | None:
        """The unperturbed forward's outputs when the step ran one, else the sum over its probes."""
        if not self._outs:
            return None
        info = self.optimizer.last_step if self.forward_only else None
        if info is not None and info.unperturbed:
            return self._outs[-1]
        total = self._outs[0]
        for o in self._outs[1:]:
            total = total + o
        return total


@dataclass
class _Epoch:
    """The running sums of one epoch (a mid-epoch checkpoint stores them)."""

    batches: list
    done: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0  # all ranks' count (reduced)
    seen: int = 0
    train_time: float = 0.0
    correct_local: int = 0  # this rank's count since the last reduction


class Trainer:
    """One ``fit`` call: resume, the epoch loop, the step, evaluation, checkpoints, results."""

    def __init__(self, model: nn.Module, train_loader: DataLoader, test_loader: Iterable | None, optimizer: Any,
                 options: FitOptions):
        options.check(train_loader)
        self.model, self.train_loader, self.test_loader, self.optimizer = model, train_loader, test_loader, optimizer
        self.o = options
        self.steps = StepStrategy(model, optimizer, options.loss_fn)
        self.precision = precision_policy(options.precision, model, options.device,
                                          forward_only=self.steps.forward_only)
        par = options.parallel
        self.par = par if par is not None and par.enabled else None
        self.main = self.par is None or self.par.is_main
        self.progress = options.progress
        if self.par is not None:
            if not self.steps.forward_only or optimizer.distributed != self.par.mode:
                raise ValueError(f"a multi-process run needs a forward-only optimizer built with "
                                 f"distributed={self.par.mode!r} (szo.optim.build_optimizer(..., distributed=...))")
            self.par.check_batches(int(train_loader.batch_size or 0) or len(next(iter(train_loader.batch_sampler))),
                                   len(train_loader.dataset), options.max_steps_per_epoch)  # type: ignore[arg-type]
            self.progress = self.progress and self.main
        self.shard = self.par is not None and self.par.shards_batches
        # accuracy denominator: in perturbation mode every rank counts the whole batch for its probes
        self.acc_ranks = self.par.world_size if self.par is not None and not self.par.shards_batches else 1
        self.run_dir = Path(options.run_dir)
        self.ckpt_path = checkpoint_path(self.run_dir)
        self.method = (options.info or {}).get("method")
        self.state = RunState(epoch=options.start_epoch)
        self.ckpt_sha: str | None = None
        self.t_wall0 = time.perf_counter()
        self.threads: ThreadChoice | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        with self.precision.scope(), contextlib.ExitStack() as scopes:  # PyTorch's flags put back after
            self._scopes = scopes  # the thread count's scope enters once the resume is known (szo.threads)
            return self._run()

    def _run(self) -> dict[str, Any]:
        o = self.o
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(self.run_dir / "metrics.jsonl") if self.main else None
        self.model.to(o.device)
        resumed = self._resume()
        self._set_threads()
        s = self.state  # the checkpoint's, when resumed
        if self.par is not None:
            self.par.broadcast_model(self.model)  # once; afterwards identical updates keep the ranks in sync
        if logger is not None:
            logger.reset(s.history)
        self.cbs: list[Callback] = ([logger] if logger is not None else []) + list(o.callbacks)
        for cb in self.cbs:
            cb.on_train_start(epoch=s.epoch, step=s.step, resumed=resumed)
        self.t_wall0 = time.perf_counter()
        while s.epoch < o.epochs:
            self._end_epoch(self._train_epoch())
        return self._finish()

    def _resume(self) -> bool:
        """Load the checkpoint when resuming (and say where the run continues); False for a fresh start."""
        st, self.ckpt_sha = _load_start_state(self.ckpt_path, self.run_dir, self.o.resume, self.par)
        if st is None:
            return False
        o = self.o
        _check_checkpoint_kind(st, self.ckpt_path, self.method, type(self.optimizer).__name__)
        if o.check_pins is not None and isinstance(st.get("pins"), str):  # checkpoints before pins have none
            o.check_pins(json.loads(st["pins"]))
        self.model.load_state_dict(st["model"])
        self.optimizer.load_state_dict(st["optimizer"])
        if o.scheduler is not None and st.get("scheduler") is not None:
            o.scheduler.load_state_dict(st["scheduler"])
        o.generator.set_state(st["generator"])
        s = self.state = RunState.from_checkpoint(st)
        if self.main:
            n_steps = len(self.train_loader.batch_sampler)  # type: ignore[arg-type]
            if o.max_steps_per_epoch is not None:
                n_steps = min(n_steps, o.max_steps_per_epoch)
            into = f", {int(s.mid['batches_done'])} of its {n_steps} steps done" if s.mid is not None else ""
            where = (f"epoch {s.epoch + 1} of {o.epochs}{into}" if s.epoch < o.epochs
                     else f"all {o.epochs} epochs were done already")
            print(f"resuming {self.run_dir} after step {s.step}: {where}"
                  f"{f' (method {self.method})' if self.method else ''}", flush=True)
        return True

    def _set_threads(self) -> None:
        """The run's intra-op thread count (``threads``: szo.threads), held until the run ends and
        recorded in ``run_dir/threads.json`` for a resumed run."""
        o = self.o
        why = ("multi-process run" if self.par is not None
               else f"device {o.device}" if torch.device(o.device).type != "cpu" else None)
        work = None if why is not None or o.threads != "auto" else fit_workload(
            self.model, self.train_loader, o.device, backward=not self.steps.forward_only)
        self.threads = choose_threads(o.threads, work, run_dir=self.run_dir, resume=o.resume, not_measured=why)
        self._scopes.enter_context(self.threads.scope())
        if self.main:
            self.threads.save(self.run_dir)

    # ------------------------------------------------------------------ one epoch
    def _start_epoch(self) -> tuple[_Epoch, Any, Any]:
        """The epoch's batch order (redrawn from the epoch-start generator state on a mid-epoch
        resume), its running sums and the loader over the batches still to do."""
        o, s, g = self.o, self.state, self.o.generator
        mid = s.mid
        if mid is not None:
            g.set_state(mid["generator_epoch_start"])
        gen_epoch_start = g.get_state()
        batches = list(self.train_loader.batch_sampler)
        if o.max_steps_per_epoch is not None:
            batches = batches[:o.max_steps_per_epoch]
        if not batches:
            raise ValueError("the train loader yields no batches (dataset smaller than batch_size with drop_last?)")
        ep = _Epoch(batches)
        if mid is not None:
            ep.done, ep.loss_sum, ep.correct = int(mid["batches_done"]), float(mid["loss_sum"]), float(mid["correct"])
            ep.seen, ep.train_time = int(mid["seen"]), float(mid["epoch_train_time_s"])
        todo = batches[ep.done:]
        loader = _epoch_loader(self.train_loader, [self.par.shard(b) for b in todo] if self.shard else todo, g)
        it = zip(iter(loader), todo)
        if mid is not None:
            g.set_state(mid["generator"])
        s.mid = None
        return ep, it, gen_epoch_start

    def _train_epoch(self) -> tuple[_Epoch, float]:
        o, s = self.o, self.state
        ep, it, gen_epoch_start = self._start_epoch()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.model.train()
        if o.bn_stats == "deployed":
            for m in bn_layers(self.model):
                m.eval()
        self.bar = tqdm(total=len(ep.batches), initial=ep.done, desc=f"{o.log_prefix}epoch {s.epoch + 1}/{o.epochs}", leave=False,
                        disable=not self.progress, dynamic_ncols=True)
        t_last = time.perf_counter()
        for (x, y), global_batch in it:
            loss = self._step(x, y, len(global_batch), ep)
            dt = time.perf_counter() - t_last
            s.train_time += dt
            ep.train_time += dt
            self.bar.update(1)
            if self.progress:
                acc = {"acc": f"{(ep.correct + ep.correct_local) / ep.seen:.3f}"} if self.steps.accuracy_known else {}
                self.bar.set_postfix(loss=f"{ep.loss_sum / ep.seen:.4f}", **acc, refresh=False)
            for cb in self.cbs:
                cb.on_step_end(s.step, s.epoch, loss)
            every = o.checkpoint_every_steps
            if every is not None and s.step % every == 0 and ep.done < len(ep.batches):
                ep.correct += self._reduce_correct(ep)  # every rank takes part, rank 0 writes
                self._checkpoint({"generator_epoch_start": gen_epoch_start, "generator": o.generator.get_state(),
                                  "batches_done": ep.done, "loss_sum": ep.loss_sum, "correct": ep.correct,
                                  "seen": ep.seen, "epoch_train_time_s": ep.train_time})
            t_last = time.perf_counter()
        self.bar.close()
        ep.correct += self._reduce_correct(ep)
        return ep, lr

    def _step(self, x: torch.Tensor, y: torch.Tensor, n: int, ep: _Epoch) -> float:
        """One optimizer step on the batch (``n`` samples in the global batch); its bookkeeping."""
        o, s, steps = self.o, self.state, self.steps
        x, y = x.to(o.device, non_blocking=True), y.to(o.device, non_blocking=True)
        scale = self.par.world_size * int(y.shape[0]) / n if self.shard else 1.0
        try:
            loss_t = steps.step(x, y, scale)
        except NonFiniteLossError as e:  # a forward-only optimizer's probe
            self._diverged(str(e).split(";")[0].replace("returned a non-finite loss", "gave a non-finite loss"))
        fwd, bwd = steps.counts()
        s.fp += fwd
        s.bp += bwd
        loss = float(loss_t.detach()) if isinstance(loss_t, torch.Tensor) else float(loss_t)
        if s.first_loss is None:  # the scale to compare later losses with: the loss before any update
            ref = steps.reference_loss(loss)
            if math.isfinite(ref):
                s.first_loss = ref
        why = _diverged(loss, self.model, s.first_loss, o.diverge_factor)
        if why is not None:
            self._diverged(why)
        ep.loss_sum += loss * n
        out = steps.accuracy_outputs()
        ep.correct_local += int((out.argmax(1) == y).sum()) if out is not None else 0
        ep.seen += n
        s.step += 1
        ep.done += 1
        return loss

    def _reduce_correct(self, ep: _Epoch) -> float:
        """All ranks' correct count since the last call (a collective: every rank calls it)."""
        got = self.par.sum_([ep.correct_local])[0] / self.acc_ranks if self.par is not None else ep.correct_local
        ep.correct_local = 0
        return got

    def _end_epoch(self, done: tuple[_Epoch, float]) -> None:
        """Scheduler, evaluation, the metrics record, callbacks, the epoch-end checkpoint."""
        ep, lr = done
        o, s = self.o, self.state
        if o.scheduler is not None:
            o.scheduler.step()
        s.epoch += 1
        test_loss = test_acc = None
        eval_time = 0.0
        if self.test_loader is not None and (s.epoch % o.eval_every == 0 or s.epoch == o.epochs):
            t0 = time.perf_counter()
            test_loss, test_acc = self._evaluate()
            eval_time = time.perf_counter() - t0
        if self.par is not None:
            self.par.check_in_sync(self.model)
        known = self.steps.accuracy_known
        record = {
            "epoch": s.epoch, "step": s.step,
            "train_loss": ep.loss_sum / ep.seen, "train_acc": ep.correct / ep.seen if known else None,
            "test_loss": test_loss, "test_acc": test_acc, "lr": lr,
            "epoch_train_time_s": ep.train_time, "eval_time_s": eval_time,
            "train_time_s": s.train_time, "wall_time_s": s.wall_time + (time.perf_counter() - self.t_wall0),
            "fp": s.fp, "bp": s.bp,
        }
        if self.par is not None:
            record.update(_comm_stats(self.optimizer.bytes_communicated, s.step))
        s.history.append(record)
        if self.progress:
            tqdm.write(f"{o.log_prefix}epoch {s.epoch}/{o.epochs}: train loss {record['train_loss']:.4f}"
                       + (f" acc {record['train_acc']:.4f}" if known else "")
                       + (f" | test acc {test_acc:.4f}" if test_acc is not None else "")
                       + f" | lr {lr:.4g} | #FP {s.fp} #BP {s.bp}")
        for cb in self.cbs:
            cb.on_epoch_end(s.epoch, s.step, record)
        self._checkpoint(None)

    def _evaluate(self) -> tuple[float, float]:
        sums = evaluate_sums(self.model, self.test_loader, self.o.loss_fn, self.o.device)
        if self.par is not None:  # every rank evaluated its shard of the test set
            sums = self.par.sum_(sums)
        if sums[2] == 0:
            raise ValueError("the test loader yielded no samples")
        return sums[0] / sums[2], sums[1] / sums[2]

    # ------------------------------------------------------------------ writing
    def _checkpoint(self, in_epoch: dict[str, Any] | None) -> None:
        if not self.main:
            return
        o, s = self.o, self.state
        self.ckpt_sha = save_checkpoint(self.ckpt_path, {
            "method": self.method, "optimizer_class": type(self.optimizer).__name__, "first_loss": s.first_loss,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": o.scheduler.state_dict() if o.scheduler is not None else None,
            "generator": o.generator.get_state(),
            "epoch": s.epoch, "step": s.step, "fp": s.fp, "bp": s.bp,
            "train_time_s": s.train_time, "wall_time_s": s.wall_time + (time.perf_counter() - self.t_wall0),
            "history": s.history, "in_epoch": in_epoch,
            **({"pins": json.dumps(dict(o.pins), sort_keys=True)} if o.pins is not None else {}),
        }, previous_sha256=self.ckpt_sha)

    def _summary(self) -> dict[str, Any]:
        summary = summarize(self.state.history, model=self.model, optimizer=self.optimizer, info=self.o.info)
        summary["precision"] = self.precision.record()
        if self.threads is not None:
            summary["threads"] = self.threads.record()
        for cb in self.cbs:
            summary.update(cb.results())
        return summary

    def _diverged(self, why: str) -> None:
        """Close the progress bar (the error gets its own line), mark results.json, stop."""
        o, s = self.o, self.state
        self.bar.close()
        if self.progress and not sys.stderr.isatty():  # a log file keeps the bar's text: end its line
            sys.stderr.write("\n")
            sys.stderr.flush()
        msg = (f"training diverged at step {s.step + 1} (epoch {s.epoch + 1} of {o.epochs}"
               f"{f', method {self.method}' if self.method else ''}): {why}; lower the learning rate"
               + (" (train.lr) or the perturbation scale (szo.mu)" if self.steps.forward_only else ""))
        if self.main:
            summary = self._summary()
            summary.update(status="diverged", error=msg, diverged_step=s.step + 1)
            atomic_write_json(self.run_dir / "results.json", summary)
        raise TrainingDiverged(msg)

    def _finish(self) -> dict[str, Any]:
        o, s = self.o, self.state
        s.wall_time += time.perf_counter() - self.t_wall0
        summary = self._summary()
        summary["status"] = "completed"
        summary["wall_time_min"] = s.wall_time / 60.0
        if self.par is not None:
            summary["distributed"] = {**self.par.describe(), **_comm_stats(self.optimizer.bytes_communicated, s.step),
                                      "startup_bytes": self.par.startup_bytes}
        if self.main:  # other ranks write nothing
            atomic_write_json(self.run_dir / "results.json", summary)
            if o.plot:
                plot_training_curve(s.history, self.run_dir / "training_curve.png",
                                    title=str((o.info or {}).get("name", self.run_dir.name)))
        for cb in self.cbs:
            cb.on_train_end(summary)
        return summary


def fit(model: nn.Module, train_loader: DataLoader, test_loader: Iterable | None, optimizer: torch.optim.Optimizer,
        **options: Any) -> dict[str, Any]:
    """Train ``model`` for ``epochs`` epochs (total, counted from 0) and return the summary.

    Keywords (:class:`FitOptions`): ``epochs``, ``loss_fn``, ``run_dir``, ``generator`` (required);
    ``scheduler``, ``device``, ``callbacks``, ``resume``, ``start_epoch``, ``eval_every``,
    ``progress``, ``max_steps_per_epoch``, ``checkpoint_every_steps``, ``info``, ``plot``,
    ``bn_stats``, ``parallel``, ``diverge_factor``, ``pins``, ``check_pins``, ``precision``, ``threads``,
    ``log_prefix`` (the prefix of the progress bar and the per-epoch lines: runs that share a terminal, like
    the demo's worker processes, tell their lines apart).

    Writes to ``run_dir``: metrics.jsonl (one line per epoch), checkpoints/last.pt,
    results.json (the summary, with what the callbacks' ``results()`` add) and
    training_curve.png. ``scheduler`` is stepped once per epoch. ``start_epoch`` numbers the
    first epoch of a fresh run (ignored on resume). ``info`` (e.g. method, recipe, k) is merged
    into the summary. ``bn_stats="deployed"`` keeps every BatchNorm layer in eval mode while
    training (normalise with the running statistics, never update them: the BN of a chip that
    folds it into the weights); ``"batch"`` is ordinary train-mode BN. ``parallel``
    (``szo.distributed.Parallel``) runs this rank's part of a multi-process run (see the module
    docstring); the test loader should then hold this rank's shard of the test set. ``pins``
    (JSON-able: e.g. the resolved config and the subspace's digest) go into every checkpoint;
    on resume ``check_pins(saved pins)`` may refuse, so a run continues only what it was
    trained with, whatever happened to the files around it. ``precision`` (``szo.precision``:
    ``auto`` | ``fp32`` | ``tf32`` | ``bf16``) is the arithmetic of the whole run (forwards,
    backwards, probes, evaluation), set by the package whatever PyTorch's defaults are, and
    recorded in results.json; ``auto`` picks by whether the optimizer is forward-only. ``threads``
    (``szo.threads``: ``auto`` | N) is torch's intra-op thread count for the run, put back when it
    ends; ``auto`` times a few forwards at 1 ... cores threads at the start (a resumed run reuses
    ``run_dir/threads.json``), and an explicit ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` wins.

    Divergence (a non-finite loss or parameter, or a loss above ``diverge_factor`` times
    ``max(|first loss|, 1)``; ``None`` checks finiteness only) stops the run with one
    :class:`TrainingDiverged` line naming the step, after writing results.json with
    ``"status": "diverged"``. A resumed run refuses a checkpoint written by another method or
    optimizer class, and says where it continues.
    """
    names = {f.name for f in dataclasses.fields(FitOptions)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"fit() got unexpected keyword(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    missing = [n for n in ("epochs", "loss_fn", "run_dir", "generator") if n not in options]
    if missing:
        raise TypeError(f"fit() missing required keyword(s): {', '.join(missing)}")
    return Trainer(model, train_loader, test_loader, optimizer, FitOptions(**options)).run()


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
    got_method = None if st.get("method") is None else current_name(st["method"])  # a renamed method is the same
    for what, got, want in (("method", got_method, method), ("optimizer", st.get("optimizer_class"), opt_kind)):
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
