"""Optimizers: SZO (forward-only, in a trajectory subspace) and the paper's baselines.

>>> from szo.optim import SZO
>>> opt = SZO(model, subspace, mu=1.0, lr=1.0, momentum=0.9, estimator="cge")  # starts at subspace.reference
>>> loss = opt.step(lambda: loss_fn(model(x), y))
"""
from __future__ import annotations

import torch
from torch import nn

from szo.methods import DISTRIBUTED_METHODS, ENGINE_METHODS, LAYERWISE_METHODS, METHODS, QZO_METHODS, SUBSPACE_METHODS
from szo.models.tt import tt_layers
from szo.zo import BN_UPDATES, START_POINTS, BNStatsFreezer, ForwardOnlyOptimizer, StepInfo, bn_layers

from .fg import AsyncFGD, ForwardGradient, SubspaceForwardGradient
from .layerwise import LayerwiseZO
from .subspace import SZO, BPSubspace, SubspaceOptimizer, check_layout
from .tt import HybridZO
from .zo import FullSpaceZO

__all__ = [
    "SZO",
    "BPSubspace",
    "FullSpaceZO",
    "ForwardGradient",
    "SubspaceForwardGradient",
    "AsyncFGD",
    "HybridZO",
    "LayerwiseZO",
    "SubspaceOptimizer",
    "BNStatsFreezer",
    "bn_layers",
    "BN_UPDATES",
    "START_POINTS",
    "check_layout",
    "ForwardOnlyOptimizer",
    "StepInfo",
    "METHODS",
    "SUBSPACE_METHODS",
    "DISTRIBUTED_METHODS",
    "build_optimizer",
]



