"""szo's registry as PyTorch ``OptimizerInfo`` records, for the generic optimizer bodies of
``tests/optim/test_torch_optim_bodies.py``.

PyTorch's own optimizer suite (``test/test_optim.py``, class ``TestOptimRenewed``) runs every
optimizer of ``torch.optim`` through one set of generic bodies, each driven by a
``torch.testing._internal.common_optimizers.OptimizerInfo``: the optimizer's class, its constructor
inputs, the LR schedulers to run it with, what it supports. Here every trainable method of
``szo.methods`` gets one: its ``optim_cls`` is :class:`Registered`, which builds the method with
``szo.optim.build_optimizer`` over the parameters a body gives it (a list of tensors, ``(name,
tensor)`` pairs or param-group dicts), the way a torch optimizer class is called.

``build_optimizer`` takes a model: :class:`Registered` puts the given tensors in a holder module
(an ``nn.Parameter`` is registered as it is, a plain tensor as a parameter sharing its storage),
builds the method on it with a random orthonormal subspace over its parameters where the method
trains in one (``start="current"``: the parameters stay where the body put them), then adds any
further param groups with ``add_param_group``. Named parameters keep their names as the groups'
``param_names``, as ``torch.optim.Optimizer`` keeps them (the optimizers' own named-parameter path,
``SZO(model.named_parameters(), ...)``, is pinned in ``test_torch_users.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from szo.methods import get_method, list_methods
from szo.optim import build_optimizer

__all__ = ["Registered", "INFOS", "K", "holder_of", "OptimizerInfo", "OptimizerInput", "ErrorOptimizerInput",
           "OptimizerErrorEnum"]


# The records of torch.testing._internal.common_optimizers, with the fields the bodies read. That module is not
# imported: importing it imports torch's test harness (common_utils), which calls
# torch.backends.disable_global_flags() for the whole process -- every later test of the session would run
# under PyTorch's own suite's flag lock -- and needs the expecttest package.
class OptimizerErrorEnum(Enum):
    CONSTRUCTION_ERROR = 0
    STEP_ERROR = 1


@dataclass
class OptimizerInput:
    params: Any
    kwargs: dict
    desc: str = ""


@dataclass
class ErrorOptimizerInput:
    optimizer_error_input: OptimizerInput
    error_on: OptimizerErrorEnum = OptimizerErrorEnum.CONSTRUCTION_ERROR
    error_type: type = RuntimeError
    error_regex: str = ""


@dataclass
class OptimizerInfo:
    optim_cls: Any
    optim_inputs_func: Callable
    scheduler_inputs: tuple = ()
    supported_impls: tuple = ()
    not_og_supported_flags: tuple = ()
    supports_sparse: bool = False
    only_supports_sparse_grads: bool = False
    supports_complex: bool = True
    step_requires_closure: bool = False
    supports_param_groups: bool = True
    optim_error_inputs_func: Callable | None = None
    skips: tuple = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.optim_cls.__name__

K = 4  # the subspace dimension of the subspace methods (at most d)

#: per method: the settings its bodies run at (small steps on the bodies' quadratic, CPU, float32)
SETTINGS: dict[str, dict[str, Any]] = {
    "bp": dict(lr=1e-3, momentum=0.0, weight_decay=0.0),
    "bp-subspace": dict(lr=1e-3, momentum=0.0, scale="absolute"),
    "zo-cge": dict(lr=1e-3, mu=1e-3, momentum=0.0),
    "zo-rge": dict(lr=1e-3, mu=1e-3, momentum=0.0, q=4),
    "fg": dict(lr=1e-3, momentum=0.0, q=2),
    "fg-subspace": dict(lr=1e-3, momentum=0.0, q=2, scale="absolute"),
    "asyncfgd": dict(lr=1e-3, momentum=0.0),
    "asyncfgd-adam": dict(lr=1e-3, momentum=0.0),
    # the bodies' batch of 1 image: the batch-mean form (per-sample node losses need a [T, N, ...] batch axis)
    "np-zo": dict(lr=1e-3, mu=1e-3, momentum=0.0, node_losses="batch-mean"),
    "wp-zo": dict(lr=1e-3, mu=1e-3, momentum=0.0),
    "awp-zo": dict(lr=1e-3, mu=1e-3, momentum=0.0),
}
for _m in ("subzero", "lozo", "lozo-m"):  # LOZO takes no momentum; LOZO-M's beta 0: its plain form
    SETTINGS[_m] = dict(lr=1e-3, mu=1e-3, momentum=0.0)
for _m in ("szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt"):
    SETTINGS[_m] = dict(lr=1e-3, mu=1e-3, momentum=0.0, q=4, scale="absolute")


def _tensors(params: Any) -> tuple[list[dict], bool]:
    """The body's params as groups ``[{"params": [tensors], "names": [...] | None, **options}]``."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [dict(g) for g in params]
    else:
        groups = [{"params": params}]
    named = False
    for g in groups:
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if ps and isinstance(ps[0], tuple):
            named = True
            g["names"] = [n for n, _ in ps]
            ps = [p for _, p in ps]
        g["params"] = ps
    return groups, named


