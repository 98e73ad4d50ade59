"""Trainer callbacks.

Epoch convention everywhere: ``epoch`` is the number of *completed* epochs at that moment
(0 before training, 1 after the first epoch); ``step`` is the number of completed optimizer
steps since the start of the run (global, not per epoch).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from szo.io import atomic_write_text

try:  # the TensorBoard sink is optional (extra "log"): without tensorboard it says how to get it
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # pragma: no cover - exercised where tensorboard is missing
    SummaryWriter = None

__all__ = ["Callback", "MetricsLogger", "ResultFields", "TensorBoardSink", "TrajectoryCallback", "read_metrics"]


class Callback:
    """Base class; override what you need. Exceptions propagate (they stop training)."""

    def on_train_start(self, *, epoch: int, step: int, resumed: bool) -> None:
        """Before the first step (also after a resume: ``resumed=True``)."""

    def on_step_end(self, step: int, epoch: int, loss: float) -> None:
        """After each optimizer step."""

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        """After each epoch's evaluation; ``metrics`` is the metrics.jsonl record."""

    def on_train_end(self, summary: dict[str, Any]) -> None:
        """After the last epoch, with the results.json summary."""

    def results(self) -> dict[str, Any]:
        """Fields this callback adds to results.json (asked right before it is written: at the
        end of the run, or when it diverges)."""
        return {}


class ResultFields(Callback):
    """Adds ``fields()`` to results.json: what is known only after training (e.g. the integer
    forwards' saturation counts, when a hybrid optimizer switched phase)."""

    def __init__(self, fields: Callable[[], dict[str, Any]]):
        self.fields = fields

    def results(self) -> dict[str, Any]:
        return dict(self.fields())


class MetricsLogger(Callback):
    """Appends one JSON line per epoch to ``path`` (flush + fsync after each line)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def reset(self, records: Iterable[dict[str, Any]] = ()) -> None:
        """Atomically rewrite the file with ``records`` (a resumed run replays its history)."""
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        self.append(metrics)


class TensorBoardSink(Callback):
    """Every metrics.jsonl record as TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``,
    SpikingJelly's tutorials log the same way), one point per epoch at ``global_step = epoch``. A
    resumed run purges what an interrupted run wrote after its checkpoint (``purge_step``), so the
    curves and metrics.jsonl agree."""

    def __init__(self, log_dir: str | os.PathLike):
        if SummaryWriter is None:
            raise ValueError("log.tensorboard needs TensorBoard: pip install 'szo[log]' (tensorboard)")
        self.log_dir = Path(log_dir)
        self.writer: Any = None

    def on_train_start(self, *, epoch: int, step: int, resumed: bool) -> None:
        self.writer = SummaryWriter(str(self.log_dir), purge_step=epoch + 1 if resumed else None)

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        self.write(epoch, metrics)

    def write(self, global_step: int, metrics: dict[str, Any]) -> None:
        """The numeric values of one record as scalars at ``global_step``."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("epoch", "round"):
                self.writer.add_scalar(key, value, global_step)
        self.writer.flush()

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a torn last line from a crash is ignored)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


class TrajectoryCallback(Callback):
    """Feeds a ``szo.trajectory.TrajectoryRecorder`` (weight samples for the subspace).

    The initial sample is taken on a fresh start only; on resume the recorder's manifest
    already lists it.
    """

    def __init__(self, recorder: Any):
        self.recorder = recorder

    def on_train_start(self, *, epoch: int, step: int, resumed: bool) -> None:
        if not resumed:
            self.recorder.on_train_start()

    def on_step_end(self, step: int, epoch: int, loss: float) -> None:
        self.recorder.on_step_end(step, epoch)

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        self.recorder.on_epoch_end(epoch, step, test_acc=metrics.get("test_acc"))
