"""The trainer (``fit``), its callbacks and checkpoints."""
from szo.train.callbacks import Callback, MetricsLogger, ResultFields, TensorBoardSink, TrajectoryCallback, read_metrics
from szo.train.checkpoint import (
                                 CheckpointError,
                                 checkpoint_from_bytes,
                                 checkpoint_path,
                                 checksum_path,
                                 load_checkpoint,
                                 read_checkpoint_bytes,
                                 save_checkpoint,
)
from szo.train.trainer import (
                                 DIVERGE_FACTOR,
                                 FitOptions,
                                 RunState,
                                 StepStrategy,
                                 Trainer,
                                 TrainingDiverged,
                                 evaluate,
                                 evaluate_sums,
                                 fit,
                                 summarize,
)

__all__ = [
    "Callback", "MetricsLogger", "ResultFields", "TensorBoardSink", "TrajectoryCallback", "read_metrics",
    "checkpoint_path", "checksum_path", "load_checkpoint", "read_checkpoint_bytes", "checkpoint_from_bytes",
    "save_checkpoint", "CheckpointError",
    "evaluate", "evaluate_sums", "fit", "FitOptions", "Trainer", "RunState", "StepStrategy", "summarize",
    "TrainingDiverged", "DIVERGE_FACTOR",
]
