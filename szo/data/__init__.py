"""Data sets for szo: static images (digits, CIFAR, ImageNet), their corrupted versions, events (DVS
Gesture, N-MNIST).

    from szo.data import get_dataset, make_loader
    train = get_dataset("digits", "train")
    loader = make_loader(train, 64, shuffle=True, generator=torch.Generator().manual_seed(0))

Loaders are imported lazily by ``get_dataset`` (``szo.data.dvs`` and ``szo.data.nmnist`` need tonic,
digits-c needs imagecorruptions), so importing ``szo.data`` costs only torch.
"""
from __future__ import annotations

from szo.data.corrupted import CORRUPTIONS, SEVERITIES
from szo.data.registry import (
    SPLITS,
    DataNotFoundError,
    DatasetInfo,
    collate_time_major,
    dataset_info,
    default_data_dir,
    get_dataset,
    make_loader,
    names,
)

__all__ = [
    "CORRUPTIONS",
    "SEVERITIES",
    "SPLITS",
    "DataNotFoundError",
    "DatasetInfo",
    "collate_time_major",
    "dataset_info",
    "default_data_dir",
    "get_dataset",
    "make_loader",
    "names",
]
