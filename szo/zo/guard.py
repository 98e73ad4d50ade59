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
* **The same randomness for every probe.** A probe pair must compare one network at two points:
  a train-mode Dropout (or a Poisson encoder, or noise drawn in the closure) that drew new random
  numbers per forward would compare two different networks. ``RandomReplay`` keeps the state of
  torch's default generators (the CPU one and those of the model's CUDA devices) at the start of
  a step and puts it back before every probe and before the BN forward, as MeZO replays its seed:
  every forward of a step draws the same masks, and the step consumes what one forward draws.
  docs/evidence.md ("Dropout in the probes") measures what this does to the estimate.
* **Forward-only closures.** The closure is called under ``torch.no_grad`` once per probe and must
  only compute the loss. One that runs ``backward`` -- the torch.optim closure
  ``zero_grad(); loss.backward(); return loss``, or Lightning's automatic optimization -- is refused
  in one line (:data:`FORWARD_ONLY_CLOSURE`) at its first call (with the loop and JVP evaluators,
  before any parameter moves; the batched engine first calls it for the BN forward).
* **Compiled models.** ``SZO(torch.compile(model), ...)``: the watch's global hook steps aside
  while dynamo traces a module call (``torch.compiler.is_compiling``) and checks a compiled
  module it does not know, with all its submodules, when that module is called.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch
from spikingjelly.activation_based import functional
from spikingjelly.activation_based import layer as sj_layer
from spikingjelly.activation_based.base import MemoryModule
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.module import register_module_forward_pre_hook

from ..functional import zo as F
from ..precision import fresh_casts
from ..vocab import check_float32
from .bn import BNStatsFreezer, check_bn_update

__all__ = ["resolve_model", "unname", "ProbeGuard", "RandomReplay", "check_hparams", "FORWARD_ONLY_CLOSURE", "train_mode_dropout"]

FORWARD_ONLY_CLOSURE = (
    "{who}.step is forward-only: it calls the closure under torch.no_grad once per probe, so the closure must only "
    "compute and return the loss (no zero_grad() / backward()), e.g. opt.step(lambda: loss_fn(model(x), y)); "
    "in PyTorch Lightning set self.automatic_optimization = False and call opt.step(closure) in training_step")
"""The one line that refuses a closure which runs ``backward`` (``{who}``: the optimizer's name)."""

# what autograd says when backward() meets a loss computed under no_grad (the optimizer's step)
_NO_GRAPH = "does not require grad and does not have a grad_fn"

def unname(params: list) -> tuple[list, list[str] | None]:
    """``(tensors, names)`` from a parameter list that may be ``named_parameters()`` pairs (torch accepts
    those since 2.6 and keeps the names in ``param_groups[i]["param_names"]``); ``names`` None for plain
    tensors. A list mixing both is refused in one line, as torch refuses it."""
    named = [isinstance(p, tuple) for p in params]
    if not any(named):
        return params, None
    if not all(named) or any(len(p) != 2 or not isinstance(p[0], str) for p in params):
        raise ValueError("optimizer params must be all tensors or all (name, tensor) pairs (model.named_parameters()), "
                         "not a mix")
    return [p for _, p in params], [n for n, _ in params]


def resolve_model(params_or_model, model: nn.Module | None, who: str
                  ) -> tuple[list[torch.Tensor], nn.Module | None, list[str] | None]:
    """``(params, model, names)`` from ``who(model, ...)`` or ``who(params, ..., model=model)``;
    ``names``: the parameters' names where ``params`` was ``model.named_parameters()`` (torch keeps
    them as the group's ``param_names``), else None."""
    if isinstance(params_or_model, nn.Module):
        if model is not None and model is not params_or_model:
            raise ValueError(f"{who}(model, ..., model=other): give the model once (first argument), "
                             "or pass model.parameters() first and model=model")
        model = params_or_model
        params = list(model.parameters())
        if not params:
            raise ValueError(f"{who}: the model ({type(model).__name__}) has no parameters to train")
        return params, model, None
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"{who}: model= must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(params_or_model, torch.Tensor):
        raise ValueError(f"{who} takes a model or an iterable of parameters, got one tensor; "
                         "pass model or model.parameters()")
    params = list(params_or_model)
    if not params:
        raise ValueError(f"{who}: optimizer got an empty parameter list")
    names = None
    if not isinstance(params[0], dict):
        params, names = unname(params)
    if model is not None and not isinstance(params[0], dict):
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for p in params):
            raise ValueError(f"{who}: the parameters are not all parameters of model= ({type(model).__name__})")
    return params, model, names


