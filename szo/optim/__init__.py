"""Optimizers: SZO (forward-only, in a trajectory subspace) and the paper's baselines.

>>> from szo.optim import SZO
>>> opt = SZO(model, subspace, momentum=0.9, estimator="cge")  # starts at subspace.reference; mu 0.3 / lr 0.03
>>> paper = SZO(model, subspace, scale="absolute")  # the paper's units: mu 1.0, lr 1.0 (App. G)
>>> loss = opt.step(lambda: loss_fn(model(x), y))

``build_optimizer(method, model, ...)`` builds any registered method (``szo.methods``) with the
builder its module registered; importing this package registers all of them (the integer
on-chip learner's comes from ``szo.hw.optim.onchip``).
"""
from __future__ import annotations

import torch
from torch import nn

from szo.hw.optim.mcu import MCUZO
from szo.hw.optim.onchip import OnChipSZO
from szo.methods import METHOD_OPTIONS, METHODS, SUBSPACE_METHODS, get_method, register_builder, step_defaults
from szo.options import (
    RUN_KEYWORDS,
    IntegerLearnerOptions,
    OptimizerOptions,
    RunOptions,
    TTOptions,
    probe_path,
    split_keywords,
)
from szo.schema import DEFAULT_Q
from szo.zo import BN_UPDATES, START_POINTS, BNStatsFreezer, ForwardOnlyOptimizer, ProbePath, StepInfo, bn_layers

from .fg import AsyncFGD, ForwardGradient, SubspaceForwardGradient
from .fullspace import FullSpaceZO
from .layerwise import LayerwiseZO
from .lowrank import LowRankZO
from .subspace import SZO, BPSubspace, Kept, Refreshed, SubspaceOptimizer, SubspacePolicy, check_layout
from .tt import HybridZO

__all__ = [
    "SZO",
    "Refreshed",
    "Kept",
    "SubspacePolicy",
    "BPSubspace",
    "FullSpaceZO",
    "ForwardGradient",
    "SubspaceForwardGradient",
    "AsyncFGD",
    "HybridZO",
    "LayerwiseZO",
    "LowRankZO",
    "OnChipSZO",
    "MCUZO",
    "SubspaceOptimizer",
    "BNStatsFreezer",
    "bn_layers",
    "BN_UPDATES",
    "START_POINTS",
    "check_layout",
    "ForwardOnlyOptimizer",
    "StepInfo",
    "OptimizerOptions",
    "RunOptions",
    "ProbePath",
    "TTOptions",
    "IntegerLearnerOptions",
    "METHODS",
    "SUBSPACE_METHODS",
    "build_optimizer",
]


@register_builder("bp")
def build_bp(spec, model: nn.Module, subspace, o: OptimizerOptions, run: RunOptions) -> torch.optim.Optimizer:
    """Full-space BPTT: ``torch.optim.SGD`` with momentum and weight decay."""
    return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def _check(spec, model, subspace, o: OptimizerOptions, run: RunOptions) -> None:
    """What the registry says a method can take, checked once for every method."""
    m = spec.name
    spec.check_capabilities(weight_decay=o.weight_decay, momentum=o.momentum)
    probe_path(o, run, spec).on(model).check()
    if not isinstance(model, nn.Module):
        raise ValueError(f"build_optimizer needs the model (a torch.nn.Module), got {type(model).__name__}")
    if not list(model.parameters()):
        raise ValueError(f"the model ({type(model).__name__}) has no parameters to train")
    if spec.subspace and subspace is None:
        raise ValueError(f"method {m!r} needs a subspace (build one with `szo subspace build`)")
    spec.check_options({key: getattr(o, key) for key in METHOD_OPTIONS})
    spec.check_learner(integer=o.integer is not None, refresh=o.refresh)  # the rules a recipe's hw.learner meets
    if isinstance(subspace, Refreshed) and ("refresh" not in spec.options or o.integer is not None):
        takes = ", ".join(n for n in METHODS if "refresh" in get_method(n).options)
        raise ValueError(f"a Refreshed subspace (a basis redrawn every few steps) is trained by the float learner of "
                         f"{takes}; method {m!r}{' with the integer learner' if o.integer is not None else ''} "
                         f"does not redraw a basis: pass Refreshed(...).subspace{'' if spec.subspace else ', or none'}")


