"""Test-time adaptation methods as small wrappers around a model and its optimizer (Tent style).

Every method is an :class:`Adapter`: ``adapter(x)`` predicts on an unlabeled test batch and
adapts the model on it with the entropy loss (Wang et al., 2020); ``adapter.reset()`` puts
the parameters, the BN running statistics and the optimizer state back to the source
state, bit-exactly, from copies saved at construction (nothing is reloaded from disk).

Methods (``METHODS``):

* ``none`` -- the source model in eval mode (BN uses its running statistics).
* ``bn`` -- BN layers normalise with the test-batch statistics (Schneider et al., 2020);
  no parameter changes.
* ``tent`` -- Tent: BN uses batch statistics, BP on the BN affine parameters only
  (:func:`configure_model`, :func:`collect_params`, :func:`check_model`). Optimizer as in
  Tent's code: Adam(lr=1e-3, betas=(0.9, 0.999)) by default (Tent's CIFAR-10/100-C
  setting), or SGD(momentum=0.9) (Tent's ImageNet-C setting, lr 2.5e-4 at batch 64).
* ``bp-subspace`` -- the BPTT entropy gradient of all parameters projected on P
  (``szo.optim.BPSubspace``), SGD with momentum in the subspace.
* ``szo-cge`` / ``szo-rge`` -- ``szo.optim.SZO``: 2k (CGE) or 2q (RGE, q=10) forward probes
  in the subspace, BN statistics frozen across the probes of a step, forward passes only.

The subspace methods' optimizers come from ``szo.optim.build_optimizer`` (the same
method -> optimizer mapping as the training recipes).

All adapting methods (everything except ``none``) put the BN layers in train mode: they
normalise with the test batch's statistics, and their running statistics keep tracking
the test data (they are state of the adapted model, restored by ``reset``), as in the
paper's SZO where the running statistics are held identical across the probes of a step.
The rest of the model stays in eval mode.

Prediction timing (``predict``): ``"before"`` (default) returns the outputs of the model as
it was when the batch arrived, i.e. before the batch's own update. This is Tent's protocol
(the output of the forward used for the update is the prediction) and costs BP methods
nothing extra; for SZO the probes are perturbed, so ``"before"`` costs one extra clean
forward per batch (2k + 1 forwards for CGE, 2q + 1 for RGE). ``"after"`` predicts with the
updated model: one extra forward for every adapting method. ``"before"`` is the default
because it is the same protocol for every method and it is the fair online setting (no
prediction benefits from an update computed on its own batch). Clean prediction forwards
leave the BN running statistics unchanged (snapshot / restore), so each batch makes
exactly one BN running-statistics update whatever ``predict`` is.

Counters: ``forward_passes`` and ``backward_passes`` count model forwards / backwards over
all batches (one per batch, i.e. per call to the network, not per sample).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.config import DEFAULT_Q, TENT_OPTIMIZERS, TTA_PREDICT, TTA_SETTINGS, AdapterConfig
from szo.losses import entropy_loss
from szo.methods import NO_ADAPTATION, TTA_METHODS, TTA_SUBSPACE_METHODS, get_method
from szo.optim import build_optimizer
from szo.zo import BNStatsFreezer, get_estimator, is_forward_only

__all__ = [
    "METHODS",
    "SUBSPACE_METHODS",
    "SETTINGS",
    "PREDICT",
    "METHOD_LABELS",
    "USES_BP",
    "TENT_OPTIMIZERS",
    "check_choice",
    "configure_model",
    "configure_bn",
    "collect_params",
    "check_model",
    "Adapter",
    "NoAdapt",
    "BNAdapt",
    "Tent",
    "BPSubspaceAdapt",
    "SZOAdapt",
    "build_adapter",
    "adapter_class",
    "AdaptOptions",
]

#: the test-time adaptation methods (their ``szo.methods`` records name an ``adapter``), table order
METHODS = TTA_METHODS
#: the methods that adapt inside the adaptation subspace (they need ``subspace``)
SUBSPACE_METHODS = TTA_SUBSPACE_METHODS
SETTINGS = TTA_SETTINGS
PREDICT = TTA_PREDICT
#: column / row names used in the paper's Table 2 and Tables 5-10 (the registry's labels)
METHOD_LABELS = {m: get_method(m).label for m in METHODS}
#: whether the method back-propagates (the "BP" column of Tables 5-10)
USES_BP = {m: get_method(m).backprop for m in METHODS}

LossFn = Callable[[torch.Tensor], torch.Tensor]


def check_choice(kind: str, value: object, valid: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``valid``, else raise one ValueError listing them."""
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")
    return value