def check_hparams(*, lr=None, momentum=None, mu=None, q=None) -> None:
    """One clear error for a bad optimizer hyperparameter; the ones left at None are not checked. ``lr``
    may be a one-element tensor, as torch's optimizers take it. A float lr / mu must be representable in
    the float32 the arithmetic runs in: finite, and 0 or normal (the rule of a recipe's float settings,
    ``szo.schema``, at the optimizers' own constructors)."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"lr as a tensor must be one floating-point element (torch's rule), got shape "
                             f"{tuple(lr.shape)} {lr.dtype}")
        lr = float(lr)
    for name, v in (("lr", lr), ("mu", mu)):
        check_float32(name, v)  # the one home of the rule (szo.vocab): the schema's words at every door
    if lr is not None and not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if mu is not None and not mu > 0:
        raise ValueError(f"mu must be > 0, got {mu}")
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise ValueError(f"q must be an integer >= 1, got {q!r}")


def _compiled(mod: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped in ``mod`` (an ``OptimizedModule``), else None."""
    inner = getattr(mod, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def _grad_marks(params: list[torch.Tensor]) -> list:
    """Each parameter's ``.grad`` and its version counter (autograd's count of in-place writes): a
    closure that ran ``backward`` changes one."""
    return [None if p.grad is None else (p.grad, p.grad._version) for p in params]


def _same_marks(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y is None or (x is not None and y is not None and x[0] is y[0]
                                                       and x[1] == y[1]) for x, y in zip(a, b))


class RandomReplay:
    """The state of torch's default generators at the start of a step, put back before each of its
    forwards (module docstring): the CPU generator, and the CUDA generators of the model's devices
    (without a model: of every CUDA device once CUDA is initialised)."""

    def __init__(self, model: nn.Module | None):
        self.model = model
        self._cpu: torch.Tensor | None = None
        self._cuda: dict[int, torch.Tensor] = {}

    def _cuda_devices(self) -> list[int]:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        if self.model is None:
            return list(range(torch.cuda.device_count()))
        return sorted({p.device.index if p.device.index is not None else torch.cuda.current_device()
                       for p in self.model.parameters() if p.device.type == "cuda"})

    def snapshot(self) -> None:
        """Keep the generators' state: the step's forwards will all start from it."""
        self._cpu = torch.get_rng_state()
        self._cuda = {d: torch.cuda.get_rng_state(d) for d in self._cuda_devices()}

    def restore(self) -> None:
        """The generators back at the step's state (no-op before the first snapshot)."""
        if self._cpu is None:
            return
        torch.set_rng_state(self._cpu)
        for d, state in self._cuda.items():
            torch.cuda.set_rng_state(state, d)


def train_mode_dropout(model: nn.Module) -> list[str]:
    """Names of the dropout layers of ``model`` that draw masks now (train mode, p > 0): torch's
    ``Dropout*`` and SpikingJelly's ``layer.Dropout`` (one mask per sequence)."""
    return [name for name, m in model.named_modules()
            if m.training and float(getattr(m, "p", 0.0) or 0.0) > 0.0
            and (isinstance(m, _DropoutNd) or isinstance(m, sj_layer.Dropout))]


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
        self.random = RandomReplay(model)
        self._watched = False  # the first step's probes were checked
        self._params: list[torch.Tensor] | None = None  # the model's parameters, listed once per step

    # ------------------------------------------------------------------ state
    def begin_step(self) -> None:
        """At the start of a step's probes: the BN statistics and the random state its forwards start from,
        and the model's parameters (whose ``.grad`` every forward of the step checks), listed once."""
        self.bn.snapshot()
        self.random.snapshot()
        self._params = self._model_params()

    def _model_params(self) -> list[torch.Tensor]:
        return [] if self.model is None else list(self.model.parameters())

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
            if torch.compiler.is_compiling():  # dynamo tracing a compiled module's body: checked at its call
                return None
            if mod in known:
                return None
            inner = _compiled(mod)  # a compiled module runs its submodules where this hook does not see them
            if inner is not None and inner in known:  # torch.compile(model) in the closure: the same layers
                return None
            why = next(filter(None, map(_stateful, inner.modules())), None) if inner is not None else _stateful(mod)
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
            with warnings.catch_warnings():  # torch warns, on every call of a compiled module, that this hook exists
                warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
                yield
        finally:
            handle.remove()
        self._watched = True

    # ------------------------------------------------------------------ the closure
    def call(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``closure()``, refused in one line (:data:`FORWARD_ONLY_CLOSURE`) if it runs ``backward``:
        under the step's no_grad autograd raises, and with grad enabled inside the closure (Lightning's
        automatic optimization) the model's ``.grad`` change."""
        params = self._params if self._params is not None else self._model_params()
        before = _grad_marks(params)
        try:
            out = closure()
        except RuntimeError as e:
            if _NO_GRAPH in str(e):
                raise ValueError(FORWARD_ONLY_CLOSURE.format(who=self.who)) from None
            raise
        if not _same_marks(before, _grad_marks(params)):
            raise ValueError(FORWARD_ONLY_CLOSURE.format(who=self.who))
        return out

    # ------------------------------------------------------------------ one probe
    @torch.no_grad()
    def probe(self, closure: Callable[[], torch.Tensor], where: str, per_sample: bool = False
              ) -> "float | torch.Tensor":
        """One forward at the parameters as they are now: the step's BN statistics put back, the
        neurons reset, the closure run, its loss checked (``per_sample``: one loss per sample, the
        float64 ``[N]`` losses); under ``probe-mean`` what it did to the BN statistics is added to
        the step's mean. The evaluator has called :meth:`begin_step` at the start of the step and
        holds :meth:`watch` around the step's probes; the random state is the step's (module docstring)."""
        self.bn.restore()
        self.random.restore()
        self.reset()
        out = (F.check_sample_losses if per_sample else F.check_loss)(self.call(closure), where)
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
        self.random.restore()  # the step's random state: the same dropout masks as its probes
        self.reset()
        if distributed and sync is None:
            self.bn.snapshot()
        with sync if sync is not None else contextlib.nullcontext(), fresh_casts():  # the updated weights, cast now
            value = F.check_loss(self.call(closure), "closure (unperturbed BN forward)")
        if distributed and sync is None:
            self.bn.accumulate()
            self.bn.commit(True, process_group)
        return value
