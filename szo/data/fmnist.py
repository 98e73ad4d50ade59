"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, MIT): 60,000 train + 10,000 test real 28x28
grayscale images of 10 clothing classes, read by torchvision's ``FashionMNIST``.

Where the files are looked for, in this order:

1. ``data_dir`` (``data.data_dir``; default ``$SZO_DATA_DIR`` or ``./data``) in torchvision's layout,
   ``<data_dir>/FashionMNIST/raw/`` holding the four IDX files (``train-images-idx3-ubyte`` ...),
   extracted or as the official ``.gz`` (extracted next to them on first use);
2. the Debian package ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``: the
   four files as ``.gz`` under ``/usr/share/datasets/fashion-mnist``), extracted once into
   ``$XDG_CACHE_HOME/szo/fashion-mnist`` (Debian recompressed them, so their ``.gz`` md5s are not
   the official ones; the IDX headers and sizes are checked by torchvision when read);
3. ``download=True`` (``--set data.download=true``): torchvision downloads into ``data_dir``.

Otherwise one line says both ways to get it. Items are ``(x float32 [1, 28, 28] in [0, 1], y)``:
``ToTensor()``'s values, no normalisation, as in SpikingJelly's Fashion-MNIST tutorial
(``spikingjelly.activation_based.examples.conv_fashion_mnist``), whose network starts with BN.
"""
from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from szo.data.digits import ImageTensorDataset, check_limit
from szo.data.registry import DataNotFoundError, default_data_dir
from szo.io import atomic_write_bytes

__all__ = ["DEBIAN_DIR", "FILES", "NUM_CLASSES", "IMAGE_SIZE", "find_root", "load_tensors", "load_split", "get_dataset"]

NUM_CLASSES = 10
IMAGE_SIZE = (28, 28)
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where ``apt-get install dataset-fashion-mnist`` puts the four official ``.gz`` files."""
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
"""The four IDX files (``.gz`` as distributed), as torchvision's ``FashionMNIST`` names them."""
HOW = ("install it offline with `apt-get install dataset-fashion-mnist` (Debian: files in "
       f"{DEBIAN_DIR}), or let torchvision download it with `--set data.download=true`")


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "szo" / "fashion-mnist"


def _extract(src_dir: Path, raw: Path) -> None:
    """``src_dir/<f>.gz`` -> ``raw/<f>`` for the four files, each written atomically."""
    for f in FILES:
        if (raw / f).is_file():
            continue
        blob = (src_dir / f"{f}.gz").read_bytes()
        try:
            data = gzip.decompress(blob)
        except (OSError, EOFError) as e:
            raise DataNotFoundError(f"{src_dir / (f + '.gz')} is not a readable gzip file ({e}); {HOW}") from None
        atomic_write_bytes(raw / f, data)


def find_root(data_dir: str | os.PathLike | None = None, download: bool = False) -> Path:
    """The ``root`` for ``torchvision.datasets.FashionMNIST`` (the directory above ``FashionMNIST/raw``),
    extracting the ``.gz`` files first where needed; :class:`DataNotFoundError` (one line) if none."""
    base = Path(data_dir) if data_dir is not None else default_data_dir()
    raw = base / "FashionMNIST" / "raw"
    if all((raw / f).is_file() for f in FILES):
        return base
    if all((raw / f).is_file() or (raw / f"{f}.gz").is_file() for f in FILES):
        try:
            _extract(raw, raw)
            return base
        except PermissionError:  # a read-only copy: extract into the cache instead
            cache = _cache_root() / hashlib.sha256(str(raw.resolve()).encode()).hexdigest()[:16]
            _extract(raw, cache / "FashionMNIST" / "raw")
            return cache
    if all((DEBIAN_DIR / f"{f}.gz").is_file() for f in FILES):
        cache = _cache_root()
        _extract(DEBIAN_DIR, cache / "FashionMNIST" / "raw")
        return cache
    if download:
        from torchvision.datasets import FashionMNIST

        try:
            FashionMNIST(str(base), train=True, download=True)
        except (OSError, RuntimeError) as e:
            raise DataNotFoundError(f"Fashion-MNIST could not be downloaded into {raw}: {e}; "
                                    "install it offline with `apt-get install dataset-fashion-mnist`") from None
        return base
    missing = [f for f in FILES if not ((raw / f).is_file() or (raw / f"{f}.gz").is_file())]
    raise DataNotFoundError(f"Fashion-MNIST not found: expected {raw} with {', '.join(FILES)} (or their .gz; "
                            f"missing: {', '.join(missing)}), or the Debian package's {DEBIAN_DIR}; {HOW}")


def load_tensors(split: str, data_dir: str | os.PathLike | None = None,
                 download: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``split``'s images uint8 ``[n, 28, 28]`` and labels int64 ``[n]``, in the files' order."""
    from torchvision.datasets import FashionMNIST

    if split not in ("train", "test"):
        raise ValueError(f"split must be one of ['train', 'test'], got {split!r}")
    root = find_root(data_dir, download)
    try:
        ds = FashionMNIST(str(root), train=split == "train", download=False)
    except (RuntimeError, ValueError, AssertionError) as e:  # torchvision checks the IDX magic and shapes
        raise DataNotFoundError(f"Fashion-MNIST in {root / 'FashionMNIST' / 'raw'} is not readable IDX data "
                                f"({e}); {HOW}") from None
    return ds.data, ds.targets.to(torch.int64)


def load_split(split: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``split`` as float32 ``[n, 28, 28]`` in ``[0, 1]`` and int64 labels, from where :func:`find_root`
    finds it by default (``$SZO_DATA_DIR`` or ``./data``, else the Debian package): the interface
    ``szo.data.corrupted`` builds ``fmnist-c`` from. ``seed`` must be 0: Fashion-MNIST has one
    official train / test split."""
    if seed != 0:
        raise ValueError(f"Fashion-MNIST has one official split: split_seed must be 0, got {seed!r}")
    x, y = load_tensors(split)
    return x.numpy().astype(np.float32) / 255.0, y.numpy()


def get_dataset(
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    augment: bool | None = None,
    limit: int | None = None,
    **kw: Any,
) -> Dataset:
    """Fashion-MNIST ``split`` as ``(x float32 [1, 28, 28] in [0, 1], y int)`` items (the values of
    torchvision's ``ToTensor()``). ``limit``: the first ``limit`` images of the split (the files'
    order, which is shuffled across classes). No augmentation (the tutorial uses none)."""
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for fmnist; valid: ['limit']")
    if augment:
        raise ValueError("fmnist has no augmentation (SpikingJelly's tutorial trains without): set data.augment "
                         "to null or false")
    limit = check_limit(limit)
    x, y = load_tensors(split, data_dir, download)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return ImageTensorDataset(x.unsqueeze(1).float().div(255), y)