def holder_of(tensors: list[torch.Tensor]) -> nn.Module:
    """A module whose parameters are ``tensors``, in order (a plain tensor as a parameter sharing its storage)."""
    holder = nn.Module()
    for i, t in enumerate(tensors):
        p = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.requires_grad)
        holder.register_parameter(f"p{i}", p)
    return holder


def random_subspace(model: nn.Module, k: int = K, *, through_origin: bool = False) -> SimpleNamespace:
    """An orthonormal ``[d, min(k, d)]`` basis over the model's parameters, its reference where they are;
    ``through_origin``: the reference 0, so every optimizer over equal shapes gets the same subspace (a
    state is bound to its basis and reference point, issue 49; the bodies build a second optimizer over
    equal parameters and load the first one's state; they keep the parameters where they are,
    ``start="current"``)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()
    g = torch.Generator().manual_seed(1)
    k = max(1, min(k, flat.numel()))
    basis = torch.linalg.qr(torch.randn(flat.numel(), k, generator=g, dtype=torch.float64))[0].float()
    reference = torch.zeros_like(flat) if through_origin else flat.clone()
    return SimpleNamespace(basis=basis, layout=None, reference=reference, eigenvalues=torch.ones(k))


class Registered:
    """``optim_cls`` of a registered method: ``Registered("szo-cge")(params, lr=...)`` builds it with
    ``build_optimizer`` over ``params`` (tensors, named pairs or param groups), a torch optimizer's call."""

    def __init__(self, method: str):
        self.method = method
        self.__name__ = self.__qualname__ = method
        self.spec = get_method(method)

    def __repr__(self) -> str:
        return f"Registered({self.method!r})"

    def build_on(self, model: nn.Module, **kwargs) -> torch.optim.Optimizer:
        """The method on ``model`` (all its parameters) with the bodies' settings updated by ``kwargs``."""
        kw = dict(SETTINGS.get(self.method, {}))
        kw.update(kwargs)
        if self.spec.forward_only:
            kw["generator"] = torch.Generator().manual_seed(0)
        if self.spec.subspace:
            kw["start"] = "current"
        if self.method == "bp":  # torch's SGD: the foreach kernels refuse a tensor lr; keep the loop
            kw["foreach"] = False
            return torch.optim.SGD(model.parameters(), **{k: v for k, v in kw.items() if k != "generator"})
        return build_optimizer(self.method, model,
                               subspace=random_subspace(model, through_origin=True) if self.spec.subspace else None,
                               **kw)

    def __call__(self, params: Any, **kwargs) -> torch.optim.Optimizer:
        groups, named = _tensors(params)
        holder = holder_of(groups[0]["params"])
        # the constructor's keywords are the optimizer's defaults; a group's own options are that group's
        opt = self.build_on(holder, **kwargs)
        opt.param_groups[0].update({k: v for k, v in groups[0].items() if k not in ("params", "names")})
        ordered = [list(holder.parameters())]
        for g in groups[1:]:
            ps = [t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.requires_grad)
                  for t in g["params"]]
            ordered.append(ps)
            opt.add_param_group({"params": ps, **{k: v for k, v in g.items() if k not in ("params", "names")}})
        if named:  # what torch's add_param_group keeps for named parameters (the groups' trained ones)
            for og, g, ps in zip(opt.param_groups, groups, ordered):
                name = {id(p): n for n, p in zip(g["names"], ps)}
                og["param_names"] = [name[id(p)] for p in og["params"]]
        return opt


def _inputs(method: str):
    def optim_inputs_func(device=None, dtype=None):
        return [OptimizerInput(params=None, kwargs={}, desc="default"),
                OptimizerInput(params=None, kwargs={"momentum": 0.5}, desc="momentum")
                if get_method(method).momentum else OptimizerInput(params=None, kwargs={"lr": 2e-3}, desc="lr")]
    return optim_inputs_func


def _errors(method: str):
    def optim_error_inputs_func(device=None, dtype=None):
        out = [ErrorOptimizerInput(OptimizerInput(params=None, kwargs={"lr": -1.0}, desc="negative lr"),
                                   error_type=ValueError, error_regex="(?i)learning rate|lr")]
        if get_method(method).momentum and method != "bp":
            out.append(ErrorOptimizerInput(OptimizerInput(params=None, kwargs={"momentum": 1.5}, desc="momentum >= 1"),
                                           error_type=ValueError, error_regex="momentum"))
        return out
    return optim_error_inputs_func


def _info(method: str) -> OptimizerInfo:
    spec = get_method(method)
    return OptimizerInfo(
        optim_cls=Registered(method),
        optim_inputs_func=_inputs(method),
        optim_error_inputs_func=_errors(method),
        scheduler_inputs=([lambda opt: StepLR(opt, gamma=0.9, step_size=10)], [lambda opt: ReduceLROnPlateau(opt)]),
        supported_impls=(),
        not_og_supported_flags=(),
        supports_sparse=method in ("bp", "bp-subspace"),
        supports_complex=False,
        step_requires_closure=spec.forward_only,
        supports_param_groups=True,
        skips=(),
    )


#: method -> its OptimizerInfo, every trainable method of the registry
INFOS: dict[str, OptimizerInfo] = {m: _info(m) for m in list_methods()}