def _records(options: OptimizerOptions | None, run: RunOptions | None, keywords: dict
             ) -> tuple[OptimizerOptions, RunOptions]:
    """The two option records from ``build_optimizer``'s arguments: a record given is used as it is,
    one not given comes from the keywords of its fields (its defaults without them). A keyword of a
    record that was given as well is refused in one line: which one was meant is not known."""
    kw_options, kw_run = split_keywords(keywords)
    both = sorted(k for k in keywords if (options is not None and k not in RUN_KEYWORDS)
                  or (run is not None and k in RUN_KEYWORDS))
    if both:
        given = "options=" if options is not None and both[0] not in RUN_KEYWORDS else "run="
        raise ValueError(f"build_optimizer got {given} and the keyword(s) {', '.join(both)} of that record; set "
                         f"them in the record (record.replace(...)) or give keywords only")
    return (kw_options if options is None else options), (kw_run if run is None else run)


def build_optimizer(method: str, model: nn.Module, *, subspace=None, options: OptimizerOptions | None = None,
                    run: RunOptions | None = None, **keywords) -> torch.optim.Optimizer:
    """The optimizer of a registered method (``szo.methods``); subspace methods need ``subspace``.

    Settings come as ``options`` / ``run`` records (:class:`OptimizerOptions`,
    :class:`RunOptions`) or as keywords of their fields (``lr=``, ``momentum=``, ``mu=``,
    ``q=``, ``coords_per_step=``, ``engine=``, ``chunk=``, ``bn_update=``, ``layers=``,
    ``stages=``, ``tt=``, ``integer=``, ``weight_decay=``; ``generator=``, ``distributed=``,
    ``sync_bn=``, ``process_group=``, ``start=``): a record given is used as it is, one not given is
    built from the keywords of its fields (``run=RunOptions(generator=g), lr=0.1`` sets both), and a
    keyword of a record that was also given is refused. ``scale`` (``szo.zo.scale``) left unset is
    the method's default (``trajectory`` for the subspace methods with relative defaults, else
    ``absolute``), and ``mu`` / ``lr`` left unset the scale's: ``build_optimizer("szo-cge", model,
    subspace=sub)`` probes 0.3 and steps 0.03 of the subspace's spread; the paper's procedure is
    ``scale="absolute", mu=1.0, lr=1.0`` (App. G). A relative scale where the method has no relative
    defaults (zo-cge, fg, np-zo, ...) or for the integer learner is refused, as a recipe's is
    (``MethodSpec.check_scale``).

    ``distributed`` (``"data"`` | ``"perturbation"``, see ``SZO``) is supported by the methods
    whose record lists it (the SZO methods). ``zo-cge`` perturbs ``coords_per_step`` random
    coordinates per step (default: the subspace's k when a subspace is given, so it spends the
    same 2k forwards per step as SZO-CGE, else all d coordinates). ``fg`` / ``fg-subspace`` use
    ``q`` tangents per step; ``asyncfgd`` cuts the model into ``stages`` (default 2) pipeline
    stages and is plain SGD (``momentum`` must be 0). ``tt-zo`` needs a TT-parameterised model
    (``szo.models.tt.tt_parametrize``); ``tt`` holds its signRGE phase and switch. ``bn_update``:
    ``"recompute"`` or ``"probe-mean"`` (``szo.zo.bn``). ``start`` (subspace methods):
    ``"reference"`` moves the parameters to ``subspace.reference``, ``"current"`` keeps them.
    ``np-zo`` / ``wp-zo`` / ``awp-zo`` perturb the layers named in ``layers`` (default: every
    linear / convolution layer). ``integer`` (:class:`IntegerLearnerOptions`) trains
    ``szo-cge`` / ``szo-rge`` / ``qzo-subspace`` with the integer on-chip learner
    (``szo.hw.optim.onchip.OnChipSZO``; ``qzo-subspace``: seed 004's eq. 8 on SZO's coordinates), ``mu`` in
    coordinate units; ``mcu-zo`` is seed 004's own learner on the int8 weights (``szo.hw.optim.mcu.MCUZO``).
    """
    spec = get_method(method, trainable=True)
    options, run = _records(options, run, keywords)
    if spec.integer and options.integer is None:
        options = options.replace(integer=IntegerLearnerOptions())
    spec.check_scale(options.scale, integer=options.integer is not None)
    # the defaults SZO(...) takes too (szo.methods.step_defaults): trajectory, then the scale's mu / lr
    scale, mu, lr = step_defaults([spec.name], options.scale, options.mu, options.lr,
                                  integer=options.integer is not None)
    if lr is None:
        raise ValueError(f"build_optimizer needs lr= for method {method!r} (full-space backprop has no default step)")
    options = options.replace(scale=scale, mu=mu, lr=lr, q=DEFAULT_Q["train"] if options.q is None else options.q)
    _check(spec, model, subspace, options, run)
    return spec.builder(integer=options.integer is not None)(spec, model, subspace, options, run)
