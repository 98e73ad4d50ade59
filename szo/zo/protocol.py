"""What a trainer may rely on from a forward-only optimizer: the protocol and one record per step.

``szo.train.fit`` drives any ``torch.optim.Optimizer``; when it is a
:class:`ForwardOnlyOptimizer` (``isinstance`` works: the protocol is runtime-checkable) the trainer
hands it a no-grad closure and reads everything it logs from :attr:`last_step`, a frozen
:class:`StepInfo`, instead of guessing attributes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import torch
from spikingjelly.activation_based.functional import reset_net
from torch import nn

__all__ = ["Batch", "StepInfo", "ForwardOnlyOptimizer", "HasSubspace", "ReportsResults", "is_forward_only", "PROTOCOL_MEMBERS"]


class Batch(NamedTuple):
    """One step's batch, given to a forward-only step next to (or instead of) its closure:
    ``opt.step(closure, batch=Batch(x, y, loss_fn))``, or ``opt.step(batch=Batch(x, y, loss_fn))``
    for an optimizer that knows its model (the closure is then :meth:`closure`).

    An evaluator that folds the probes over the batch (``ProbePath(engine="batched")``,
    ``szo.evaluators.BatchedProbeEvaluator``) needs it, since it never calls the closure; the
    probe loop calls the closure and does not read it. ``loss_fn(out, y)`` is the batch's mean
    loss (``loss_fn(out, y, reduction="none")`` one loss per sample)."""

    x: Any
    y: Any
    loss_fn: Callable[..., torch.Tensor]

    def check(self) -> "Batch":
        """This batch, or one ValueError naming what is wrong."""
        if not callable(self.loss_fn):
            raise ValueError(f"Batch(x, y, loss_fn): loss_fn must be callable as loss_fn(out, y), "
                             f"got {type(self.loss_fn).__name__}")
        return self

    def closure(self, model: nn.Module, reduction: str = "mean") -> Callable[[], torch.Tensor]:
        """``closure() = loss_fn(model(x), y)``, the model's neuron state reset (SpikingJelly
        ``reset_net``) before each call, so it is right for a model whose ``forward`` does not reset;
        ``reduction="none"``: one loss per sample (``loss_fn(out, y, reduction="none")``)."""
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        self.check()
        kw = {} if reduction == "mean" else {"reduction": "none"}
        x, y, loss_fn = self

        def closure() -> torch.Tensor:
            reset_net(model)
            return loss_fn(model(x), y, **kw)

        return closure


@dataclass(frozen=True)
class StepInfo:
    """One step of a forward-only optimizer.

    * ``loss``: what ``step`` returned (the unperturbed BN forward's loss when it ran, else the
      probes' loss at theta_t);
    * ``losses``: the probe losses at theta_t (float64, probe order);
    * ``forwards``: forward passes of the whole batch this step (probes + the BN forward);
    * ``unperturbed``: the step's last closure call was the unperturbed train-mode forward of
      theta_{t+1} (``bn_update="recompute"``), so its outputs are the step's train outputs;
    * ``bn_loss``: that forward's loss (None when none ran);
    * ``reference_loss``: the loss before the update (mean of the probes at theta_t), the scale a
      divergence check compares later losses with.
    """

    loss: float
    losses: torch.Tensor
    forwards: int
    unperturbed: bool = False
    bn_loss: float | None = None

    @property
    def reference_loss(self) -> float:
        return float(self.losses.mean()) if self.losses.numel() else self.loss


@runtime_checkable
class ForwardOnlyOptimizer(Protocol):
    """A ``torch.optim.Optimizer`` trained by forward passes only.

    * ``step(closure, *, batch=None)``: calls the no-grad ``closure`` (forward, loss) once per probe;
      returns the loss. ``batch`` (a :class:`Batch`) is the step's batch, which an evaluator that
      folds the probes over it needs (the batched engine); without a closure the step builds it from
      the batch and its model (``Batch.closure``);
    * ``forward_passes``: forwards so far (checkpointed); ``forwards_per_step``: per step;
    * ``generator``: the ``torch.Generator`` its random directions come from (checkpointed, so a
      resumed run draws the same ones; a test-time adapter's reset leaves it running);
    * ``last_step``: the :class:`StepInfo` of the last step (None before the first);
    * ``distributed``: ``None``, ``"data"`` or ``"perturbation"`` (torch.distributed mode);
    * ``bytes_communicated``: bytes this rank put into collectives (0 in one process);
    * ``train_outputs``: the closure calls of a step show the trainer the outputs it computes the
      train accuracy from (False: the batched engine folds the probes without returning outputs,
      and no unperturbed forward runs);
    * ``loss_reduction``: what the closure must return: ``"mean"`` (the batch loss, a scalar) or
      ``"none"`` (one loss per sample, ``[N]``: per-sample node perturbation, seed 004 Algorithm 1).
    """

    forward_only: bool
    loss_reduction: str
    forward_passes: int
    generator: torch.Generator
    distributed: str | None
    bytes_communicated: int

    @property
    def forwards_per_step(self) -> int: ...

    @property
    def last_step(self) -> StepInfo | None: ...

    @property
    def train_outputs(self) -> bool: ...

    def step(self, closure: Callable[[], torch.Tensor] | None = None, *, batch: Batch | None = None
             ) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class ReportsResults(Protocol):
    """An optimizer with facts of its own for a run's results.json, known only after training (a
    tensor-train run's switch step, the units of a subspace method's mu / lr, the integer learner's
    modes and clamps): ``result_fields()`` -> ``{key: value}``; the stage that trains it merges them
    (a dict value into the stage's own dict under the same key)."""

    def result_fields(self) -> dict: ...


@runtime_checkable
class HasSubspace(Protocol):
    """An optimizer that moves the parameters inside a k-dimensional subspace."""

    k: int


PROTOCOL_MEMBERS: tuple[str, ...] = ("forward_only", "loss_reduction", "forward_passes", "generator", "distributed", "bytes_communicated",
                                     "forwards_per_step", "last_step", "train_outputs", "step", "state_dict",
                                     "load_state_dict")


def is_forward_only(optimizer: object) -> bool:
    """True for a :class:`ForwardOnlyOptimizer`, False for any other optimizer (BP: the trainer
    runs ``backward``); one ValueError for an object that says ``forward_only = True`` but lacks
    part of the protocol (it would otherwise be trained as a BP optimizer without a word)."""
    if isinstance(optimizer, ForwardOnlyOptimizer):
        return bool(optimizer.forward_only)
    if vars(type(optimizer)).get("forward_only") is True or vars(optimizer).get("forward_only") is True:
        missing = [m for m in PROTOCOL_MEMBERS if not hasattr(optimizer, m)]
        raise ValueError(f"{type(optimizer).__name__} says forward_only = True but lacks {', '.join(missing)} of "
                         "the forward-only protocol (szo.zo.ForwardOnlyOptimizer; subclass szo.zo.ForwardOnlyBase "
                         "to get them)")
    return False
