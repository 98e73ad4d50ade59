"""N-MNIST (Orchard et al., Frontiers in Neuroscience 2015) through tonic, binned into frames.

An ATIS sensor moved in three saccades in front of each MNIST digit: 10 classes, a 34 x 34
sensor with two polarities, about 300 ms per recording. Frames are ``float32 [T, 2, 34, 34]``
(polarity channel 0 = OFF, 1 = ON) from the event -> frame pipeline of DVS Gesture
(``szo.data.dvs.EventsToFrames``: validation, optional ``tonic.transforms.Denoise``, then
``tonic.transforms.ToFrame(n_time_bins=T)``), cached on disk the same way.

On-disk layout (what ``tonic.datasets.NMNIST`` reads, the extracted official release)::

    <data_dir>/NMNIST/train.zip                      (archive, optional once extracted)
    <data_dir>/NMNIST/Train/<label>/<id>.bin         (label 0..9)
    <data_dir>/NMNIST/Test/<label>/<id>.bin

Each ``.bin`` holds 5 bytes per event (x 8 bits, y 8 bits, polarity 1 bit, t 23 bits in
microseconds, big-endian; ``tonic.io.read_mnist_file``). tonic's own existence check wants the
archive *and* 10,000 extracted files, otherwise it starts a download; szo checks only the
extracted folder (as for DVS Gesture: ``szo.data.dvs.open_tonic_set``), so an extracted copy
without the archive works offline, and a missing set is one line saying where to put it.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from szo.data.dvs import EventFrames, EventsToFrames, open_tonic_set, require_tonic
from szo.data.registry import default_data_dir

__all__ = ["CLASSES", "SENSOR_SIZE", "SPLITS", "NMNISTFrames", "get_dataset"]

CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
SENSOR_SIZE: tuple[int, int, int] = (34, 34, 2)  # (W, H, P), as tonic
SPLITS: tuple[str, ...] = ("train", "test")
_FOLDERS = {"train": "Train", "test": "Test"}
OFFICIAL_SOURCE = "https://www.garrickorchard.com/datasets/n-mnist (Orchard et al. 2015)"
ARCHIVES = {
    "train": ("train.zip", "https://data.mendeley.com/public-files/datasets/468j46mzdv/files/"
                           "39c25547-014b-4137-a934-9d29fa53c7a0/file_downloaded"),
    "test": ("test.zip", "https://data.mendeley.com/public-files/datasets/468j46mzdv/files/"
                         "05a4d654-7e03-4c15-bdfa-9bb2bcbea494/file_downloaded"),
}


def _not_found_message(root: Path, split: str, reason: str = "") -> str:
    folder = root / "NMNIST" / _FOLDERS[split]
    name, url = ARCHIVES[split]
    return (f"N-MNIST {split} data not found{': ' + reason if reason else ''}. Expected the extracted folder {folder} "
            f"holding <label>/<id>.bin recordings (label 0..9). Official source: {OFFICIAL_SOURCE}; archive {name} "
            f"from {url}. To install: extract {name} into {root / 'NMNIST'} so that {folder} exists "
            f"(e.g. `unzip {name} -d {root / 'NMNIST'}`), or pass download=True on a machine with network access.")


def _has_extracted(root: Path, split: str) -> bool:
    folder = root / "NMNIST" / _FOLDERS[split]
    return folder.is_dir() and any(folder.glob("*/*.bin"))


def _check_label_folders(root: Path, split: str) -> None:
    """One ValueError naming the folder when recordings sit anywhere but in ``<split folder>/<label>/``
    with a label 0..9: tonic takes a recording's label from the last character of its folder's path
    (``Train/five`` gave ``invalid literal for int()``, and ``Train/15`` would be read as label 5)."""
    folder = root / "NMNIST" / _FOLDERS[split]
    for where, dirs, files in os.walk(folder):
        dirs.sort()
        if not any(f.endswith(".bin") for f in files):
            continue
        rel = Path(where).relative_to(folder)
        if len(rel.parts) != 1 or rel.parts[0] not in CLASSES:
            raise ValueError(f"N-MNIST {split}: {where} holds .bin recordings but is not a label folder; valid: "
                             f"{folder}/<label>/<id>.bin with label {', '.join(CLASSES)} (the folder's name is the "
                             "recording's label)")


@functools.lru_cache(maxsize=1)
def _extracted_nmnist_class() -> type:
    """``tonic.datasets.NMNIST`` whose existence check accepts an extracted folder only."""
    tonic = require_tonic()

    # the class name must stay "NMNIST": tonic derives the folder <save_to>/<class name>
    class NMNIST(tonic.datasets.NMNIST):
        def _check_exists(self) -> bool:
            return self._folder_contains_at_least_n_files_of_type(1, ".bin")

    return NMNIST


class NMNISTFrames(EventFrames):
    """N-MNIST as ``(frames float32 [T, 2, H, W], label int)``, frames cached on disk.

    ``T`` frames per recording (``ToFrame(n_time_bins=T)``: T equal slices from its first event
    to its last); ``size`` (None = 34, or 17 / 2 / 1) downsamples, any size with ``fit`` (``SensorFit``:
    tonic's CenterCrop / Downsample); ``denoise_us`` (None: off)
    applies tonic's ``Denoise``."""

    classes = CLASSES

    def __init__(self, data_dir: str | os.PathLike | None = None, split: str = "train", *, T: int = 10,
                 size: int | None = None, denoise_us: float | None = None, download: bool = False,
                 cache: bool = True, fit: str | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        tonic = require_tonic()
        root = Path(data_dir) if data_dir is not None else default_data_dir()
        to_frames = EventsToFrames(sensor_size=SENSOR_SIZE, T=T, size=size, denoise_us=denoise_us, fit=fit)
        if _has_extracted(root, split):
            _check_label_folders(root, split)
        events_ds = open_tonic_set(
            _has_extracted(root, split), functools.partial(_extracted_nmnist_class(), save_to=str(root)),
            functools.partial(tonic.datasets.NMNIST, save_to=str(root)), train=split == "train", download=download,
            not_found=lambda reason: _not_found_message(root, split, reason))
        super().__init__(events_ds, to_frames, name="nmnist", root=root, split=split, cache=cache)


def get_dataset(split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
                **kw: Any) -> NMNISTFrames:
    """Entry point for ``szo.data.get_dataset("nmnist", split, ...)``.

    Keywords: ``T`` (10), ``size`` (None = 34), ``fit`` (None, or ``crop`` / ``downsample`` /
    ``crop+downsample`` to ``size``: e.g. ``size: 32, fit: crop``), ``denoise_us`` (None), ``cache`` (True).
    """
    valid = {"T", "size", "fit", "denoise_us", "cache"}
    unknown = sorted(set(kw) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for nmnist; valid: {sorted(valid)}")
    return NMNISTFrames(data_dir, split, download=download, **kw)
