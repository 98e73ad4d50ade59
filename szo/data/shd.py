"""Spiking Heidelberg Digits (SHD; Cramer et al., IEEE TNNLS 2020) through tonic, binned in time.

Spoken digits 0-9 in English and German (20 classes) as spikes of 700 cochlear input units. Each
recording is read by ``tonic.datasets.SHD`` (times in seconds -> microseconds, unit -> x) and binned by
``tonic.transforms.ToFrame`` in ``T`` fixed time bins of ``bin_ms`` from time 0 (default 100 x 14 ms =
1.4 s, longer than every SHD recording; a spike after the last bin is outside the window and not
counted). Frames are ``float32 [T, 1, 1, 700]`` (P, H, W as tonic's sensor (700, 1, 1)), so the
frame-sequence models and the time-major collate take them as they take event frames.

On-disk layout (what ``tonic.datasets.SHD`` reads, the unzipped official release)::

    <data_dir>/SHD/shd_train.h5     (spikes/times, spikes/units, labels, extra/keys, extra/speaker, ...)
    <data_dir>/SHD/shd_test.h5

tonic's own existence check also wants the downloaded ``.zip``; szo checks only the ``.h5`` (a subclass
overriding ``_check_exists``; tonic's reader is used unchanged), so an unzipped copy works offline.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from szo.data.event_files import require_tonic
from szo.data.registry import DataNotFoundError, default_data_dir

__all__ = ["CLASSES", "N_UNITS", "SENSOR_SIZE", "SPLITS", "SHDFrames", "get_dataset"]

N_UNITS = 700
SENSOR_SIZE: tuple[int, int, int] = (N_UNITS, 1, 1)  # (W, H, P), as tonic
CLASSES: tuple[str, ...] = tuple(f"{lang}-{d}" for lang in ("english", "german") for d in range(10))
SPLITS: tuple[str, ...] = ("train", "test")
OFFICIAL_SOURCE = "https://zenkelab.org/resources/spiking-heidelberg-datasets-shd/ (Cramer et al. 2020)"


def _file(root: Path, split: str) -> Path:
    return root / "SHD" / f"shd_{split}.h5"


def _not_found_message(root: Path, split: str) -> str:
    f = _file(root, split)
    return (f"SHD {split} data not found: expected {f} (the unzipped official release). Official source: "
            f"{OFFICIAL_SOURCE}; file https://zenkelab.org/datasets/{f.name}.zip. To install: download it and "
            f"unzip it into {f.parent} (e.g. `unzip {f.name}.zip -d {f.parent}`), or set SZO_DATA_DIR to the "
            "folder holding SHD/.")


@functools.lru_cache(maxsize=1)
def _extracted_shd_class() -> type:
    """``tonic.datasets.SHD`` whose existence check accepts the unzipped ``.h5`` alone."""
    tonic = require_tonic()

    # the class name must stay "SHD": tonic derives the folder <save_to>/<class name>
    class SHD(tonic.datasets.SHD):
        def _check_exists(self) -> bool:
            return os.path.isfile(os.path.join(self.location_on_system, self.data_filename))

    return SHD


class SHDFrames(torch.utils.data.Dataset):
    """SHD as ``(frames float32 [T, 1, 1, 700], label int)``: tonic's reader, then ``ToFrame`` in ``T``
    bins of ``bin_ms`` from time 0."""

    classes = CLASSES

    def __init__(self, data_dir: str | os.PathLike | None = None, split: str = "train", *, T: int = 100,
                 bin_ms: float = 14.0) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"T (number of time bins) must be a positive int, got {T!r}")
        if not (isinstance(bin_ms, (int, float)) and 0 < bin_ms < 1e6):
            raise ValueError(f"bin_ms must be a positive number of milliseconds, got {bin_ms!r}")
        self.T, self.bin_us = T, max(1, round(float(bin_ms) * 1000))
        root = Path(data_dir) if data_dir is not None else default_data_dir()
        self.path = _file(root, split)
        if not self.path.is_file():
            raise DataNotFoundError(_not_found_message(root, split))
        try:
            self.events_ds = _extracted_shd_class()(save_to=str(root), train=split == "train")
            n = len(self.events_ds)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"cannot read {self.path} as SHD (spikes/times, spikes/units, labels, extra/keys): "
                             f"{e}") from None
        if n == 0:
            raise DataNotFoundError(f"{self.path} holds no recordings")
        self._to_frame = require_tonic().transforms.ToFrame(
            sensor_size=SENSOR_SIZE, time_window=self.bin_us, start_time=0, end_time=self.T * self.bin_us)

    def __len__(self) -> int:
        return len(self.events_ds)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        try:
            events, label = self.events_ds[index % len(self)]
        except (OSError, KeyError, ValueError, IndexError) as e:
            raise ValueError(f"cannot read recording {index} of {self.path} ({type(e).__name__}: {e})") from None
        label = int(label)
        if not 0 <= label < len(CLASSES):
            raise ValueError(f"{self.path}: recording {index} has label {label}; SHD's labels are 0..19")
        units = events["x"]
        if len(units) and (units.min() < 0 or units.max() >= N_UNITS):
            raise ValueError(f"{self.path}: recording {index} has units outside 0..{N_UNITS - 1}")
        events = events[(events["t"] >= 0) & (events["t"] < self.T * self.bin_us)]
        frames = np.zeros((self.T, 1, 1, N_UNITS), dtype=np.float32)
        if len(events):
            binned = np.asarray(self._to_frame(events), dtype=np.float32)[: self.T]
            frames[: len(binned), 0] = binned
        return torch.from_numpy(frames), label


def get_dataset(split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
                **kw: Any) -> SHDFrames:
    """Entry point for ``szo.data.get_dataset("shd", split, ...)``. Keywords: ``T`` (100), ``bin_ms`` (14)."""
    valid = {"T", "bin_ms"}
    unknown = sorted(set(kw) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for shd; valid: {sorted(valid)}")
    if download:
        raise ValueError("shd is not downloaded by szo; " + _not_found_message(
            Path(data_dir) if data_dir is not None else default_data_dir(), split))
    return SHDFrames(data_dir, split, **kw)
