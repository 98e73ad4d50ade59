"""The trainer (``fit``), its callbacks and checkpoints."""
from szo.train.callbacks import Callback, MetricsLogger, TrajectoryCallback, read_metrics
from szo.train.checkpoint import (
    CheckpointError,
    checkpoint_from_bytes,
    checkpoint_path,
    checksum_path,
    load_checkpoint,
    read_checkpoint_bytes,
    save_checkpoint,
)
from szo.train.trainer import DIVERGE_FACTOR, TrainingDiverged, evaluate, fit, summarize

__all__ = [
    "Callback", "MetricsLogger", "TrajectoryCallback", "read_metrics",
    "checkpoint_path", "checksum_path", "load_checkpoint", "read_checkpoint_bytes", "checkpoint_from_bytes",
    "save_checkpoint", "CheckpointError",
    "evaluate", "fit", "summarize", "TrainingDiverged", "DIVERGE_FACTOR",
]
