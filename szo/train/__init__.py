"""The trainer (``fit``), its callbacks and checkpoints."""
from szo.train.callbacks import Callback, MetricsLogger, TrajectoryCallback, read_metrics
from szo.train.checkpoint import checkpoint_from_bytes, checkpoint_path, load_checkpoint, save_checkpoint
from szo.train.trainer import evaluate, fit, summarize

__all__ = [
    "Callback", "MetricsLogger", "TrajectoryCallback", "read_metrics",
    "checkpoint_path", "load_checkpoint", "checkpoint_from_bytes", "save_checkpoint",
    "evaluate", "fit", "summarize",
]
