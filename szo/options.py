"""The settings an optimizer is built with, typed: what ``szo.optim.build_optimizer`` takes.

:class:`OptimizerOptions` holds the method's hyperparameters (a recipe's ``train`` / ``szo`` /
``tt`` (the recipe section itself) / ``hw`` values, or a user's keywords); :class:`RunOptions` how the run executes (the
direction generator, torchrun mode, start point). The builders registered in
``szo.methods`` receive both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from szo.config import TTConfig

__all__ = ["OptimizerOptions", "RunOptions", "TTOptions", "IntegerLearnerOptions", "split_keywords"]


#: HybridZO's signRGE phase and its switch to CGE (seed 000; ``szo.optim.tt``): the recipe's ``tt``
#: section itself (validated, one set of defaults), whose model-side keys (rank, cores, min_params) the
#: optimizer ignores
TTOptions = TTConfig


@dataclass(frozen=True)
class IntegerLearnerOptions:
    """The integer on-chip learner (``szo.hw.train.OnChipSZO``): state widths and its XORShift32 seed."""

    basis_bits: int = 8
    coord_bits: int = 32
    coord_frac: int = 16
    ref_bits: int = 16
    seed: int = 1


@dataclass(frozen=True)
class OptimizerOptions:
    """A method's hyperparameters. ``None`` where a method has no use for the setting."""

    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    mu: float = 1.0
    q: int = 1
    coords_per_step: int | None = None
    engine: Literal["loop", "batched"] = "loop"
    chunk: int | None = None
    bn_update: Literal["recompute", "probe-mean"] = "recompute"
    scale: Literal["absolute", "trajectory", "whitened"] = "absolute"  # units of the subspace methods' mu / lr (szo.zo.scale)
    layers: tuple[str, ...] | None = None
    stages: int | None = None
    node_losses: Literal["per-sample", "batch-mean"] = "per-sample"
    tt: TTOptions = dataclasses.field(default_factory=TTOptions)
    integer: IntegerLearnerOptions | None = None  # set: train with the integer on-chip learner


@dataclass(frozen=True)
class RunOptions:
    """How the optimizer runs: its generator (directions), torchrun mode, where training starts."""

    generator: torch.Generator | None = None
    distributed: Literal["data", "perturbation"] | None = None
    sync_bn: bool = True
    process_group: Any = None
    start: Literal["reference", "current"] = "reference"


_OPTION_KEYS = {f.name for f in dataclasses.fields(OptimizerOptions)}
_RUN_KEYS = {f.name for f in dataclasses.fields(RunOptions)}


def split_keywords(kw: Mapping[str, Any]) -> tuple[OptimizerOptions, RunOptions]:
    """``build_optimizer``'s keywords into the two option records; one ValueError for an unknown
    keyword, naming the valid ones."""
    unknown = sorted(set(kw) - _OPTION_KEYS - _RUN_KEYS)
    if unknown:
        raise ValueError(f"build_optimizer got unknown keyword(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(sorted(_OPTION_KEYS | _RUN_KEYS))}")
    if "lr" not in kw:
        raise ValueError("build_optimizer needs lr=")
    opt = {k: v for k, v in kw.items() if k in _OPTION_KEYS}
    if isinstance(opt.get("tt"), Mapping):
        opt["tt"] = TTOptions(**opt["tt"])
    elif opt.get("tt") is None:
        opt.pop("tt", None)
    if isinstance(opt.get("integer"), Mapping):
        opt["integer"] = IntegerLearnerOptions(**opt["integer"])
    if opt.get("layers") is not None:
        opt["layers"] = tuple(opt["layers"])
    return OptimizerOptions(**opt), RunOptions(**{k: v for k, v in kw.items() if k in _RUN_KEYS})
