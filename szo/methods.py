"""The training methods and what each can do: the one table config validation, the optimizer
factory (``szo.optim.build_optimizer``) and the pipeline consult (no torch import here).

* ``bp``: full-space BPTT; ``bp-subspace``: BPTT gradient projected onto the subspace;
* ``szo-cge`` / ``szo-rge`` / ``szo-1pt``: subspace zeroth-order (paper eq. 5, App. F);
* ``zo-cge`` / ``zo-rge``: full-space zeroth-order baselines (DeepZero-style);
* ``fg`` / ``fg-subspace``: forward gradient (JVP, AsyncFGD seed 001), full space / subspace;
* ``asyncfgd``: AsyncFGD's K-stage pipeline iterates (stale stages, seed 001 Algorithm 1) in one
  process, ``szo.stages`` = K (``szo.optim.AsyncFGD``; the multi-process pipeline: ``szo.asyncfgd``);
* ``tt-zo``: zeroth-order in tensor-train factor space, signRGE-then-CGE (seed 000);
* ``np-zo`` / ``wp-zo`` / ``awp-zo``: layer-wise node / weight / adaptive weight-or-node perturbation
  (seed 004, Sec. 3.2; ``szo.optim.LayerwiseZO``), full space; ``szo.layers`` = sparse training;
* ``qzo``: quantized ZO (seed 004, eqs. 6 and 8): XORShift32 Rademacher forward differences and
  the integer update of eq. 8 on the on-chip learner (``szo.hw.train.OnChipSZO(rule="eq8")``),
  through the fixed-point forward.
"""
from __future__ import annotations

__all__ = ["METHODS", "SUBSPACE_METHODS", "SZO_METHODS", "BACKPROP_METHODS", "FORWARD_ONLY_METHODS", "FG_METHODS",
           "DISTRIBUTED_METHODS", "ENGINE_METHODS", "STREAMING_METHODS", "FIXED_BACKEND_METHODS", "INTEGER_LEARNER_METHODS",
           "LAYERWISE_METHODS", "QZO_METHODS"]

METHODS: tuple[str, ...] = ("bp", "bp-subspace", "szo-cge", "szo-rge", "szo-1pt", "zo-cge", "zo-rge")
METHODS += ("fg", "fg-subspace", "tt-zo")  # forward gradient (szo.optim.fg), tensor-train ZO (szo.optim.tt)
FG_METHODS: tuple[str, ...] = ("fg", "fg-subspace", "asyncfgd")  # forward-mode AD (JVP) passes
METHODS += ("asyncfgd",)
LAYERWISE_METHODS: dict[str, str] = {"np-zo": "node", "wp-zo": "weight", "awp-zo": "adaptive"}  # -> perturbation
QZO_METHODS: tuple[str, ...] = ("qzo",)
METHODS += tuple(LAYERWISE_METHODS) + QZO_METHODS
SZO_METHODS: tuple[str, ...] = ("szo-cge", "szo-rge", "szo-1pt")
SUBSPACE_METHODS: tuple[str, ...] = ("bp-subspace",) + SZO_METHODS + ("fg-subspace",)  # need a stored subspace
BACKPROP_METHODS: tuple[str, ...] = ("bp", "bp-subspace")
FORWARD_ONLY_METHODS: tuple[str, ...] = tuple(m for m in METHODS if m not in BACKPROP_METHODS)
# szo.time_chunk (streaming forward): not the forward-gradient methods, whose JVP through the exact
# streaming BN passes is wrong (the loss matches, the tangent does not: measured)
STREAMING_METHODS: tuple[str, ...] = tuple(m for m in FORWARD_ONLY_METHODS  # layer-wise: hooks see all T at once
                                            if m not in FG_METHODS + tuple(LAYERWISE_METHODS))
DISTRIBUTED_METHODS: tuple[str, ...] = SZO_METHODS  # torchrun: only probe losses cross the network
ENGINE_METHODS: tuple[str, ...] = SZO_METHODS  # szo.engine='batched' evaluates SZO probe plans
FIXED_BACKEND_METHODS: tuple[str, ...] = SZO_METHODS + QZO_METHODS  # training through the integer forward
INTEGER_LEARNER_METHODS: tuple[str, ...] = ("szo-cge", "szo-rge") + QZO_METHODS  # szo.hw.train.OnChipSZO
