"""Training checkpoints: plain dicts of tensors / numbers / strings, written atomically,
read back with ``torch.load(weights_only=True)`` (nothing is unpickled)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from szo.io import atomic_torch_save

__all__ = ["CHECKPOINT_NAME", "checkpoint_path", "save_checkpoint", "load_checkpoint", "checkpoint_from_bytes",
           "CHECKPOINT_VERSION"]

CHECKPOINT_VERSION = 1
CHECKPOINT_NAME = "last.pt"


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """``run_dir/checkpoints/last.pt``: the one rolling checkpoint of a run."""
    return Path(run_dir) / "checkpoints" / CHECKPOINT_NAME


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Atomically ``torch.save`` a plain dict (adds the format version)."""
    atomic_torch_save(path, {"format": "szo-checkpoint", "version": CHECKPOINT_VERSION, **state})


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; ValueError if it is not an szo checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return _checked(torch.load(path, map_location=map_location, weights_only=True), path)


def checkpoint_from_bytes(data: bytes, where: str | os.PathLike = "checkpoint",
                          map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint file's bytes (e.g. broadcast by rank 0) -> its dict, as ``load_checkpoint``."""
    import io

    return _checked(torch.load(io.BytesIO(data), map_location=map_location, weights_only=True), where)


def _checked(state: Any, where: str | os.PathLike) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != "szo-checkpoint":
        raise ValueError(f"{where} is not an szo checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{where}: checkpoint version {state.get('version')} unsupported; valid: {CHECKPOINT_VERSION}")
    return state
