"""scikit-learn's 8x8 handwritten digits: the embedded default data set (bundled, no network).

Pipeline: pixel values (0..16) / 16, a fixed stratified train/test split
(``sklearn.model_selection.train_test_split(test_size=0.2, stratify=y, random_state=seed)``,
1437 / 360 images for every seed), then standardization with the *train* split's scalar pixel
mean and std. Optional integer ``upscale`` (``torch.nn.functional.interpolate``, nearest or
bilinear) for models that want larger inputs, and an optional light train augmentation
(random shift by at most one 8x8 pixel, vacated pixels filled with the background value).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "NUM_CLASSES",
    "IMAGE_SIZE",
    "UPSCALE_MODES",
    "ImageTensorDataset",
    "RandomShift",
    "load_split",
    "train_stats",
    "upscale_images",
    "get_dataset",
]

NUM_CLASSES = 10
IMAGE_SIZE = (8, 8)
UPSCALE_MODES = ("nearest", "bilinear")
TEST_SIZE = 0.2


class ImageTensorDataset(Dataset):
    """In-memory images ``[N, C, H, W]`` float32 and labels; items are ``(x, int(y))``.

    ``images`` and ``targets`` are public so evaluation code can run one full batch.
    ``transform`` (optional) is applied per item to ``x``.
    """

    def __init__(self, images: torch.Tensor, targets: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if images.ndim != 4:
            raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
        if targets.ndim != 1 or targets.shape[0] != images.shape[0]:
            raise ValueError(f"targets must be [N] with N={images.shape[0]}, got shape {tuple(targets.shape)}")
        self.images = images.to(torch.float32).contiguous()
        self.targets = targets.to(torch.int64).contiguous()
        self.transform = transform

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.targets[index])


@dataclass(frozen=True)
class RandomShift:
    """Shift a ``[C, H, W]`` image by ``dy, dx`` drawn uniformly from ``[-max_shift, max_shift]``
    (torch's global RNG), filling vacated pixels with ``fill``."""

    max_shift: int = 1
    fill: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dy, dx = (int(v) for v in torch.randint(-self.max_shift, self.max_shift + 1, (2,)))
        if dy == 0 and dx == 0:
            return x
        h, w = x.shape[-2:]
        out = torch.full_like(x, self.fill)
        ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
        xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
        out[..., yd, xd] = x[..., ys, xs]
        return out


@functools.lru_cache(maxsize=4)
def _split_arrays(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return stratified_split(d.images.astype(np.float32) / 16.0, d.target, seed)  # [1797, 8, 8] in [0, 1]


def stratified_split(x: np.ndarray, y: np.ndarray, seed: int,
                     test_size: float = TEST_SIZE) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_tr, y_tr, x_te, y_te)``, read-only: sklearn's stratified ``train_test_split`` with
    ``random_state=seed`` (the split rule of every embedded image data set)."""
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(x, y.astype(np.int64), test_size=test_size, random_state=seed,
                                              stratify=y)
    for a in (x_tr, x_te, y_tr, y_te):
        a.setflags(write=False)
    return x_tr, y_tr, x_te, y_te


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return int(seed)


def load_split(split: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw split: images float32 ``[n, 8, 8]`` in ``[0, 1]`` (pixel / 16) and labels int64 ``[n]``.

    Read-only arrays; the split is a pure function of ``seed``.
    """
    return pick_split(_split_arrays, split, seed)


def check_limit(limit: Any) -> int | None:
    """``limit`` (keep the first n images of a split) as an int, or None; one ValueError otherwise."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or int(limit) < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    return None if limit is None else int(limit)


def pick_split(split_arrays: Callable[[int], tuple], split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``split``'s ``(x, y)`` from a cached ``split_arrays(seed) -> (x_tr, y_tr, x_te, y_te)``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be one of ['train', 'test'], got {split!r}")
    x_tr, y_tr, x_te, y_te = split_arrays(check_seed(seed))
    return (x_tr, y_tr) if split == "train" else (x_te, y_te)


def pixel_stats(x: np.ndarray) -> tuple[float, float]:
    """Scalar mean and std of all pixels of ``x`` (float64 accumulation)."""
    return float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64))


def train_stats(seed: int = 0) -> tuple[float, float]:
    """Scalar mean and std of the train split's pixels (after / 16)."""
    return pixel_stats(load_split("train", seed)[0])


def check_upscale(upscale: Any, mode: Any) -> int:
    if isinstance(upscale, bool) or not isinstance(upscale, (int, np.integer)) or int(upscale) < 1:
        raise ValueError(f"upscale must be an int >= 1, got {upscale!r}")
    if mode not in UPSCALE_MODES:
        raise ValueError(f"upscale_mode must be one of {list(UPSCALE_MODES)}, got {mode!r}")
    return int(upscale)


def upscale_images(x: torch.Tensor, factor: int, mode: str = "nearest") -> torch.Tensor:
    """Resize ``[N, C, H, W]`` (or ``[C, H, W]``) by an integer ``factor`` with ``interpolate``."""
    factor = check_upscale(factor, mode)
    if factor == 1:
        return x
    batched = x.ndim == 4
    xb = x if batched else x.unsqueeze(0)
    kw = {"align_corners": False} if mode == "bilinear" else {}
    out = F.interpolate(xb, scale_factor=factor, mode=mode, **kw)
    return out if batched else out.squeeze(0)


def standardized_tensors(
    images01: np.ndarray, seed: int = 0, upscale: int = 1, upscale_mode: str = "nearest"
) -> torch.Tensor:
    """Images in ``[0, 1]`` (``[n, H, W]``) -> standardized float32 ``[n, 1, H*u, W*u]``
    using the clean digits train statistics of ``seed``."""
    mean, std = train_stats(seed)
    x = (torch.from_numpy(np.array(images01, dtype=np.float32)).unsqueeze(1) - mean) / std
    return upscale_images(x, upscale, upscale_mode)


class _ShiftThenUpscale:
    """Per-item augmentation on the 8x8 image, then the same upscale as the eval path."""

    def __init__(self, shift: RandomShift, upscale: int, mode: str) -> None:
        self.shift, self.upscale, self.mode = shift, upscale, mode

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return upscale_images(self.shift(x), self.upscale, self.mode)


def get_dataset(
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    augment: bool | None = None,
    upscale: int = 1,
    upscale_mode: str = "nearest",
    seed: int = 0,
    **kw: Any,
) -> ImageTensorDataset:
    """Digits ``split`` as ``(x float32 [1, 8*upscale, 8*upscale], y int)`` items.

    ``data_dir`` and ``download`` are accepted for a uniform signature and ignored (the data
    ship with scikit-learn). ``augment`` (default off) enables the <=1 pixel random shift and is
    valid for the train split only. ``seed`` picks the train/test split.
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for digits; valid: ['upscale', 'upscale_mode', 'seed']")
    upscale = check_upscale(upscale, upscale_mode)
    if augment and split != "train":
        raise ValueError(f"augment=True is valid for the train split only, got split={split!r}")
    x01, y = load_split(split, seed)
    if augment:
        mean, std = train_stats(seed)
        base = standardized_tensors(x01, seed)
        t = _ShiftThenUpscale(RandomShift(1, fill=(0.0 - mean) / std), upscale, upscale_mode)
        return ImageTensorDataset(base, torch.from_numpy(y.copy()), transform=t)
    return ImageTensorDataset(standardized_tensors(x01, seed, upscale, upscale_mode), torch.from_numpy(y.copy()))
