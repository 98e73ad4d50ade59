"""Trainer callbacks.

Epoch convention everywhere: ``epoch`` is the number of *completed* epochs at that moment
(0 before training, 1 after the first epoch); ``step`` is the number of completed optimizer
steps since the start of the run (global, not per epoch).
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from szo.io import atomic_write_text

try:  # the TensorBoard sink is optional (extra "log"): without tensorboard it says how to get it
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.summary.writer.record_writer import RecordWriter
    from torch.utils.tensorboard.summary import scalar as scalar_summary
except ImportError:  # pragma: no cover - exercised where tensorboard is missing
    RecordWriter = None

__all__ = ["Callback", "MetricsLogger", "ResultFields", "TensorBoardSink", "TrajectoryCallback", "parse_metrics",
           "read_metrics"]


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


_EVENT_FILE_IDS = itertools.count()  # two sinks of one process in one second get two files


class TensorBoardSink(Callback):
    """Every metrics.jsonl record as TensorBoard scalars, one point per epoch at ``global_step =
    epoch``: the event file ``torch.utils.tensorboard.SummaryWriter`` writes (its scalar summaries,
    tensorboard's record framing; SpikingJelly's tutorials log the same way), written in the training
    thread and flushed after each record. A resumed run purges what an interrupted run wrote after
    its checkpoint (SummaryWriter's ``purge_step`` events), so the curves and metrics.jsonl agree.

    A sink is not the run's record (metrics.jsonl and results.json are): when the event file cannot
    be written (``RUN_DIR/tensorboard`` is a file, the disk is full, ...) the sink warns once on
    stderr, stops writing, and results.json says why in ``tensorboard_error``; training goes on.
    SummaryWriter itself is not used because it writes from a background thread, whose failure
    printed a thread traceback and then raised from the next ``add_scalar`` in the middle of training.
    """

    def __init__(self, log_dir: str | os.PathLike):
        if RecordWriter is None:
            raise ValueError("log.tensorboard needs TensorBoard: pip install 'szo[log]' (tensorboard)")
        self.log_dir = Path(log_dir)
        self.error: str | None = None  # why the sink stopped writing, None while it writes
        self._file: Any = None
        self._records: Any = None

    def on_train_start(self, *, epoch: int, step: int, resumed: bool) -> None:
        self._guarded(self._open, epoch + 1 if resumed else None)

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        self.write(epoch, metrics)

    def write(self, global_step: int, metrics: dict[str, Any]) -> None:
        """The numeric values of one record as scalars at ``global_step`` (nothing once disabled)."""
        if self._file is not None:
            self._guarded(self._write, global_step, metrics)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if self._file is not None:
            self._guarded(self._close)

    def results(self) -> dict[str, Any]:
        return {} if self.error is None else {"tensorboard_error": self.error}

    def _open(self, purge_step: int | None) -> None:
        if self.log_dir.exists() and not self.log_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_EVENT_FILE_IDS)}")
        self._file = open(self.log_dir / name, "wb")
        self._records = RecordWriter(self._file)
        self._event(Event(file_version="brain.Event:2"))
        if purge_step is not None:  # what SummaryWriter(purge_step=...) writes: later steps are hidden
            self._event(Event(step=purge_step, file_version="brain.Event:2"))
            self._event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._file.flush()

    def _event(self, event: Any) -> None:
        event.wall_time = time.time()
        self._records.write(event.SerializeToString())

    def _write(self, global_step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("epoch", "round"):
                self._event(Event(step=global_step, summary=scalar_summary(key, value)))
        self._file.flush()

    def _close(self) -> None:
        f, self._file = self._file, None
        f.close()

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``; an OSError disables the sink with one warning line."""
        try:
            fn(*args)
        except OSError as e:
            self.error = f"{self.log_dir}: {e.strerror or e}"
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()  # flushing the rest may fail the same way
                self._file = None
            sys.stderr.write(f"warning: TensorBoard sink disabled ({self.error}); training goes on, "
                             "metrics.jsonl keeps every record\n")
            sys.stderr.flush()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a torn last line from a crash is ignored)."""
    with open(path, encoding="utf-8") as f:
        return parse_metrics(f)


def parse_metrics(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The records of metrics.jsonl lines; reading stops at a torn (unparsable) line."""
    out = []
    for line in lines:
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
