"""What every forward-only optimizer does around its probes, in one place (the forward-only core).

* **The model.** ``SZO(model, subspace, ...)`` (and ``FullSpaceZO(model, ...)``,
  ``BPSubspace(model, ...)``) take the model itself: its parameters are the optimizer's,
  its BN layers are frozen across the probes and its spiking neurons reset before each.
  The params form ``SZO(model.parameters(), subspace, ..., model=model)`` stays;
  ``resolve_model`` turns either form into ``(params, model)``.
* **Neuron state.** A SpikingJelly network keeps membrane potentials between calls
  (``MemoryModule``); a foreign model whose ``forward`` does not reset would leak state from
  one probe into the next. ``ProbeGuard.reset`` runs ``functional.reset_net(model)`` before
  every probe and before the unperturbed BN forward.
* **Nothing silently skipped.** Without a model the optimizer cannot freeze BN or reset
  neurons. Rather than refusing every params-form call, ``ProbeGuard.watch`` installs a
  global module forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``)
  for the duration of the first step's probes: it sees which modules the closure actually
  runs, and raises one ``ValueError`` if one is a train-mode BN layer or a SpikingJelly
  ``MemoryModule`` the optimizer does not know (no model given, or one outside the given
  model). A closure over a stateless, BN-free network needs no model and passes.
* **BN statistics.** ``bn_update`` (``szo.zo.bn``): ``"recompute"`` (default) leaves the
  running statistics untouched by the probes, then ``ProbeGuard.unperturbed_forward`` runs the
  closure once at theta_{t+1} (train mode), which updates them and gives the logged train
  loss / accuracy; it is skipped (no cost) when no BN layer is in train mode.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from spikingjelly.activation_based import functional
from spikingjelly.activation_based.base import MemoryModule
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook

from ..functional import zo as F
from ..precision import fresh_casts
from .bn import BNStatsFreezer, check_bn_update

__all__ = ["resolve_model", "ProbeGuard", "check_hparams"]

def resolve_model(params_or_model, model: nn.Module | None, who: str) -> tuple[list[torch.Tensor], nn.Module | None]:
    """``(params, model)`` from ``who(model, ...)`` or ``who(params, ..., model=model)``."""
    if isinstance(params_or_model, nn.Module):
        if model is not None and model is not params_or_model:
            raise ValueError(f"{who}(model, ..., model=other): give the model once (first argument), "
                             "or pass model.parameters() first and model=model")
        model = params_or_model
        params = list(model.parameters())
        if not params:
            raise ValueError(f"{who}: the model ({type(model).__name__}) has no parameters to train")
        return params, model
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"{who}: model= must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(params_or_model, torch.Tensor):
        raise ValueError(f"{who} takes a model or an iterable of parameters, got one tensor; "
                         "pass model or model.parameters()")
    params = list(params_or_model)
    if not params:
        raise ValueError(f"{who}: optimizer got an empty parameter list")
    if model is not None and not isinstance(params[0], dict):
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for p in params):
            raise ValueError(f"{who}: the parameters are not all parameters of model= ({type(model).__name__})")
    return params, model


def check_hparams(*, lr=None, momentum=None, mu=None, q=None) -> None:
    """One clear error for a bad optimizer hyperparameter; the ones left at None are not checked."""
    if lr is not None and not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if mu is not None and not mu > 0:
        raise ValueError(f"mu must be > 0, got {mu}")
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise ValueError(f"q must be an integer >= 1, got {q!r}")


def _stateful(mod: nn.Module) -> str | None:
    """Why ``mod`` needs the optimizer to know the model, or None."""
    if isinstance(mod, _BatchNorm) and mod.training and mod.track_running_stats:
        return "a train-mode BatchNorm layer (its running statistics must be frozen across the probes)"
    if isinstance(mod, MemoryModule):
        return "a stateful SpikingJelly module (its neuron state must be reset before every probe)"
    return None


class ProbeGuard:
    """Resets, BN freezing, the unknown-module check and the unperturbed BN forward of one optimizer."""

    def __init__(self, model: nn.Module | None, who: str, *, bn_update: str = "recompute", freeze_bn: bool = True):
        self.model = model
        self.who = who
        self.bn_update = check_bn_update(bn_update)
        self.bn = BNStatsFreezer(model if freeze_bn else None)
        self._watched = False  # the first step's probes were checked

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Neuron state of the model back to its initial value (SpikingJelly ``reset_net``)."""
        if self.model is not None:
            functional.reset_net(self.model)

    @property
    def recomputes(self) -> bool:
        """This step ends with an unperturbed forward: ``bn_update="recompute"`` and BN in train mode."""
        return self.bn_update == "recompute" and self.bn.active

    @property
    def probe_mean(self) -> bool:
        return self.bn_update == "probe-mean"

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """During the first step's probes: refuse train-mode BN / stateful modules the optimizer does not know."""
        if self._watched:
            yield
            return
        known = set(self.model.modules()) if self.model is not None else set()
        who = self.who

        def hook(mod: nn.Module, _args) -> None:
            if mod in known:
                return None
            why = _stateful(mod)
            if why is not None:
                if self.model is None:
                    raise ValueError(
                        f"{who}: the closure runs {type(mod).__name__}, {why}, but the optimizer was given no "
                        f"model; construct it as {who}(model, ...) (or pass model=model with the parameters)")
                raise ValueError(f"{who}: the closure runs {type(mod).__name__}, {why}, which is not part of "
                                 f"model= ({type(self.model).__name__}); pass the model the closure runs")
            return None

        handle = register_module_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()
        self._watched = True

    # ------------------------------------------------------------------ one probe
    @torch.no_grad()
    def probe(self, closure: Callable[[], torch.Tensor], where: str, per_sample: bool = False
              ) -> "float | torch.Tensor":
        """One forward at the parameters as they are now: the step's BN statistics put back, the
        neurons reset, the closure run, its loss checked (``per_sample``: one loss per sample, the
        float64 ``[N]`` losses); under ``probe-mean`` what it did to the BN statistics is added to
        the step's mean. The evaluator has called ``bn.snapshot()`` at the start of the step and
        holds :meth:`watch` around the step's probes."""
        self.bn.restore()
        self.reset()
        out = (F.check_sample_losses if per_sample else F.check_loss)(closure(), where)
        if self.probe_mean:
            self.bn.accumulate()
        return out

    @torch.no_grad()
    def end_probes(self) -> None:
        """After a step's last probe: ``probe-mean`` commits the mean over the probes,
        ``recompute`` leaves the statistics as the step found them (the BN forward comes later)."""
        if self.probe_mean:
            self.bn.commit()
        else:
            self.bn.restore()

    # ------------------------------------------------------------------ BN forward
    @torch.no_grad()
    def unperturbed_forward(self, closure: Callable[[], torch.Tensor], *, distributed: bool = False,
                            process_group=None, sync: contextlib.AbstractContextManager | None = None) -> float:
        """Run the closure once at the current (updated) parameters, in train mode: it updates the BN
        running statistics as an ordinary training forward would. Returns its loss.

        ``distributed`` without ``sync`` (data mode without SyncBatchNorm: every rank saw its own
        shard): the ranks' running statistics are then averaged (one BN update with the mean
        shard statistics), so that every rank keeps the same ones.
        """
        self.reset()
        if distributed and sync is None:
            self.bn.snapshot()
        with sync if sync is not None else contextlib.nullcontext(), fresh_casts():  # the updated weights, cast now
            value = F.check_loss(closure(), "closure (unperturbed BN forward)")
        if distributed and sync is None:
            self.bn.accumulate()
            self.bn.commit(True, process_group)
        return value
