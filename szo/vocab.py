"""The fixed choices of the recipe schema, torch-free: one home for each list of names.

``szo.schema`` reads its ``choices`` from here, so ``import szo.schema`` loads no torch; the modules
that implement a choice import its list from here too and re-export it under the name they always
had (``szo.zo.bn.BN_UPDATES``, ``szo.zo.scale.SCALES``, ...). Choices that a registry holds (model,
data set, loss names) are read from their registry when a value is checked (``szo.schema``).
"""
from __future__ import annotations

__all__ = ["ENGINES", "BN_UPDATES", "SCALES", "MEMORY_FORMATS", "ACTIVATIONS", "STREAM_BN_MODES", "BN_TIMES"]

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
