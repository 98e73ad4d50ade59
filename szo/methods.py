"""The training methods and what each can do: the one table config validation, the optimizer
factory (``szo.optim.build_optimizer``) and the pipeline consult (no torch import here).

* ``bp``: full-space BPTT; ``bp-subspace``: BPTT gradient projected onto the subspace;
* ``szo-cge`` / ``szo-rge`` / ``szo-1pt``: subspace zeroth-order (paper eq. 5, App. F);
* ``zo-cge`` / ``zo-rge``: full-space zeroth-order baselines (DeepZero-style);
* ``fg`` / ``fg-subspace``: forward gradient (JVP, AsyncFGD seed 001), full space / subspace;
* ``tt-zo``: zeroth-order in tensor-train factor space, signRGE-then-CGE (seed 000).
"""
from __future__ import annotations

__all__ = ["METHODS", "SUBSPACE_METHODS", "SZO_METHODS", "BACKPROP_METHODS", "FORWARD_ONLY_METHODS",
           "DISTRIBUTED_METHODS", "ENGINE_METHODS", "STREAMING_METHODS", "FIXED_BACKEND_METHODS", "INTEGER_LEARNER_METHODS"]

METHODS: tuple[str, ...] = ("bp", "bp-subspace", "szo-cge", "szo-rge", "szo-1pt", "zo-cge", "zo-rge")
METHODS += ("fg", "fg-subspace", "tt-zo")  # forward gradient (szo.optim.fg), tensor-train ZO (szo.optim.tt)
SZO_METHODS: tuple[str, ...] = ("szo-cge", "szo-rge", "szo-1pt")
SUBSPACE_METHODS: tuple[str, ...] = ("bp-subspace",) + SZO_METHODS + ("fg-subspace",)  # need a stored subspace
BACKPROP_METHODS: tuple[str, ...] = ("bp", "bp-subspace")
FORWARD_ONLY_METHODS: tuple[str, ...] = tuple(m for m in METHODS if m not in BACKPROP_METHODS)
# szo.time_chunk (streaming forward): not the forward-gradient methods, whose JVP through the exact
# streaming BN passes is wrong (the loss matches, the tangent does not: measured)
STREAMING_METHODS: tuple[str, ...] = tuple(m for m in FORWARD_ONLY_METHODS if m not in ("fg", "fg-subspace"))
DISTRIBUTED_METHODS: tuple[str, ...] = SZO_METHODS  # torchrun: only probe losses cross the network
ENGINE_METHODS: tuple[str, ...] = SZO_METHODS  # szo.engine='batched' evaluates SZO probe plans
FIXED_BACKEND_METHODS: tuple[str, ...] = SZO_METHODS  # training through the integer forward
INTEGER_LEARNER_METHODS: tuple[str, ...] = ("szo-cge", "szo-rge")  # szo.hw.train.OnChipSZO estimators
