"""CIFAR-10 / CIFAR-100 and ImageNet through torchvision's own loaders.

* CIFAR: ``torchvision.datasets.CIFAR10`` / ``CIFAR100`` on ``<data_dir>/cifar-10-batches-py``
  / ``<data_dir>/cifar-100-python`` (the official "python version" release). That format is a
  Python pickle by definition; it is read only through torchvision's official loader, never by
  szo's own code. By default the extracted batch files are checked for *presence* only (a
  subclass sets torchvision's per-file md5 to ``None``, which makes its ``check_integrity`` test
  existence), so re-packed or test-generated files in the official format load; torchvision
  still verifies the md5 of the downloaded archive. ``verify_md5=True`` uses torchvision's
  class unchanged (official md5 of every file).
* ImageNet: ``torchvision.datasets.ImageFolder`` on ``<data_dir>/train`` and ``<data_dir>/val``
  (one folder per class).

Augmentation (paper App. G: random crop + horizontal flip) is on by default for the train
split: CIFAR ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip``; ImageNet
``RandomResizedCrop(224)`` + ``RandomHorizontalFlip``; ImageNet test ``Resize(256)`` +
``CenterCrop(224)``. Normalization uses the per-channel pixel mean / std of each train set.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from szo.data.registry import DataNotFoundError, default_data_dir

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "cifar_transform",
    "imagenet_transform",
    "get_cifar10",
    "get_cifar100",
    "get_imagenet",
]

# Per-channel mean / std of the train pixels in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_CIFAR = {
    "cifar10": {
        "title": "CIFAR-10",
        "folder": "cifar-10-batches-py",
        "url": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "mean": CIFAR10_MEAN,
        "std": CIFAR10_STD,
    },
    "cifar100": {
        "title": "CIFAR-100",
        "folder": "cifar-100-python",
        "url": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "mean": CIFAR100_MEAN,
        "std": CIFAR100_STD,
    },
}


def _resolve_augment(split: str, augment: bool | None) -> bool:
    if split not in ("train", "test"):
        raise ValueError(f"split must be one of ['train', 'test'], got {split!r}")
    if augment is None:
        return split == "train"
    if augment and split != "train":
        raise ValueError(f"augment=True is valid for the train split only, got split={split!r}")
    return bool(augment)


def cifar_transform(mean: tuple[float, ...], std: tuple[float, ...], augment: bool) -> Any:
    """PIL image -> normalized float32 ``[3, 32, 32]`` (random crop + flip when ``augment``)."""
    from torchvision import transforms as T

    ops: list[Any] = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
    return T.Compose(ops + [T.ToTensor(), T.Normalize(mean, std)])


def imagenet_transform(augment: bool, size: int = 224, resize: int = 256) -> Any:
    """PIL image -> normalized float32 ``[3, size, size]`` (ImageNet train / eval pipeline)."""
    from torchvision import transforms as T

    if augment:
        ops: list[Any] = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    else:
        ops = [T.Resize(resize), T.CenterCrop(size)]
    return T.Compose(ops + [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def _presence_only(cls: type) -> type:
    """Subclass of a torchvision CIFAR class whose per-file md5 checks test existence only."""
    return type(
        f"{cls.__name__}PresenceChecked",
        (cls,),
        {
            "__doc__": f"{cls.__name__} with per-file md5 = None (torchvision then only checks the file exists).",
            "train_list": [[name, None] for name, _ in cls.train_list],
            "test_list": [[name, None] for name, _ in cls.test_list],
            "meta": {**cls.meta, "md5": None},
        },
    )


def _get_cifar(
    name: str, split: str, data_dir: str | os.PathLike | None, download: bool, augment: bool | None,
    verify_md5: bool,
) -> Dataset:
    import torchvision

    spec = _CIFAR[name]
    aug = _resolve_augment(split, augment)
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    base = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    cls = base if verify_md5 else _presence_only(base)
    folder = root / spec["folder"]
    expected = [f for f, _ in base.train_list + base.test_list] + [base.meta["filename"]]
    missing = [f for f in expected if not (folder / f).is_file()]
    if missing and not download:
        raise DataNotFoundError(
            f"{spec['title']} not found: expected directory {folder} with files {', '.join(expected)}. "
            f"{'' if len(missing) == len(expected) else '(missing: ' + ', '.join(missing) + ') '}"
            f"Get {spec['url']} and extract it into {root}, "
            "or let torchvision download it with `--set data.download=true` (download=True)."
        )
    tf = cifar_transform(spec["mean"], spec["std"], aug)
    try:
        return cls(root=str(root), train=(split == "train"), transform=tf, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted" / md5 mismatch
        raise DataNotFoundError(
            f"{spec['title']} in {folder} failed torchvision's check ({e}); expected files {', '.join(expected)} "
            f"from {spec['url']}."
        ) from None
    except OSError as e:  # download failed (no network) or unreadable files
        raise DataNotFoundError(
            f"{spec['title']} could not be obtained into {folder}: {e}. Download {spec['url']} by hand and "
            f"extract it into {root}."
        ) from None


def get_cifar10(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, verify_md5: bool = False, **kw: Any,
) -> Dataset:
    """CIFAR-10 ``split``: items ``(x float32 [3, 32, 32] normalized, y int)``.

    ``data_dir`` holds ``cifar-10-batches-py/`` (default ``$SZO_DATA_DIR`` or ``./data``).
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for cifar10; valid: ['verify_md5']")
    return _get_cifar("cifar10", split, data_dir, download, augment, verify_md5)


