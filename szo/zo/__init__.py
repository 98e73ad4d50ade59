"""The forward-only core: every forward-only optimizer of szo is composed from these parts.

* **space** (``szo.zo.space``) -- which numbers move: :class:`ParamSpace` (all parameters, or
  one layer's), :class:`SubspaceSpace` (``theta_0 + P c``), :class:`NodeSpace` (a layer's
  pre-activations), :class:`HostSpace` (host coordinates, e.g. the integer learner's fixed point);
  the one place flat <-> tensors happens;
* **plan** (``szo.zo.plans``) -- which probes a step makes and how their losses combine: CGE,
  RGE, one-point, coordinate one-point; Gaussian and XORShift32 Rademacher directions;
* **low-rank directions** (``szo.zo.lowrank``) -- :class:`LayerFactors`: SubZero's and LOZO's per-layer
  ``U S V^T`` / ``U V^T`` perturbations of the matrix parameters, dense Gaussian blocks for the rest;
* **guard** (``szo.zo.guard``) -- what every probe needs around the closure (BN frozen or
  recomputed, neurons reset, first-step watch, loss check); the evaluators that run a step's probes
  (the loop, the batched engine, data- and perturbation-parallel, forward gradients) build on it in
  ``szo.evaluators``; which of them runs a step's probes, and every rule on combining engine,
  torchrun mode, synchronised BN, compile, CUDA graphs, streaming and backend, is one record:
  :class:`ProbePath` (``szo.zo.path``; ``szo.evaluators.build_evaluator`` builds the evaluator from it);
* **update** (``szo.zo.update``) -- :func:`heavy_ball_`, :func:`sign_descent_`, the integer rules,
  and :class:`StateCodec` for the state a checkpoint carries;
* **protocol** (``szo.zo.protocol``) -- :class:`ForwardOnlyOptimizer` and the per-step
  :class:`StepInfo` the trainer reads; :class:`ForwardOnlyBase` implements the common part.

The core depends on torch, SpikingJelly, ``szo.functional``, the method registry (``szo.methods``) and
``szo.precision`` (autocast's weight cache, ``fresh_casts``) only. docs/architecture.md shows
how the optimizers of ``szo.optim`` compose it and how to add a method.
"""
from .base import CleanForward, CodecOptimizer, ForwardOnlyBase, LayerwiseBase, refuse_meta, without_frozen
from .bn import BN_UPDATES, BNStatsFreezer, bn_layers, check_bn_update
from .guard import ProbeGuard, check_hparams, resolve_model, unname
from .lowrank import LOWRANK_FORMS, LayerFactors
from .path import ForwardSettings, ProbePath
from .plans import (
                    ESTIMATORS,
                    INTEGER_ESTIMATORS,
                    Coordinates,
                    Estimator,
                    Plan,
                    cge_plan,
                    coord_one_point_plan,
                    gaussian_rows,
                    get_estimator,
                    one_point_plan,
                    rademacher_rows,
                    rge_plan,
)
from .protocol import (
                    PROTOCOL_MEMBERS,
                    Batch,
                    ForwardOnlyOptimizer,
                    HasSubspace,
                    ReportsResults,
                    StepInfo,
                    is_forward_only,
)
from .space import (
                    LAYER_TYPES,
                    START_POINTS,
                    HostSpace,
                    NodeSpace,
                    ParamSpace,
                    Space,
                    Still,
                    SubspaceSpace,
                    adaptive_perturbation,
                    basis_fingerprint,
                    fingerprint_mismatch,
                    frozen,
                    move_to_start,
                    refuse_frozen,
                    refuse_shared_weights,
                    trainable_layers,
)
from .update import (
                    GENERATOR_COUNTERS,
                    Field,
                    StateCodec,
                    heavy_ball_,
                    integer_heavy_ball,
                    quantized_zo_update,
                    sign_descent_,
)

__all__ = [
    "BN_UPDATES", "BNStatsFreezer", "Batch", "CodecOptimizer", "Coordinates", "ESTIMATORS", "INTEGER_ESTIMATORS", "Estimator", "get_estimator", "Field", "ForwardOnlyBase", "LayerwiseBase", "CleanForward", "GENERATOR_COUNTERS", "ForwardOnlyOptimizer",
    "HasSubspace", "ReportsResults", "HostSpace", "PROTOCOL_MEMBERS", "is_forward_only", "NodeSpace", "ParamSpace", "Plan",
    "ProbeGuard", "START_POINTS", "Space", "StateCodec", "Still", "StepInfo", "SubspaceSpace", "bn_layers", "cge_plan",
    "check_bn_update", "check_hparams", "coord_one_point_plan", "gaussian_rows", "heavy_ball_",
    "integer_heavy_ball", "move_to_start", "one_point_plan", "quantized_zo_update",
    "rademacher_rows", "resolve_model", "unname", "rge_plan", "frozen", "refuse_frozen", "refuse_meta", "without_frozen", "refuse_shared_weights", "sign_descent_", "trainable_layers", "adaptive_perturbation", "LAYER_TYPES",
    "ProbePath", "ForwardSettings", "basis_fingerprint", "fingerprint_mismatch", "LOWRANK_FORMS", "LayerFactors",
]