# --------------------------------------------------------------------------- Tent's helpers
def _bn_modules(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def configure_bn(model: nn.Module) -> nn.Module:
    """Eval mode everywhere except BN layers, which use test-batch statistics; no gradients."""
    model.eval()
    model.requires_grad_(False)
    for m in _bn_modules(model):
        m.train()
    return model


def configure_model(model: nn.Module) -> nn.Module:
    """Tent: BN layers use batch statistics, only BN affine weight / bias require grad."""
    configure_bn(model)
    for m in _bn_modules(model):
        if m.affine:
            m.weight.requires_grad_(True)
            m.bias.requires_grad_(True)
    return model


def collect_params(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """Tent: the affine weight and bias of every BN layer, with their names."""
    params, names = [], []
    for mname, m in model.named_modules():
        if isinstance(m, _BatchNorm) and m.affine:
            for pname, p in (("weight", m.weight), ("bias", m.bias)):
                params.append(p)
                names.append(f"{mname}.{pname}" if mname else pname)
    return params, names


def check_model(model: nn.Module) -> None:
    """Tent: the model must be configured by :func:`configure_model` (raises ValueError)."""
    bns = _bn_modules(model)
    if not bns:
        raise ValueError("Tent needs a model with BatchNorm layers; this model has none")
    if not all(m.training for m in bns):
        raise ValueError("Tent needs every BN layer in train mode (batch statistics); call configure_model")
    grads = [p.requires_grad for p in model.parameters()]
    if not any(grads):
        raise ValueError("Tent needs the BN affine parameters to require grad; call configure_model")
    if all(grads):
        raise ValueError("Tent adapts the BN affine parameters only, but every parameter requires grad; "
                         "call configure_model")
    bn_params = {id(p) for p in collect_params(model)[0]}
    others = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in bn_params]
    if others:
        raise ValueError(f"Tent adapts the BN affine parameters only; these also require grad: {others[:5]}")


# --------------------------------------------------------------------------- adapters
class Adapter:
    """Predict-and-adapt wrapper: holds ``model`` (adapted in place) and its ``optimizer``.

    Subclasses name the adapter ``kind`` the registry's records refer to (``szo.methods``), say
    whether their predictions depend on the reset / continual setting (``setting_free``: they
    change no parameter), which learning rate they use (``lr_option``) and what a batch costs
    (:meth:`per_batch`)."""

    method: str = ""
    kind: str = ""
    setting_free = False
    lr_option: str | None = None  # "lr" (subspace methods) | "tent_lr" | None

    @classmethod
    def per_batch(cls, predict: str, k: int | None, q: int, method: str) -> tuple[int, int]:
        """(#FP, #BP) per batch (network calls on the whole batch)."""
        return 1, 0

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.predict = check_choice("predict", predict, PREDICT)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.forward_passes = 0
        self.backward_passes = 0
        self.batches = 0
        self.last_loss: float | None = None
        self._bn_guard = BNStatsFreezer(model)
        # the source state: parameters AND buffers (BN running stats), optimizer state
        self._model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predict on ``x`` and adapt on it; returns detached outputs ``[T, N, C]``."""
        out = self._forward_and_adapt(x)
        self.batches += 1
        return out.detach()

    __call__ = forward

    def _forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _forward_and_adapt")

    @torch.no_grad()
    def _clean_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A prediction forward that leaves BN running statistics unchanged."""
        self._bn_guard.snapshot()
        try:
            out = self.model(x)
        finally:
            self._bn_guard.restore()
        self.forward_passes += 1
        return out

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the source parameters, BN buffers and optimizer state (bit-exact copies)."""
        for k, v in self.model.state_dict().items():
            v.copy_(self._model_state[k])
        if self.optimizer is not None and self._opt_state is not None:
            opt = self.optimizer
            forward_only = is_forward_only(opt)  # its generator and forward count are not part of the reset
            gen_state = opt.generator.get_state() if forward_only else None
            fps = opt.forward_passes if forward_only else None
            opt.load_state_dict(copy.deepcopy(self._opt_state))
            # random directions keep coming from the run's stream (fresh after a reset)
            if forward_only:
                opt.generator.set_state(gen_state)
                opt.forward_passes = fps

    def counts(self) -> dict[str, int]:
        return {"fp": self.forward_passes, "bp": self.backward_passes, "batches": self.batches}


class NoAdapt(Adapter):
    """The source model, eval mode (running BN statistics), no adaptation."""

    method = NO_ADAPTATION
    kind = "source"
    setting_free = True

    def __init__(self, model: nn.Module, *, predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        model.eval()
        model.requires_grad_(False)
        super().__init__(model, None, predict=predict, loss_fn=loss_fn)

    @torch.no_grad()
    def _forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_passes += 1
        return self.model(x)


class BNAdapt(Adapter):
    """Test-batch BN statistics (Schneider et al., 2020); parameters never change."""

    method = "bn"
    kind = "batch-statistics"
    setting_free = True

    def __init__(self, model: nn.Module, *, predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        configure_bn(model)
        if not _bn_modules(model):
            raise ValueError("method 'bn' needs a model with BatchNorm layers; this model has none")
        super().__init__(model, None, predict=predict, loss_fn=loss_fn)

    @torch.no_grad()
    def _forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        # one forward: normalises with batch statistics and updates the running statistics
        self.forward_passes += 1
        return self.model(x)


class _GradientAdapter(Adapter):
    """One BP step on the entropy loss per batch (Tent, BP-Subspace)."""

    @classmethod
    def per_batch(cls, predict: str, k: int | None, q: int, method: str) -> tuple[int, int]:
        return 1 + (predict == "after"), 1

    @torch.enable_grad()
    def _forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = self.loss_fn(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.forward_passes += 1
        self.backward_passes += 1
        self.last_loss = float(loss.detach())
        if self.predict == "after":
            out = self._clean_forward(x)
        return out


class Tent(_GradientAdapter):
    """Tent: entropy minimisation on the BN affine parameters (Wang et al., 2020)."""

    method = "tent"
    kind = "tent"
    lr_option = "tent_lr"

    def __init__(self, model: nn.Module, *, optimizer: str = "adam", lr: float = 1e-3, momentum: float = 0.9,
                 predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        check_choice("Tent optimizer", optimizer, TENT_OPTIMIZERS)
        if not lr > 0:
            raise ValueError(f"Tent lr must be > 0, got {lr}")
        configure_model(model)
        check_model(model)
        params, _ = collect_params(model)
        if optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
        super().__init__(model, opt, predict=predict, loss_fn=loss_fn)


class BPSubspaceAdapt(_GradientAdapter):
    """Entropy BPTT gradient of all parameters projected on the subspace (eq. 6 update)."""

    method = "bp-subspace"
    kind = "subspace-gradient"
    lr_option = "lr"

    def __init__(self, model: nn.Module, subspace, *, lr: float, momentum: float = 0.9, scale: str | None = None,
                 predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        configure_bn(model)
        model.requires_grad_(True)
        opt = build_optimizer("bp-subspace", model, subspace=subspace, lr=lr, momentum=momentum, start="current",
                              scale=scale)
        super().__init__(model, opt, predict=predict, loss_fn=loss_fn)


class SZOAdapt(Adapter):
    """SZO: forward-only entropy minimisation in the subspace (CGE: 2k probes, RGE: 2q)."""

    kind = "subspace-zo"
    lr_option = "lr"

    @classmethod
    def per_batch(cls, predict: str, k: int | None, q: int, method: str) -> tuple[int, int]:
        probes = get_estimator(get_method(method).variant).probes(k or 0, q)  # the estimator's own count
        return probes + 1, 0  # + one clean prediction forward (before or after the step)

    def __init__(self, model: nn.Module, subspace, *, method: str = "szo-cge", lr: float, mu: float | None = None,
                 momentum: float = 0.9, q: int = DEFAULT_Q["tta"], generator: torch.Generator | None = None,
                 scale: str | None = None,
                 predict: str = "before", loss_fn: LossFn = entropy_loss) -> None:
        check_choice("SZO method", method, [m for m in METHODS if get_method(m).adapter == self.kind])
        configure_bn(model)
        model.requires_grad_(True)  # what it trains: every parameter, in the subspace (an optimizer leaves frozen ones)
        # adaptation starts from the source model; BN normalises with test-batch statistics and
        # never uses its running statistics, so an unperturbed BN forward per step would buy nothing
        opt = build_optimizer(method, model, subspace=subspace, lr=lr, momentum=momentum, mu=mu, q=q,
                              generator=generator, start="current", bn_update="probe-mean", scale=scale)
        super().__init__(model, opt, predict=predict, loss_fn=loss_fn)
        self.method = method

    def _forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        opt = self.optimizer
        out = self._clean_forward(x) if self.predict == "before" else None
        before = opt.forward_passes
        loss = opt.step(lambda: self.loss_fn(self.model(x)))
        self.forward_passes += opt.forward_passes - before
        self.last_loss = float(loss)
        if out is None:
            out = self._clean_forward(x)
        return out


@dataclass(frozen=True, eq=False)
class AdaptOptions(AdapterConfig):
    """An adapter's settings: the recipe's ``AdapterConfig`` (momentum, predict, Tent's optimizer, lr and
    momentum; one declaration and check with ``tta.*``), and the subspace methods' (bp-subspace, szo-*)
    ``subspace`` / ``lr`` / ``mu`` / ``q`` / ``generator`` / ``scale`` (the units of mu and lr,
    ``szo.zo.scale``); ``loss_fn`` applies to every method."""

    subspace: object | None = None
    lr: float | None = None
    mu: float | None = None
    q: int = DEFAULT_Q["tta"]
    scale: str | None = None
    generator: torch.Generator | None = None
    loss_fn: Callable = entropy_loss


def adapter_class(method: str) -> type[Adapter]:
    """The :class:`Adapter` subclass that runs ``method`` (its registry record's ``adapter`` kind)."""
    check_choice("method", method, METHODS)
    kind = get_method(method).adapter
    return next(c for c in (NoAdapt, BNAdapt, Tent, BPSubspaceAdapt, SZOAdapt) if c.kind == kind)


def build_adapter(method: str, model: nn.Module, **options) -> Adapter:
    """The :class:`Adapter` for one of ``METHODS`` around ``model`` (adapted in place); keywords
    are the fields of :class:`AdaptOptions`. Subspace methods need ``subspace`` and ``lr``."""
    o = AdaptOptions(**options)
    cls = adapter_class(method)
    common = dict(predict=o.predict, loss_fn=o.loss_fn)
    if cls is Tent:
        return Tent(model, optimizer=o.tent_optimizer, lr=o.tent_lr, momentum=o.tent_momentum, **common)
    if cls.lr_option != "lr":
        return cls(model, **common)
    if o.subspace is None:
        raise ValueError(f"method {method!r} needs an adaptation subspace (szo.adapt.subspace.build_adaptation_subspace)")
    if o.lr is None:
        raise ValueError(f"method {method!r} needs lr (paper App. G: 1.0 for reset, 0.1 for continual)")
    if cls is BPSubspaceAdapt:
        return BPSubspaceAdapt(model, o.subspace, lr=o.lr, momentum=o.momentum, scale=o.scale, **common)
    return SZOAdapt(model, o.subspace, method=method, lr=o.lr, mu=o.mu, momentum=o.momentum, q=o.q,
                    generator=o.generator, scale=o.scale, **common)
