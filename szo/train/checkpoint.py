"""Training checkpoints: plain dicts of tensors / numbers / strings, written atomically,
read back with ``torch.load(weights_only=True)`` (nothing is unpickled), checksummed.

``run_dir/checkpoints/last.pt`` is the checkpoint; ``run_dir/checkpoints/last.json`` its
checksum record (``sha256``, ``bytes``, and the same for the ``previous`` file, plus the
method / optimizer that wrote it). The record is written (atomically) *before* the new
checkpoint replaces the old one, so a kill between the two writes leaves the previous
checkpoint, whose sha256 the record still lists; a file matching neither sha256 was changed
by something else and is refused. Every unreadable case (missing record, empty, truncated,
random bytes, another kind of file, a tampered byte) is one :class:`CheckpointError` line.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from szo.io import atomic_write_bytes, atomic_write_json

__all__ = ["CHECKPOINT_NAME", "CHECKSUM_NAME", "CheckpointError", "checkpoint_path", "checksum_path",
           "save_checkpoint", "load_checkpoint", "read_checkpoint_bytes", "checkpoint_from_bytes",
           "CHECKPOINT_VERSION"]

CHECKPOINT_VERSION = 2  # 2: sha256 record next to the file, writer's method / optimizer inside
CHECKPOINT_NAME = "last.pt"
CHECKSUM_NAME = "last.json"
_RECORD_FORMAT = "szo-checkpoint-sha256"
_HINT = "restore the file, or start again in a new run directory (another --out)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or read (one line: which file, what is wrong)."""


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """``run_dir/checkpoints/last.pt``: the one rolling checkpoint of a run."""
    return Path(run_dir) / "checkpoints" / CHECKPOINT_NAME


def checksum_path(ckpt: str | os.PathLike) -> Path:
    """The sha256 record of checkpoint ``ckpt`` (``last.pt`` -> ``last.json``)."""
    ckpt = Path(ckpt)
    return ckpt.with_name(CHECKSUM_NAME if ckpt.name == CHECKPOINT_NAME else ckpt.stem + ".json")


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], previous_sha256: str | None = None) -> str:
    """Atomically write a plain dict (adds the format version) and its sha256 record; returns
    the new file's sha256. ``previous_sha256`` is the sha256 of the checkpoint now at ``path``
    (the one this run last wrote or resumed from), kept valid until the new file is in place."""
    path = Path(path)
    full = {"format": "szo-checkpoint", "version": CHECKPOINT_VERSION, **state}
    buf = io.BytesIO()
    torch.save(full, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    prev = None
    if previous_sha256 is not None and path.is_file():
        prev = {"sha256": previous_sha256}
    atomic_write_json(checksum_path(path), {
        "format": _RECORD_FORMAT, "file": path.name, "sha256": digest, "bytes": len(data), "previous": prev,
        "method": state.get("method"), "optimizer_class": state.get("optimizer_class"),
        "epoch": state.get("epoch"), "step": state.get("step"),
    })
    atomic_write_bytes(path, data)
    return digest


def read_checkpoint_bytes(path: str | os.PathLike) -> tuple[bytes, str]:
    """The bytes of checkpoint ``path`` and their sha256, checked against its record."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    rec_path = checksum_path(path)
    if not rec_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no sha256 record {rec_path.name} (written by an older szo, "
                              f"or copied without it); cannot verify it: {_HINT}")
    try:
        rec = json.loads(rec_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint record {rec_path} is not valid JSON (corrupt): {_HINT}") from None
    if not isinstance(rec, dict) or rec.get("format") != _RECORD_FORMAT or not isinstance(rec.get("sha256"), str):
        raise CheckpointError(f"{rec_path} is not an szo checkpoint record: {_HINT}")
    data = path.read_bytes()
    if not data:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): {_HINT}")
    digest = hashlib.sha256(data).hexdigest()
    prev = rec.get("previous") if isinstance(rec.get("previous"), dict) else {}
    if digest not in (rec["sha256"], prev.get("sha256")):
        size = f"{len(data)} bytes, the record says {rec.get('bytes')}"
        raise CheckpointError(f"checkpoint {path} does not match the sha256 in {rec_path.name} ({size}): "
                              f"tampered, truncated or corrupt; {_HINT}")
    return data, digest


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify (sha256 record) and load a checkpoint with ``weights_only=True``; one
    :class:`CheckpointError` line if it is not an intact szo checkpoint."""
    data, _ = read_checkpoint_bytes(path)
    return checkpoint_from_bytes(data, path, map_location)


def checkpoint_from_bytes(data: bytes, where: str | os.PathLike = "checkpoint",
                          map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint file's bytes (e.g. broadcast by rank 0) -> its dict, as ``load_checkpoint``."""
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - zip / unpickler errors on damaged or foreign files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"cannot read checkpoint {where}: not a readable torch checkpoint ({first}); "
                              f"{_HINT}") from None
    if not isinstance(state, dict) or state.get("format") != "szo-checkpoint":
        raise CheckpointError(f"{where} is not an szo checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{where}: checkpoint version {state.get('version')} unsupported; "
                              f"valid: {CHECKPOINT_VERSION}")
    return state
