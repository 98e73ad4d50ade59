"""The settings an optimizer is built with, typed: what ``szo.optim.build_optimizer`` takes.

:class:`OptimizerOptions` holds the method's hyperparameters. It *is* the recipe's sections, not a
copy of their fields: it derives from ``SZOConfig`` (``mu``, ``q``, ``engine``, ``scale``, ...) and
``StepConfig`` (``lr``, ``momentum``, ``weight_decay``: what a ``train`` section shares), so every
hyperparameter has one declaration, one default and one check, whether a recipe or a user's
keywords set it; ``tt`` is the recipe's tt section and ``integer`` the integer learner's widths
(``IntegerStateConfig``, the hw section's) with its seed. :class:`RunOptions` holds how the run
executes (the direction generator, torchrun mode, start point). The builders registered in
``szo.methods`` receive both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

from szo.config import IntegerStateConfig, StepConfig, SZOConfig, TTConfig
from szo.methods import MethodSpec
from szo.zo.path import ProbePath

__all__ = ["OptimizerOptions", "RunOptions", "TTOptions", "IntegerLearnerOptions", "split_keywords", "probe_path",
           "RUN_KEYWORDS"]


#: HybridZO's signRGE phase and its switch to CGE (seed 000; ``szo.optim.tt``): the recipe's ``tt``
#: section itself (validated, one set of defaults), whose model-side keys (rank, cores, min_params) the
#: optimizer ignores
TTOptions = TTConfig


@dataclass(frozen=True, eq=False)
class IntegerLearnerOptions(IntegerStateConfig):
    """The integer on-chip learner (``szo.hw.optim.onchip.OnChipSZO``): the hw section's state widths and its
    XORShift32 seed (a run's: ``seed % 0xFFFFFFFF + 1``)."""

    seed: int = field(default=1, metadata={"min": 1, "max": 0xFFFFFFFF})


@dataclass(frozen=True, eq=False)
class OptimizerOptions(SZOConfig, StepConfig):
    """A method's hyperparameters: the ``szo`` section's and the update's (``lr``, ``momentum``,
    ``weight_decay``), validated on construction like the recipe they come from. ``scale: None`` is
    the method's default (``MethodSpec.default_scale``), ``mu`` / ``lr: None`` the scale's
    (``default_mu`` / ``default_lr``); the model-side keys (``time_chunk``, ``stream_bn``)
    are the model's and refused as keywords. ``None`` elsewhere where a method has no use for the
    setting."""

    tt: TTConfig = field(default_factory=TTConfig)
    integer: IntegerLearnerOptions | None = None  # set: train with the integer on-chip learner


@dataclass(frozen=True)
class RunOptions:
    """How the optimizer runs: its generator (directions), torchrun mode, where training starts."""

    generator: torch.Generator | None = None
    distributed: Literal["data", "perturbation"] | None = None
    sync_bn: bool = True
    process_group: Any = None
    start: Literal["reference", "current"] = "reference"


_OPTION_KEYS = {f.name for f in dataclasses.fields(OptimizerOptions) if not f.metadata.get("model")}
_MODEL_KEYS = {f.name for f in dataclasses.fields(OptimizerOptions) if f.metadata.get("model")}
_RUN_KEYS = {f.name for f in dataclasses.fields(RunOptions)}
RUN_KEYWORDS: frozenset[str] = frozenset(_RUN_KEYS)
"""``build_optimizer``'s keywords that are :class:`RunOptions` fields (the others are :class:`OptimizerOptions`')."""


def split_keywords(kw: Mapping[str, Any]) -> tuple[OptimizerOptions, RunOptions]:
    """``build_optimizer``'s keywords into the two option records; one ValueError for an unknown
    keyword, naming the valid ones (or a model setting, naming where it goes)."""
    model_side = sorted(set(kw) & _MODEL_KEYS)
    if model_side:
        raise ValueError(f"{', '.join(model_side)}: a setting of the model, not of the optimizer (a recipe's "
                         f"szo.{model_side[0]} sets it on the model); leave it out of build_optimizer")
    unknown = sorted(set(kw) - _OPTION_KEYS - _RUN_KEYS)
    if unknown:
        raise ValueError(f"build_optimizer got unknown keyword(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(sorted(_OPTION_KEYS | _RUN_KEYS))}")
    opt = {k: v for k, v in kw.items() if k in _OPTION_KEYS}
    opt.setdefault("lr", None)  # not given: the method's default under its scale (build_optimizer)
    if isinstance(opt.get("tt"), Mapping) and not isinstance(opt["tt"], TTConfig):
        opt["tt"] = TTConfig(**opt["tt"])
    elif opt.get("tt") is None:
        opt.pop("tt", None)
    if isinstance(opt.get("integer"), Mapping) and not isinstance(opt["integer"], IntegerLearnerOptions):
        opt["integer"] = IntegerLearnerOptions(**opt["integer"])
    return OptimizerOptions(**opt), RunOptions(**{k: v for k, v in kw.items() if k in _RUN_KEYS})


def probe_path(o: OptimizerOptions, run: RunOptions, method: MethodSpec | None = None) -> ProbePath:
    """How the probes of an optimizer built from these records run (``szo.zo.ProbePath``): the engine
    and BN update of ``o``, the torchrun mode of ``run``, the method's record for its rules."""
    return ProbePath(engine=o.engine, chunk=o.chunk, bn_update=o.bn_update, distributed=run.distributed,
                     sync_bn=run.sync_bn, process_group=run.process_group, method=method)
