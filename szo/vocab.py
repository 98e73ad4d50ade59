"""The fixed choices of the recipe schema, torch-free: one home for each list of names.

``szo.schema`` reads its ``choices`` from here, so ``import szo.schema`` loads no torch; the modules
that implement a choice import its list from here too and re-export it under the name they always
had (``szo.zo.bn.BN_UPDATES``, ``szo.zo.scale.SCALES``, ...). Choices that a registry holds (model,
data set, loss names) are read from their registry when a value is checked (``szo.schema``).
"""
from __future__ import annotations

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "check_float32", "ENGINES", "BN_UPDATES", "SCALES", "MEMORY_FORMATS", "ACTIVATIONS", "STREAM_BN_MODES", "BN_TIMES"]

ENGINES: tuple[str, ...] = ("loop", "batched")
"""``loop``: ``szo.zo.LoopEvaluator``, one closure call per probe; ``batched``: ``szo.engine``'s folded forwards."""

BN_UPDATES: tuple[str, ...] = ("recompute", "probe-mean")
"""What a forward-only step does to the BN running statistics (``szo.zo.bn``)."""

SCALES: tuple[str, ...] = ("absolute", "trajectory", "whitened")
"""The units of a subspace method's mu and lr (``szo.zo.scale``)."""

MEMORY_FORMATS: tuple[str, ...] = ("auto", "channels_last", "contiguous")
"""The activations' layout of a szo model (``szo.models.base.SpikingModel.set_memory_format``)."""

ACTIVATIONS: tuple[str, ...] = ("lif", "relu")
"""The neurons of a szo model: LIF, or ReLU for the ANN twins (``szo.models.neurons``)."""

STREAM_BN_MODES: tuple[str, ...] = ("exact", "running", "chunk")
"""Policies for train-mode BatchNorm in a chunked forward (``szo.models.streaming``)."""

BN_TIMES: tuple[str, ...] = ("shared", "per-step")
"""BatchNorm over time (``szo.models.streaming.BatchNorm2d.bn_time``): one normalisation over the T*N
samples of a multi-step forward (``"shared"``) or one per time step (``"per-step"``)."""


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a float setting beyond it is finite in Python's float64 but not in the
float32 the model's forwards, probes and updates compute in (mu = 1e39 would overflow at the first probe)."""

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a nonzero float setting below it in magnitude is 0 or subnormal in the
float32 the arithmetic runs in (lr = 1e-50 trains nothing, and reports a completed run at chance)."""


def check_float32(key: str, v: object) -> None:
    """The one rule for a float setting at every door (a recipe's schema, ``build_optimizer``, the
    optimizers' constructors): finite in float32, and 0 or normal there (issue 49)."""
    if not isinstance(v, float) or v != v or v in (float("inf"), float("-inf")):
        return  # non-floats and non-finite values: the callers' own checks name them
    if abs(v) > FLOAT32_MAX:
        raise ValueError(f"'{key}' must be finite in float32, the arithmetic runs in it (|value| <= "
                         f"{FLOAT32_MAX:.4g}), got {v!r}")
    if v != 0.0 and abs(v) < FLOAT32_TINY:
        raise ValueError(f"'{key}' is 0 or subnormal in float32, the arithmetic runs in it (0 or |value| >= "
                         f"{FLOAT32_TINY:.4g}), got {v!r}")