def build_optimizer(
    method: str,
    model: nn.Module,
    *,
    subspace=None,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    mu: float = 1.0,
    q: int = 1,
    coords_per_step: int | None = None,
    generator: torch.Generator | None = None,
    distributed: str | None = None,
    sync_bn: bool = True,
    engine: str = "loop",
    chunk: int | None = None,
    process_group=None,
    tt: dict | None = None,
    bn_update: str = "recompute",
    start: str = "reference",
    layers: list[str] | None = None,
    stages: int | None = None,
) -> torch.optim.Optimizer:
    """The optimizer for one of ``METHODS``; subspace methods need ``subspace``.

    ``distributed`` (``"data"`` | ``"perturbation"``, see ``SZO``) is supported by the
    forward-only subspace methods ``DISTRIBUTED_METHODS`` only.

    ``zo-cge`` perturbs ``coords_per_step`` random coordinates per step (default: the
    subspace's k when a subspace is given, so it spends the same 2k forwards per step as
    SZO-CGE, else all d coordinates).

    ``fg`` / ``fg-subspace`` (forward gradient, ``szo.optim.fg``) use ``q`` tangents per step;
    ``asyncfgd`` (:class:`AsyncFGD`) cuts the model into ``stages`` (default 2) pipeline stages and
    is plain SGD (``momentum`` must be 0), tangents seeded by ``generator.initial_seed()``.
    ``tt-zo`` needs a model whose large layers are TT-parameterised
    (``szo.models.tt.tt_parametrize``) and runs ``HybridZO`` on its parameters (the TT cores
    and the small dense tensors): ``mu`` / ``lr`` / ``momentum`` / ``coords_per_step`` are the
    CGE phase's, ``tt`` holds the signRGE phase and switch options (``sign_lr``, ``sign_q``,
    ``sign_mu``, ``window``, ``tol``, ``switch_step``).

    ``bn_update`` (``szo.zo.bn``): ``"recompute"`` or ``"probe-mean"``, for the ZO methods
    (``szo-*``, ``zo-*``, ``tt-zo``, ``np-zo`` / ``wp-zo`` / ``awp-zo``); the forward-gradient
    methods' JVP primal is itself an unperturbed forward of theta_t, which updates the statistics.
    ``start`` (subspace methods): ``"reference"`` moves the parameters to ``subspace.reference``
    (as ``SZO(model, subspace)`` does), ``"current"`` keeps them (test-time adaptation starts
    from the source model).
    ``np-zo`` / ``wp-zo`` / ``awp-zo`` (:class:`LayerwiseZO`) perturb the layers named in ``layers``
    (default: every linear / convolution layer), ``q`` probes per layer. ``qzo`` is the integer
    on-chip learner (``szo.hw.train.OnChipSZO(rule="eq8")``), built by the pipeline from the
    recipe's ``hw`` block.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if distributed is not None and method not in DISTRIBUTED_METHODS:
        raise ValueError(f"method {method!r} does not run on several processes; multi-process (torchrun) runs "
                         f"support: {', '.join(DISTRIBUTED_METHODS)}")
    if engine != "loop" and method not in ENGINE_METHODS:
        raise ValueError(f"engine {engine!r} applies to the SZO methods ({', '.join(ENGINE_METHODS)}); "
                         f"method {method!r} runs with engine 'loop'")
    if not isinstance(model, nn.Module):
        raise ValueError(f"build_optimizer needs the model (a torch.nn.Module), got {type(model).__name__}")
    if method in QZO_METHODS:
        raise ValueError(f"method {method!r} is the integer on-chip learner: build szo.hw.train.OnChipSZO(model, "
                         "subspace, rule='eq8', ...) (the pipeline does so from the recipe's hw block)")
    if method in LAYERWISE_METHODS:
        if weight_decay:
            raise ValueError(f"method {method!r} uses no weight decay; got weight_decay={weight_decay}")
        return LayerwiseZO(model, perturbation=LAYERWISE_METHODS[method], layers=layers, mu=mu, lr=lr,
                           momentum=momentum, q=q, generator=generator, bn_update=bn_update)
    params = list(model.parameters())
    if not params:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters to train")
    if method == "bp":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if method in SUBSPACE_METHODS:
        if subspace is None:
            raise ValueError(f"method {method!r} needs a subspace (build one with `szo subspace build`)")
        if weight_decay:
            raise ValueError(f"method {method!r} uses no weight decay (paper App. G); got weight_decay={weight_decay}")
        if method == "bp-subspace":
            return BPSubspace(model, subspace, lr=lr, momentum=momentum, start=start)
        if method == "fg-subspace":
            return SubspaceForwardGradient(params, subspace, model=model, lr=lr, momentum=momentum, q=q,
                                           generator=generator)
        estimator = {"szo-cge": "cge", "szo-rge": "rge", "szo-1pt": "one-point"}[method]
        return SZO(model, subspace, mu=mu, lr=lr, momentum=momentum, estimator=estimator, q=q,
                   generator=generator, distributed=distributed, sync_bn=sync_bn, process_group=process_group,
                   engine=engine, chunk=chunk, bn_update=bn_update, start=start)
    if stages is not None and method != "asyncfgd":
        raise ValueError(f"stages (pipeline stages) applies to method 'asyncfgd'; method {method!r} takes none")
    if method == "fg":
        return ForwardGradient(params, model=model, lr=lr, momentum=momentum, q=q, generator=generator)
    if method == "asyncfgd":
        if weight_decay:
            raise ValueError(f"method 'asyncfgd' uses no weight decay (seed 001, Algorithm 1); got weight_decay={weight_decay}")
        return AsyncFGD(model, stages=2 if stages is None else stages, lr=lr, momentum=momentum, generator=generator)
    if method == "tt-zo":
        if not tt_layers(model):
            raise ValueError("method 'tt-zo' trains TT cores: TT-parameterise the model first "
                             "(szo.models.tt.tt_parametrize(model, rank=...))")
        return HybridZO(params, lr=lr, momentum=momentum, mu=mu, coords_per_step=coords_per_step, model=model,
                        generator=generator, bn_update=bn_update, **dict(tt or {}))
    # full-space ZO
    if method == "zo-cge" and coords_per_step is None and subspace is not None:
        coords_per_step = int(subspace.basis.shape[1])
    return FullSpaceZO(model, estimator=method.split("-")[1], mu=mu, lr=lr, momentum=momentum, q=q,
                       coords_per_step=coords_per_step, generator=generator, bn_update=bn_update)
