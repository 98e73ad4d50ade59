"""Training checkpoints: plain dicts of tensors / numbers / strings, written atomically,
read back with ``torch.load(weights_only=True)`` (nothing is unpickled)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from szo.io import atomic_torch_save

__all__ = ["CHECKPOINT_NAME", "checkpoint_path", "save_checkpoint", "load_checkpoint", "CHECKPOINT_VERSION"]

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
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != "szo-checkpoint":
        raise ValueError(f"{path} is not an szo checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')} unsupported; valid: {CHECKPOINT_VERSION}")
    return state
