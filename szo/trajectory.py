"""Record a training trajectory (flat weight vectors) to disk, and read it back.

Directory format (version 1, see docs/architecture.md)::

    TRAJ_DIR/manifest.json
    TRAJ_DIR/sample_000000.safetensors      # one tensor "theta": float32 [d]

Every sample file is written atomically *before* the manifest that lists it; the manifest
is then rewritten atomically. A sample file that the manifest does not list is an
interrupted write: it is ignored by readers and overwritten when recording resumes.

The recorder works with any ``nn.Module``: the flat vector is ``named_parameters()`` order
(each parameter flattened row-major), the fingerprint is ``model.fingerprint()`` when the
model has one, else ``szo.layout.layout_fingerprint`` (the formula of
``SpikingModel.fingerprint``). Memory use is O(d): samples never stay in RAM.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from .io import atomic_save_safetensors, atomic_write_json, sha256_file, temp_file_target
from .layout import layout_fingerprint, layout_from_json, layout_mismatch, layout_to_json, param_layout

__all__ = [
    "TrajectoryRecorder",
    "Trajectory",
    "TrajectoryMismatchError",
    "TrajectoryIntegrityError",
    "parse_epoch_window",
    "planned_samples",
    "model_layout",
    "model_fingerprint",
    "FORMAT",
    "VERSION",
]

FORMAT = "szo-trajectory"
VERSION = 1
MANIFEST = "manifest.json"
SAMPLE_RE = re.compile(r"^sample_\d{6,}\.safetensors$")


class TrajectoryMismatchError(ValueError):
    """The trajectory directory belongs to another model / layout / format."""


class TrajectoryIntegrityError(ValueError):
    """A manifest or sample file is missing, truncated or does not match its sha256."""


# ----------------------------------------------------------------------------- helpers
model_layout = param_layout  # ``(name, shape)`` of every parameter in ``named_parameters()`` order


def model_fingerprint(model: nn.Module, model_name: str) -> str:
    """``model.fingerprint()`` if it exists, else ``layout_fingerprint(model_name, layout)``."""
    fp = getattr(model, "fingerprint", None)
    if callable(fp):
        return str(fp())
    return layout_fingerprint(model_name, param_layout(model))


def flat_vector(model: nn.Module) -> torch.Tensor:
    """A new float32 CPU vector ``[d]`` of the parameters in ``named_parameters()`` order."""
    parts = [p.detach().reshape(-1).to("cpu", torch.float32) for _, p in model.named_parameters()]
    if not parts:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(parts)


def parse_epoch_window(window: Any) -> tuple[int, int] | None:
    """``None``, ``(start, end)`` or ``"start-end"`` (inclusive) -> ``(start, end)`` or None."""
    if window is None:
        return None
    if isinstance(window, str):
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", window)
        if not m:
            raise ValueError(f"epoch window must look like 'START-END' (e.g. '80-100'), got {window!r}")
        start, end = int(m.group(1)), int(m.group(2))
    elif isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in window
    ):
        start, end = int(window[0]), int(window[1])
    else:
        raise ValueError(
            f"epoch window must be None, a (start, end) pair of ints or a 'START-END' string, got {window!r}"
        )
    if start < 0 or end < start:
        raise ValueError(f"epoch window needs 0 <= start <= end, got ({start}, {end})")
    return start, end


def planned_samples(epochs: int, steps_per_epoch: int, *, every: str | int = "epoch", record_initial: bool = True,
                    window: Any = None) -> int:
    """How many samples a :class:`TrajectoryRecorder` writes over ``epochs`` epochs of
    ``steps_per_epoch`` optimizer steps (the same rules as its callbacks: the initial weights
    as epoch 0, then every epoch end, or every ``every``-th global step, whose epoch is the
    number of epochs completed before it), counting only epochs inside ``window``."""
    w = parse_epoch_window(window)
    lo, hi = (0, epochs) if w is None else w  # the epochs inside the window, inclusive
    n = int(bool(record_initial) and lo <= 0 <= hi)
    if every == "epoch":  # one sample at the end of each epoch 1 .. epochs
        return n + max(0, min(epochs, hi) - max(1, lo) + 1)
    # steps e*spe+1 .. (e+1)*spe are recorded with epoch = e, every ``every``-th global step: epoch e adds
    # floor((e+1) spe / every) - floor(e spe / every), a sum over a run of epochs that telescopes (a
    # closed form: a count over 1e9 epochs costs nothing before the run starts)
    first, last = max(0, lo), min(epochs - 1, hi)
    if first > last:
        return n
    return n + (last + 1) * steps_per_epoch // every - first * steps_per_epoch // every


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TrajectoryIntegrityError(f"no trajectory manifest at {path}") from None
    try:
        man = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryIntegrityError(f"trajectory manifest {path} is not valid JSON ({e})") from None
    _validate_manifest(man, path)
    return man


def _validate_manifest(man: Any, path: Path) -> None:
    if not isinstance(man, dict):
        raise TrajectoryIntegrityError(f"trajectory manifest {path} must be a JSON object")
    if man.get("format") != FORMAT:
        raise TrajectoryMismatchError(f"{path}: format is {man.get('format')!r}, expected {FORMAT!r}")
    if man.get("version") != VERSION:
        raise TrajectoryMismatchError(f"{path}: version {man.get('version')!r} is not supported (supported: {VERSION})")
    required = {"model": str, "fingerprint": str, "d": int, "dtype": str, "layout": list, "samples": list}
    for key, typ in required.items():
        if not isinstance(man.get(key), typ):
            raise TrajectoryIntegrityError(f"{path}: field {key!r} missing or not a {typ.__name__}")
    for i, s in enumerate(man["samples"]):
        if not isinstance(s, dict) or not all(k in s for k in ("index", "file", "epoch", "step", "sha256")):
            raise TrajectoryIntegrityError(f"{path}: sample #{i} lacks index/file/epoch/step/sha256")
        if s["index"] != i or not isinstance(s["file"], str) or not SAMPLE_RE.match(s["file"]):
            raise TrajectoryIntegrityError(f"{path}: sample #{i} has a bad index or file name {s.get('file')!r}")


# ----------------------------------------------------------------------------- recorder
class TrajectoryRecorder:
    """Training-loop callback that writes flat weight vectors into a trajectory directory.

    Args:
        directory: the trajectory directory (created if missing; resumed if it has a manifest).
        model: any ``nn.Module``; the flat order is ``named_parameters()``.
        model_name: name stored in the manifest (default ``model.model_name`` or the class name).
        every: ``"epoch"`` (record in ``on_epoch_end``) or an int n (record in ``on_step_end``
            when ``step % n == 0``).
        epochs: optional inclusive epoch window ``(start, end)`` or ``"start-end"``; samples
            outside it are skipped (the initial weights too, unless epoch 0 is inside).
        record_initial: record the weights at ``on_train_start`` as epoch 0 / step 0.

    Epoch convention: ``on_epoch_end(epoch=e)`` is called with the number of completed
    epochs, so the initial weights are epoch 0 and the weights after the first epoch are 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        model: nn.Module,
        *,
        model_name: str | None = None,
        every: str | int = "epoch",
        epochs: Any = None,
        record_initial: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if every != "epoch" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be 'epoch' or a positive int (optimizer steps), got {every!r}")
        self.directory = Path(directory)
        self.model = model
        self.model_name = str(model_name or getattr(model, "model_name", None) or type(model).__name__)
        self.every = every
        self.window = parse_epoch_window(epochs)
        self.record_initial = bool(record_initial)
        self.layout = model_layout(model)
        self.d = sum(int(torch.Size(s).numel()) for _, s in self.layout)
        self.fingerprint = model_fingerprint(model, self.model_name)
        self._manifest = self._open_directory()
        self._recorded = {(int(s["epoch"]), int(s["step"])) for s in self._manifest["samples"]}

    # ---- directory handling
    def _fresh_manifest(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "d": self.d,
            "dtype": "float32",
            "layout": layout_to_json(self.layout),
            "samples": [],
        }

    def _open_directory(self) -> dict:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise TrajectoryMismatchError(f"trajectory path {d} exists and is not a directory")
        if not (d / MANIFEST).exists():
            if d.exists():
                others = sorted(p.name for p in d.iterdir() if not (_ours(p.name) or _ours(temp_file_target(p.name))))
                if others:
                    raise TrajectoryMismatchError(
                        f"{d} is not empty and has no {MANIFEST} (found {others[:5]}); "
                        "use an empty or new directory, or an existing trajectory directory"
                    )
            d.mkdir(parents=True, exist_ok=True)
            return self._fresh_manifest()
        man = _read_manifest(d)
        expected = self._fresh_manifest()
        for key in ("fingerprint", "model", "d", "dtype", "layout"):
            if man[key] != expected[key]:
                what = self._layout_diff(man["layout"]) if key in ("layout", "d", "fingerprint") else ""
                raise TrajectoryMismatchError(
                    f"trajectory directory {d} was recorded for another model: {key} is "
                    f"{_short(man[key])} there, {_short(expected[key])} for this model{what}. "
                    "Record into a new directory."
                )
        return man

    def _layout_diff(self, recorded: list) -> str:
        try:
            diff = layout_mismatch(recorded, self.layout, where=("there", "here"))
        except (KeyError, TypeError, ValueError):
            diff = "the recorded layout is malformed"
        return f" ({diff})" if diff else ""

    # ---- callbacks
    def _in_window(self, epoch: int) -> bool:
        return self.window is None or self.window[0] <= epoch <= self.window[1]

    def on_train_start(self, epoch: int = 0, step: int = 0) -> Path | None:
        """Record the initial weights (as ``epoch``/``step``) when ``record_initial``."""
        if not self.record_initial or not self._in_window(epoch):
            return None
        return self.record(epoch, step)

    def on_step_end(self, step: int, epoch: int) -> Path | None:
        """Record every ``every`` optimizer steps (only when ``every`` is an int)."""
        if self.every == "epoch" or step % self.every != 0 or not self._in_window(epoch):
            return None
        return self.record(epoch, step)

    def on_epoch_end(self, epoch: int, step: int, test_acc: float | None = None) -> Path | None:
        """Record after each epoch (only when ``every == "epoch"``)."""
        if self.every != "epoch" or not self._in_window(epoch):
            return None
        return self.record(epoch, step, test_acc)

    def record(self, epoch: int, step: int, test_acc: float | None = None) -> Path | None:
        """Write the current weights as a new sample; no-op (returns None) if (epoch, step) exists."""
        for name, v in (("epoch", epoch), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if (epoch, step) in self._recorded:
            return None
        theta = flat_vector(self.model)
        if theta.numel() != self.d:
            raise TrajectoryMismatchError(
                f"model now has d = {theta.numel()} parameters, the trajectory was started with d = {self.d}"
            )
        index = len(self._manifest["samples"])
        fname = f"sample_{index:06d}.safetensors"
        digest = atomic_save_safetensors(  # 1) the sample (overwrites an orphan)
            self.directory / fname, {"theta": theta},
            {"epoch": str(epoch), "step": str(step), "fingerprint": self.fingerprint})
        del theta
        entry: dict[str, Any] = {"index": index, "file": fname, "epoch": epoch, "step": step,
                                 "test_acc": None if test_acc is None else float(test_acc), "sha256": digest}
        samples = self._manifest["samples"]
        samples.append(entry)
        try:
            self._write_manifest()  # 2) then the manifest that lists it
        except BaseException:
            samples.pop()
            raise
        self._recorded.add((epoch, step))
        return self.directory / fname

    def _write_manifest(self) -> None:
        atomic_write_json(self.directory / MANIFEST, self._manifest)

    def __len__(self) -> int:
        return len(self._manifest["samples"])


def _ours(name: str | None) -> bool:
    """A sample file or the manifest (also the target of a temp file a kill left behind)."""
    return name is not None and (name == MANIFEST or SAMPLE_RE.match(name) is not None)


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


# ----------------------------------------------------------------------------- reader
class Trajectory:
    """Read-only view of a trajectory directory.

    ``traj[i]`` loads sample i as a float32 tensor ``[d]``; its sha256 is checked the first
    time it is read (``verify=True`` checks every file up front).
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = False) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise TrajectoryIntegrityError(f"trajectory directory {self.directory} does not exist")
        self.manifest = _read_manifest(self.directory)
        self._samples: list[dict] = list(self.manifest["samples"])
        self._verified: set[str] = set()
        if verify:
            self.verify()

    @classmethod
    def _subset(cls, parent: "Trajectory", samples: list[dict]) -> "Trajectory":
        t = cls.__new__(cls)
        t.directory, t.manifest, t._samples, t._verified = parent.directory, parent.manifest, samples, parent._verified
        return t

    @property
    def d(self) -> int:
        return int(self.manifest["d"])

    @property
    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        return layout_from_json(self.manifest["layout"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def model(self) -> str:
        return self.manifest["model"]

    @property
    def samples(self) -> list[dict]:
        """Metadata of the (selected) samples: index, file, epoch, step, test_acc, sha256."""
        return [dict(s) for s in self._samples]

    @property
    def epochs(self) -> list[int]:
        return [int(s["epoch"]) for s in self._samples]

    def path(self, i: int) -> Path:
        """Path of the file of (selected) sample i."""
        return self.directory / self._samples[self._index(i)]["file"]

    def _index(self, i: int) -> int:
        n = len(self._samples)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"sample index {i!r} out of range for a trajectory of {n} samples")
        return i % n

    def verify_sample(self, i: int) -> None:
        """Check sample i's file against the manifest sha256 (cached once verified)."""
        s = self._samples[self._index(i)]
        if s["file"] in self._verified:
            return
        p = self.directory / s["file"]
        if not p.exists():
            raise TrajectoryIntegrityError(f"sample file {p} listed in the manifest is missing")
        self._check_digest(s, sha256_file(p))

    def _check_digest(self, s: dict, got: str) -> None:
        if got != s["sha256"]:
            raise TrajectoryIntegrityError(
                f"sample file {self.directory / s['file']} is corrupt: sha256 {got[:16]}... does not match "
                f"the manifest's {s['sha256'][:16]}..."
            )
        self._verified.add(s["file"])

    def verify(self) -> None:
        """Check every (selected) sample file against its sha256."""
        for i in range(len(self)):
            self.verify_sample(i)

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        from safetensors.torch import load

        s = self._samples[self._index(i)]
        p = self.directory / s["file"]
        try:
            data = p.read_bytes()  # read once: hashed (first read only) and parsed from the same bytes
        except FileNotFoundError:
            raise TrajectoryIntegrityError(f"sample file {p} listed in the manifest is missing") from None
        if s["file"] not in self._verified:
            self._check_digest(s, hashlib.sha256(data).hexdigest())
        try:
            t = load(data)["theta"]
        except Exception as e:  # noqa: BLE001 - any parse failure is an integrity problem
            raise TrajectoryIntegrityError(f"cannot read sample file {p}: {e}") from None
        if t.dtype != torch.float32 or t.shape != (self.d,):
            raise TrajectoryIntegrityError(f"{p}: 'theta' is {t.dtype} {list(t.shape)}, expected float32 [{self.d}]")
        return t

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self[i]

    def select(self, window: Any) -> "Trajectory":
        """The samples whose epoch is inside the inclusive window ``(start, end)`` / ``"start-end"``."""
        w = parse_epoch_window(window)
        if w is None:
            return Trajectory._subset(self, list(self._samples))
        chosen = [s for s in self._samples if w[0] <= int(s["epoch"]) <= w[1]]
        if not chosen:
            raise ValueError(
                f"no samples of {self.directory} in epoch window {w[0]}-{w[1]}; "
                f"recorded epochs span {min(self.epochs, default='-')}-{max(self.epochs, default='-')}"
            )
        return Trajectory._subset(self, chosen)

    def __repr__(self) -> str:
        return f"Trajectory({str(self.directory)!r}, model={self.model!r}, N={len(self)}, d={self.d})"