def get_cifar100(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, verify_md5: bool = False, **kw: Any,
) -> Dataset:
    """CIFAR-100 ``split`` (fine labels): items ``(x float32 [3, 32, 32] normalized, y int)``.

    ``data_dir`` holds ``cifar-100-python/`` (default ``$SZO_DATA_DIR`` or ``./data``).
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for cifar100; valid: ['verify_md5']")
    return _get_cifar("cifar100", split, data_dir, download, augment, verify_md5)


IMAGENET_URL = "https://image-net.org/download-images.php (ILSVRC2012 train and val)"


def image_folder(path: Path, transform: Any, title: str, how: str) -> Dataset:
    """``ImageFolder(path)`` or ``DataNotFoundError`` naming ``path`` and the class-folder layout."""
    import torchvision

    if not path.is_dir() or not any(p.is_dir() for p in path.iterdir()):
        raise DataNotFoundError(
            f"{title} not found: expected directory {path} with one sub-folder per class holding images "
            f"(e.g. {path / 'n01440764' / 'xxx.JPEG'}). {how}"
        )
    try:
        return torchvision.datasets.ImageFolder(str(path), transform=transform)
    except FileNotFoundError as e:  # class folders present but no image with a known extension
        raise DataNotFoundError(f"{title} in {path}: {e}. {how}") from None


def get_imagenet(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, **kw: Any,
) -> Dataset:
    """ImageNet-1k ``split`` from ``<data_dir>/train`` or ``<data_dir>/val`` (class folders).

    Default ``data_dir``: ``$SZO_DATA_DIR/imagenet`` (or ``./data/imagenet``). torchvision cannot
    download ImageNet (license), so ``download=True`` is an error.
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for imagenet; valid: none")
    aug = _resolve_augment(split, augment)
    root = Path(data_dir) if data_dir is not None else default_data_dir() / "imagenet"
    how = (f"Get ILSVRC2012 from {IMAGENET_URL} and arrange train/ and val/ as class folders "
           f"under {root} (download=True is not possible: the license requires a manual download).")
    if download:
        raise DataNotFoundError(f"ImageNet cannot be downloaded automatically. {how}")
    folder = root / ("train" if split == "train" else "val")
    return image_folder(folder, imagenet_transform(aug), f"ImageNet {split}", how)
