"""Data set registry: names, static facts (``DatasetInfo``) and lazy dispatch to loaders.

Every entry points at ``"module:function"``; the module is imported only when the data set is
asked for, so optional dependencies (tonic for DVS, imagecorruptions for digits-c / mnist5k-c) are needed
only by the data sets that use them.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "DataNotFoundError",
    "DatasetInfo",
    "SPLITS",
    "names",
    "dataset_info",
    "get_dataset",
    "make_loader",
    "collate_time_major",
    "default_data_dir",
]

SPLITS = ("train", "test")


class DataNotFoundError(FileNotFoundError):
    """A data set is not on disk where szo expects it.

    The message is one line: the directory expected, the files expected there, and how to get
    them (official URL, or ``--set data.download=true`` where torchvision can download).
    """

    def __str__(self) -> str:  # FileNotFoundError(msg) prints just msg; keep it one line
        return " ".join(str(a) for a in self.args).replace("\n", " ")


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a data set (defaults; loaders may change ``image_size``, e.g. ``upscale``)."""

    name: str
    num_classes: int
    in_channels: int
    image_size: tuple[int, int]
    is_sequence: bool
    default_T: int
    splits: tuple[str, ...] = SPLITS


def default_data_dir() -> Path:
    """``$SZO_DATA_DIR`` if set, else ``./data`` (every loader's default ``data_dir``)."""
    return Path(os.environ.get("SZO_DATA_DIR", "data"))


# name -> (info, "module:function", how the entry point is called)
# call kinds: "static" = fn(split, data_dir=, download=, augment=, **kw)
#             "dvs"    = fn(split, data_dir=, download=, **kw)
#             "synth"  = fn(split, **kw)
_ENTRIES: dict[str, tuple[DatasetInfo, str, str]] = {}


def _register(info: DatasetInfo, target: str, kind: str = "static") -> None:
    _ENTRIES[info.name] = (info, target, kind)


_register(DatasetInfo("digits", 10, 1, (8, 8), False, 4), "szo.data.digits:get_dataset")
_register(DatasetInfo("mnist5k", 10, 1, (28, 28), False, 4), "szo.data.mnist5k:get_dataset")
_register(DatasetInfo("fmnist", 10, 1, (28, 28), False, 4), "szo.data.fmnist:get_dataset")
_register(DatasetInfo("cifar10", 10, 3, (32, 32), False, 4), "szo.data.vision:get_cifar10")
_register(DatasetInfo("cifar100", 100, 3, (32, 32), False, 4), "szo.data.vision:get_cifar100")
_register(DatasetInfo("imagenet", 1000, 3, (224, 224), False, 4), "szo.data.vision:get_imagenet")
_register(DatasetInfo("digits-c", 10, 1, (8, 8), False, 4), "szo.data.corrupted:get_digits_c")
_register(DatasetInfo("mnist5k-c", 10, 1, (28, 28), False, 4), "szo.data.corrupted:get_mnist5k_c")
_register(DatasetInfo("fmnist-c", 10, 1, (28, 28), False, 4), "szo.data.corrupted:get_fmnist_c")
_register(DatasetInfo("cifar10-c", 10, 3, (32, 32), False, 4, ("test",)), "szo.data.corrupted:get_cifar10_c")
_register(DatasetInfo("cifar100-c", 100, 3, (32, 32), False, 4, ("test",)), "szo.data.corrupted:get_cifar100_c")
_register(DatasetInfo("imagenet-c", 1000, 3, (224, 224), False, 4, ("test",)), "szo.data.corrupted:get_imagenet_c")
_register(DatasetInfo("dvs-gesture", 11, 2, (128, 128), True, 20), "szo.data.dvs:get_dataset", "dvs")
_register(DatasetInfo("nmnist", 10, 2, (34, 34), True, 10), "szo.data.nmnist:get_dataset", "dvs")
_register(DatasetInfo("shd", 20, 1, (1, 700), True, 100), "szo.data.shd:get_dataset", "dvs")
_register(DatasetInfo("synthetic-gesture", 11, 2, (32, 32), True, 20), "szo.data.synthetic_events:get_dataset", "synth")


def names() -> list[str]:
    """All registered data set names."""
    return list(_ENTRIES)


def _entry(name: str) -> tuple[DatasetInfo, str, str]:
    if not isinstance(name, str) or name not in _ENTRIES:
        raise ValueError(f"unknown data set {name!r}; valid: {names()}")
    return _ENTRIES[name]


def dataset_info(name: str) -> DatasetInfo:
    """The ``DatasetInfo`` of ``name`` (ValueError listing valid names if unknown)."""
    return _entry(name)[0]


def _resolve(target: str) -> Callable[..., Dataset]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def get_dataset(
    name: str,
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    augment: bool | None = None,
    **kw: Any,
) -> Dataset:
    """Build data set ``name`` for ``split``; items are ``(x float32 tensor, y int)``.

    ``augment=None`` means the data set's default (on for CIFAR / ImageNet train, off for digits).
    Extra keywords go to the data set's own loader (e.g. ``upscale`` for digits,
    ``corruption``/``severity`` for the ``-c`` sets, ``T`` for DVS).
    """
    info, target, kind = _entry(name)
    if split not in info.splits:
        raise ValueError(f"data set {name!r} has no split {split!r}; valid: {list(info.splits)}")
    fn = _resolve(target)
    if kind == "static":
        return fn(split, data_dir=data_dir, download=download, augment=augment, **kw)
    if augment:
        raise ValueError(f"data set {name!r} has no augmentation option; pass augment=None or False")
    if kind == "dvs":
        return fn(split, data_dir=data_dir, download=download, **kw)
    # generated on the fly: nothing to find on disk or download
    return fn(split, **kw)


def collate_time_major(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(x, y)`` samples: static images ``[C, H, W]`` -> ``[N, C, H, W]``; event-frame
    sequences ``[T, C, H, W]`` -> ``[T, N, C, H, W]`` (SpikingJelly's multi-step layout, which
    the models take as is)."""
    xs = [torch.as_tensor(b[0]) for b in batch]
    if xs[0].dim() == 4:
        x = torch.stack(xs, 1)
    else:
        x = torch.stack(xs, 0)
    return x, torch.as_tensor([int(b[1]) for b in batch])


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
    num_workers: int = 0,
    drop_last: bool = False,
) -> DataLoader:
    """A ``DataLoader`` whose shuffling (and worker seeds) come from the explicit ``generator``;
    batches are collated by :func:`collate_time_major` (sequences come out ``[T, N, ...]``).

    Random augmentations (torchvision transforms, digits shift) draw from torch's global RNG:
    in worker processes that RNG is seeded by the DataLoader from ``generator``; with
    ``num_workers=0`` it is the main process' global RNG (seed it with ``torch.manual_seed``).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=bool(shuffle),
        generator=generator,
        num_workers=num_workers,
        drop_last=bool(drop_last),
        persistent_workers=False,
        collate_fn=collate_time_major,
    )
