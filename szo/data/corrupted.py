"""Corrupted test sets for test-time adaptation (paper Sec. 6.3, App. E tables 5-10).

* ``cifar10-c`` / ``cifar100-c`` (Hendrycks & Dietterich, official release):
  ``<data_dir>/CIFAR-10-C/<corruption>.npy`` (uint8 ``[5 * B, 32, 32, 3]``: severities 1..5
  stacked, severity ``s`` = rows ``(s-1)*B : s*B``) and ``labels.npy`` (``[5 * B]``). The
  official files have ``B = 10000``; szo infers ``B = len / 5`` so smaller files in the same
  layout (tests) work. Loaded with ``np.load(mmap_mode='r', allow_pickle=False)``; normalized
  with the clean CIFAR statistics.
* ``imagenet-c``: ``<data_dir>/<corruption>/<severity>/<class folders>`` (ImageFolder),
  ``Resize(256)`` + ``CenterCrop(224)``.
* ``digits-c`` and ``mnist5k-c``: the 15 corruptions applied with the ``imagecorruptions``
  package to an embedded clean data set (``BASES``; one shared generator and cache layout,
  :func:`corrupted_images`), both splits (``train`` for building an adaptation subspace
  honestly, ``test`` to evaluate). imagecorruptions wants RGB uint8 images of at least 32x32:

  - ``digits-c``: each 8x8 digit (pixel / 16 -> uint8) is upscaled to 32x32 (nearest), and after
    the corruption resized to the model input (area interpolation to ``8*upscale`` when that is
    <= 32, the 32x32 image itself at ``upscale=4``);
  - ``mnist5k-c``: each 28x28 mnist5k digit (pixel / 255 -> uint8) is zero-padded to 32x32
    (2 pixels each side, MNIST's own black background), and after the corruption centre-cropped
    back to 28x28 (4,000 train / 1,000 test images, mnist5k's seeded split).

  In between, the image is copied to 3 channels, corrupted and converted back to gray (PIL
  ``"L"``, ITU-R 601 luma); the result is standardized with the *clean* base train statistics
  (what a source model expects). Every image is seeded on its own from ``(seed, corruption,
  severity, index)`` (mnist5k-c: also the split and the base, so train and test image ``i`` do
  not share a noise field; digits-c keeps its original seeds): the global ``np.random`` state is
  saved, seeded, and restored around the call, and corruptions that take a ``seed`` argument
  (glass blur, impulse noise in imagecorruptions-imaug) get one too. The 32x32 gray results are
  cached as ``.npy`` (atomic writes) under ``cache_dir`` (default ``$XDG_CACHE_HOME/szo/<name>``
  or ``~/.cache/szo/<name>``, e.g. ``~/.cache/szo/mnist5k-c``), keyed by a per-base format
  version (``digits-c-v1``, ``mnist5k-c-v1``), the imagecorruptions version, the seeds, the split
  and the selected indices; a subset is served from the full split's file when that exists.
  Options: ``corruption``, ``severity``, ``seed``, ``split_seed``, ``indices``, ``limit`` (the
  first n images of the split), ``cache``, ``cache_dir`` (digits-c also ``upscale``,
  ``upscale_mode``). :func:`generate_corrupted` fills the cache with a progress bar.

  The corruption parameters are imagecorruptions', i.e. ImageNet-C's (made for 224-pixel
  images), not CIFAR-10-C's milder 32-pixel ones: at severity 5 defocus blur (radius 10), glass
  blur and elastic transform turn a 28-pixel digit into a blob or a scatter to the eye, and
  contrast scales it to 5 %. A linear probe on the corrupted splits still reads the labels of every
  corruption, and no corruption is impractically slow to generate (both measured with
  ``python bench/mnist5k_c.py``: docs/evidence.md, "mnist5k-c and test-time adaptation").
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import io
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import szo.data.digits as digits
import szo.data.vision as vision
from szo.data.digits import ImageTensorDataset, check_limit, check_seed
from szo.data.registry import DataNotFoundError, default_data_dir
from szo.io import atomic_write_bytes

__all__ = [
    "CORRUPTIONS",
    "SEVERITIES",
    "DIGITS_C_VERSION",
    "MNIST5K_C_VERSION",
    "BASES",
    "GENERATED",
    "CorruptedBase",
    "CifarCorrupted",
    "get_cifar10_c",
    "get_cifar100_c",
    "get_imagenet_c",
    "get_digits_c",
    "get_mnist5k_c",
    "get_fmnist_c",
    "corrupted_images",
    "corrupt_images",
    "digits_c_images",
    "mnist5k_c_images",
    "split_length",
    "generate_corrupted",
    "generate_digits_c",
    "default_cache_dir",
]

# The 15 standard corruptions, in the column order of the paper's tables 5-10.
CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog",
    "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
DIGITS_C_VERSION = "digits-c-v1"
MNIST5K_C_VERSION = "mnist5k-c-v1"
FMNIST_C_VERSION = "fmnist-c-v1"
_CORRUPT_SIZE = 32  # imagecorruptions needs >= 32x32

_CIFAR_C = {
    "cifar10-c": ("CIFAR-10-C", "https://zenodo.org/record/2535967", "cifar10"),
    "cifar100-c": ("CIFAR-100-C", "https://zenodo.org/record/3555552", "cifar100"),
}
IMAGENET_C_URL = "https://zenodo.org/record/2235448"


def _check_corruption(corruption: Any) -> str:
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r}; valid: {list(CORRUPTIONS)}")
    return corruption


def _check_severity(severity: Any) -> int:
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or int(severity) not in SEVERITIES:
        raise ValueError(f"severity must be one of {list(SEVERITIES)}, got {severity!r}")
    return int(severity)


def _check_test_only(name: str, split: str, augment: bool | None) -> None:
    if split != "test":
        raise ValueError(f"{name} has only the 'test' split, got {split!r}")
    if augment:
        raise ValueError(f"{name} is a test set; augment must be None or False")


# --------------------------------------------------------------------------- CIFAR-C
class CifarCorrupted(Dataset):
    """One (corruption, severity) block of a CIFAR-C ``.npy`` file, memory-mapped.

    Items: ``(x float32 [3, 32, 32] normalized with mean/std, y int)``. The block size is
    inferred as ``len(file) / 5`` (10000 for the official files).
    """

    def __init__(self, data_path: Path, labels_path: Path, severity: int,
                 mean: Sequence[float], std: Sequence[float]) -> None:
        severity = _check_severity(severity)
        data = np.load(data_path, mmap_mode="r", allow_pickle=False)
        labels = np.load(labels_path, mmap_mode="r", allow_pickle=False)
        if data.ndim != 4 or data.shape[1:] != (32, 32, 3) or data.dtype != np.uint8:
            raise ValueError(f"{data_path}: expected uint8 [5*B, 32, 32, 3], got {data.dtype} {list(data.shape)}")
        if data.shape[0] == 0 or data.shape[0] % len(SEVERITIES):
            raise ValueError(f"{data_path}: {data.shape[0]} rows is not 5 severity blocks of equal size")
        if labels.ndim != 1 or labels.shape[0] != data.shape[0] or labels.dtype.kind not in "iu":
            raise ValueError(
                f"{labels_path}: expected integer labels [{data.shape[0]}] matching {data_path.name}, "
                f"got {labels.dtype} {list(labels.shape)}")
        self.block = data.shape[0] // len(SEVERITIES)
        lo = (severity - 1) * self.block
        self.data = data[lo:lo + self.block]
        self.targets = labels[lo:lo + self.block]
        self.severity = severity
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return self.block

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        img = torch.from_numpy(np.array(self.data[index]))  # HWC uint8, copied out of the mmap
        x = img.permute(2, 0, 1).to(torch.float32).div_(255.0)
        return (x - self.mean) / self.std, int(self.targets[index])


def _get_cifar_c(name: str, split: str, data_dir: str | os.PathLike | None, download: bool,
                 augment: bool | None, corruption: Any, severity: Any) -> CifarCorrupted:

    _check_test_only(name, split, augment)
    corruption, severity = _check_corruption(corruption), _check_severity(severity)
    folder_name, url, clean = _CIFAR_C[name]
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    folder = root / folder_name
    how = f"Download {folder_name}.tar from {url} and extract it into {root}"
    if download:
        raise DataNotFoundError(f"{folder_name} cannot be downloaded by szo. {how}.")
    data_path, labels_path = folder / f"{corruption}.npy", folder / "labels.npy"
    missing = [p.name for p in (data_path, labels_path) if not p.is_file()]
    if missing:
        raise DataNotFoundError(
            f"{folder_name} not found: expected directory {folder} with <corruption>.npy for "
            f"{', '.join(CORRUPTIONS)} and labels.npy (missing: {', '.join(missing)}). {how}.")
    mean = vision.CIFAR10_MEAN if clean == "cifar10" else vision.CIFAR100_MEAN
    std = vision.CIFAR10_STD if clean == "cifar10" else vision.CIFAR100_STD
    return CifarCorrupted(data_path, labels_path, severity, mean, std)


def get_cifar10_c(split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
                  augment: bool | None = None, corruption: str = "gaussian_noise", severity: int = 5,
                  **kw: Any) -> CifarCorrupted:
    """CIFAR-10-C ``corruption`` at ``severity`` (default: the paper's tables, severity 5)."""
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for cifar10-c; valid: ['corruption', 'severity']")
    return _get_cifar_c("cifar10-c", split, data_dir, download, augment, corruption, severity)


def get_cifar100_c(split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
                   augment: bool | None = None, corruption: str = "gaussian_noise", severity: int = 5,
                   **kw: Any) -> CifarCorrupted:
    """CIFAR-100-C ``corruption`` at ``severity`` (normalized with CIFAR-100 statistics)."""
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for cifar100-c; valid: ['corruption', 'severity']")
    return _get_cifar_c("cifar100-c", split, data_dir, download, augment, corruption, severity)


# --------------------------------------------------------------------------- ImageNet-C
def get_imagenet_c(split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
                   augment: bool | None = None, corruption: str = "gaussian_noise", severity: int = 5,
                   **kw: Any) -> Dataset:
    """ImageNet-C from ``<data_dir>/<corruption>/<severity>/<class folders>``.

    Default ``data_dir``: ``$SZO_DATA_DIR/ImageNet-C`` (or ``./data/ImageNet-C``).
    """
    if kw:
        raise ValueError(f"unknown option(s) {sorted(kw)} for imagenet-c; valid: ['corruption', 'severity']")
    _check_test_only("imagenet-c", split, augment)
    corruption, severity = _check_corruption(corruption), _check_severity(severity)
    root = Path(data_dir) if data_dir is not None else default_data_dir() / "ImageNet-C"
    how = f"Download the ImageNet-C tar files from {IMAGENET_C_URL} and extract them into {root}."
    if download:
        raise DataNotFoundError(f"ImageNet-C cannot be downloaded by szo. {how}")
    return vision.image_folder(root / corruption / str(severity), vision.imagenet_transform(False),
                               f"ImageNet-C {corruption} severity {severity}", how)


# --------------------------------------------------------------------------- digits-c / mnist5k-c
@dataclass(frozen=True)
class CorruptedBase:
    """How an embedded clean data set becomes its corrupted version (``<name>-c``).

    ``module`` provides ``load_split(split, seed)`` (images in [0, 1]) and ``train_stats(seed)``;
    ``canvas`` is how an image reaches imagecorruptions' 32x32 minimum (``"upscale"``: nearest,
    integer factor; ``"pad"``: zero-padded, centred) and back (area resize / centre crop);
    ``version`` is the first part of the cache key; with ``split_in_seed`` the per-image seeds also
    depend on the split and the base (digits-c keeps its v1 seeds, which do not).
    """

    name: str
    module: str
    version: str
    canvas: str
    split_in_seed: bool
    standardize: bool = True  # model input standardised with the clean train split's statistics (fmnist: [0, 1] as is)


#: the clean data sets that have a generated corrupted version, by clean name
BASES: dict[str, CorruptedBase] = {
    "digits": CorruptedBase("digits", "szo.data.digits", DIGITS_C_VERSION, "upscale", False),
    "mnist5k": CorruptedBase("mnist5k", "szo.data.mnist5k", MNIST5K_C_VERSION, "pad", True),
    "fmnist": CorruptedBase("fmnist", "szo.data.fmnist", FMNIST_C_VERSION, "pad", True, standardize=False),
}
#: registry name of the corrupted set -> clean base name
GENERATED: dict[str, str] = {f"{b}-c": b for b in BASES}


def _base(base: Any) -> CorruptedBase:
    if base not in BASES:
        raise ValueError(f"unknown base data set {base!r} for generated corruptions; valid: {list(BASES)}")
    return BASES[base]


def _base_module(b: CorruptedBase) -> Any:
    import importlib

    return importlib.import_module(b.module)


def default_cache_dir(base: str = "digits") -> Path:
    """``$XDG_CACHE_HOME/szo/<base>-c`` or ``~/.cache/szo/<base>-c`` (``digits-c``, ``mnist5k-c``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "szo" / f"{_base(base).name}-c"


_INSTALL_HINT = ("digits-c / mnist5k-c need the imagecorruptions package (the maintained fork "
                 "imagecorruptions-imaug, which imports on current setuptools / scikit-image): "
                 "pip install 'szo[corruptions]'")


def _imagecorruptions_tag() -> str:
    """Installed distribution and version (cache key), read from metadata without importing it."""
    for dist in ("imagecorruptions-imaug", "imagecorruptions"):
        try:
            return f"{dist}-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ImportError(_INSTALL_HINT)


def _imagecorruptions() -> tuple[dict[str, Callable[..., Any]], Callable[..., np.ndarray]]:
    """(corruption functions by name, ``corrupt``) or a clear ImportError."""
    try:
        import imagecorruptions
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return imagecorruptions.corruption_dict, imagecorruptions.corrupt


def _image_seeds(seed: int, corruption: str, severity: int, index: int,
                 extra: Sequence[int] = ()) -> tuple[int, int]:
    """Two uint32 seeds for one image: for np.random's global state and for a ``seed=`` kwarg."""
    ss = np.random.SeedSequence([seed, CORRUPTIONS.index(corruption), severity, index, *extra])
    a, b = ss.generate_state(2)
    return int(a), int(b)


def _seed_extra(b: CorruptedBase, split: str) -> tuple[int, ...]:
    if not b.split_in_seed:
        return ()
    return (("train", "test").index(split), zlib.crc32(b.name.encode()))


def _to_canvas(images01: np.ndarray, canvas: str = "upscale") -> np.ndarray:
    """``[n, h, w]`` in [0, 1] -> ``[n, 32, 32]`` uint8: nearest upscale by ``32 // w`` or zero padding."""
    u8 = np.rint(np.clip(images01, 0.0, 1.0) * 255.0).astype(np.uint8)
    h, w = u8.shape[-2:]
    if canvas == "upscale":
        r = _CORRUPT_SIZE // w
        return np.ascontiguousarray(u8.repeat(r, axis=1).repeat(r, axis=2))
    top, left = (_CORRUPT_SIZE - h) // 2, (_CORRUPT_SIZE - w) // 2
    out = np.zeros((u8.shape[0], _CORRUPT_SIZE, _CORRUPT_SIZE), dtype=np.uint8)
    out[:, top:top + h, left:left + w] = u8
    return out


def corrupt_images(images01: np.ndarray, corruption: str, severity: int, seed: int,
                   indices: Sequence[int], *, base: str = "digits", split: str = "test",
                   progress: bool = True) -> np.ndarray:
    """Corrupt ``images01`` ``[n, h, w]`` (in [0, 1], of data set ``base``) whose split positions
    are ``indices``.

    Returns gray uint8 ``[n, 32, 32]``; image ``i`` depends only on ``(seed, corruption, severity,
    indices[i])`` (and, for bases with ``split_in_seed``, the split and the base) and its pixels.
    ``progress``: a progress bar that appears when the call takes more than 2 s.
    """
    from PIL import Image
    from tqdm.auto import tqdm

    b = _base(base)
    corruption, severity = _check_corruption(corruption), _check_severity(severity)
    funcs, corrupt = _imagecorruptions()
    takes_seed = "seed" in inspect.signature(funcs[corruption]).parameters
    extra = _seed_extra(b, split)
    big = _to_canvas(images01, b.canvas)
    out = np.empty(big.shape, dtype=np.uint8)
    saved = np.random.get_state()
    try:
        bar = tqdm(zip(big, indices), total=len(big), desc=f"{b.name}-c {split} {corruption} s{severity}",
                   unit="img", delay=2.0, leave=False, disable=not progress, dynamic_ncols=True)
        for i, (img, index) in enumerate(bar):
            np_seed, kw_seed = _image_seeds(seed, corruption, severity, int(index), extra)
            np.random.seed(np_seed)
            kw = {"seed": kw_seed} if takes_seed else {}
            rgb = corrupt(np.stack([img] * 3, axis=-1), corruption_name=corruption, severity=severity, **kw)
            out[i] = np.asarray(Image.fromarray(np.asarray(rgb, dtype=np.uint8)).convert("L"))
    finally:
        np.random.set_state(saved)
    return out


def _check_indices(indices: Any, n: int) -> np.ndarray | None:
    if indices is None:
        return None
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= n:
        raise ValueError(f"indices must be a non-empty 1-D sequence of ints in [0, {n}), got {indices!r}")
    return idx.astype(np.int64)


def _cache_path(cache_dir: Path, tag: str, split: str, split_seed: int, seed: int, corruption: str,
                severity: int, idx: np.ndarray | None, version: str = DIGITS_C_VERSION) -> Path:
    suffix = "" if idx is None else "-idx" + hashlib.sha256(idx.tobytes()).hexdigest()[:16]
    return (cache_dir / f"{version}-{tag}" / f"split{split_seed}-seed{seed}" / split
            / f"{corruption}-s{severity}{suffix}.npy")


def _load_cached(path: Path, n: int) -> np.ndarray | None:
    """The cached ``[n, 32, 32]`` uint8 array at ``path``, or None (missing, unreadable or wrong shape)."""
    if not path.is_file():
        return None
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError):
        return None  # unreadable cache entry: regenerate and overwrite it atomically
    return arr if arr.dtype == np.uint8 and arr.shape == (n, _CORRUPT_SIZE, _CORRUPT_SIZE) else None


def split_length(base: str, split: str, *, split_seed: int = 0, limit: int | None = None) -> int:
    """Number of images of ``split`` of the generated set of ``base`` (after ``limit``)."""
    b = _base(base)
    n = len(_base_module(b).load_split(split, split_seed)[1])
    limit = check_limit(limit)
    return n if limit is None else min(n, limit)


def corrupted_images(
    base: str, corruption: str, severity: int, *, split: str = "test", seed: int = 0, split_seed: int = 0,
    cache_dir: str | os.PathLike | None = None, indices: Sequence[int] | None = None, limit: int | None = None,
    cache: bool = True, progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupted images of the clean data set ``base`` as gray uint8 ``[n, 32, 32]`` and labels ``[n]``,
    cached on disk.

    ``limit`` keeps the first ``limit`` images of the split (the split order is sklearn's seeded
    shuffle); ``indices`` then selects images among them (default: all). A subset holds exactly
    the same images as the corresponding rows of the full split, and is served from the full
    split's cache file when that exists.
    """
    b = _base(base)
    corruption, severity = _check_corruption(corruption), _check_severity(severity)
    clean = _base_module(b)
    x01, y = clean.load_split(split, split_seed)
    seed = check_seed(seed)
    limit = check_limit(limit)
    n = len(y) if limit is None else min(len(y), limit)
    idx = _check_indices(indices, n)
    if idx is None and n < len(y):
        idx = np.arange(n, dtype=np.int64)
    sel = np.arange(len(y)) if idx is None else idx
    path = None
    if cache:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir(b.name)
        key = (root, _imagecorruptions_tag(), split, split_seed, seed, corruption, severity)
        path = _cache_path(*key, idx, version=b.version)
        arr = _load_cached(path, len(sel))
        if arr is None and idx is not None:
            full = _load_cached(_cache_path(*key, None, version=b.version), len(y))
            arr = None if full is None else full[sel]
        if arr is not None:
            return arr, y[sel]
    arr = corrupt_images(x01[sel], corruption, severity, seed, sel, base=b.name, split=split, progress=progress)
    if path is not None:
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        atomic_write_bytes(path, buf.getvalue())
    return arr, y[sel]


def digits_c_images(corruption: str, severity: int, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`corrupted_images` of the digits (``base="digits"``)."""
    return corrupted_images("digits", corruption, severity, **kw)


def mnist5k_c_images(corruption: str, severity: int, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`corrupted_images` of mnist5k (``base="mnist5k"``)."""
    return corrupted_images("mnist5k", corruption, severity, **kw)


def _to_model_input(gray32: np.ndarray, upscale: int, upscale_mode: str, split_seed: int) -> torch.Tensor:
    """digits-c: the 32x32 canvas -> ``[n, 1, 8*upscale, 8*upscale]``, clean digits train statistics."""
    upscale = digits.check_upscale(upscale, upscale_mode)
    size = digits.IMAGE_SIZE[0] * upscale
    x = torch.from_numpy(gray32).unsqueeze(1).to(torch.float32).div_(255.0)
    if size < _CORRUPT_SIZE:
        x = F.interpolate(x, size=(size, size), mode="area")
    elif size > _CORRUPT_SIZE:
        kw = {"align_corners": False} if upscale_mode == "bilinear" else {}
        x = F.interpolate(x, size=(size, size), mode=upscale_mode, **kw)
    mean, std = digits.train_stats(split_seed)
    return (x - mean) / std


def _crop_to_model_input(gray32: np.ndarray, split_seed: int, base: str = "mnist5k") -> torch.Tensor:
    """mnist5k-c / fmnist-c: centre crop of the 32x32 canvas -> ``[n, 1, 28, 28]`` in [0, 1], then
    (mnist5k) the clean train split's statistics, as the clean data set's loader does."""
    h, w = 28, 28
    top, left = (_CORRUPT_SIZE - h) // 2, (_CORRUPT_SIZE - w) // 2
    x = torch.from_numpy(np.ascontiguousarray(gray32[:, top:top + h, left:left + w]))
    x = x.unsqueeze(1).to(torch.float32).div_(255.0)
    if not _base(base).standardize:
        return x
    mean, std = _base_module(_base(base)).train_stats(split_seed)
    return (x - mean) / std


def _check_generated_split(name: str, split: str, augment: bool | None) -> None:
    if augment:
        raise ValueError(f"{name} has no augmentation; augment must be None or False")
    if split not in ("train", "test"):
        raise ValueError(f"split must be one of ['train', 'test'], got {split!r}")


_GENERATED_OPTIONS = ["corruption", "severity", "seed", "split_seed", "cache_dir", "indices", "limit", "cache"]


def _generated_images(name: str, base: str, split: str, augment: bool | None, options: dict[str, Any],
                      extra: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The gray images and labels of a generated ``*-c`` set from its getter's ``options``
    (:data:`_GENERATED_OPTIONS`: corruption, default gaussian_noise; severity, default 5; and
    :func:`corrupted_images`' keywords)."""
    unknown = sorted(set(options) - set(_GENERATED_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name}; valid: {_GENERATED_OPTIONS + list(extra)}")
    _check_generated_split(name, split, augment)
    opts = {"corruption": "gaussian_noise", "severity": 5, **options}
    return corrupted_images(base, opts.pop("corruption"), opts.pop("severity"), split=split, **opts)


def get_digits_c(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, upscale: int = 1, upscale_mode: str = "nearest", **options: Any,
) -> Dataset:
    """digits-c: items ``(x float32 [1, 8*upscale, 8*upscale], y int)`` for one corruption/severity.

    ``options``: ``corruption`` (default gaussian_noise), ``severity`` (default 5), ``seed``,
    ``split_seed``, ``cache_dir``, ``indices``, ``limit`` (the first ``limit`` images of the split),
    ``cache`` (:func:`corrupted_images`). ``split="test"`` is the corrupted test set;
    ``split="train"`` corrupts the train split (for building a corruption subspace, as the paper
    does with Gaussian noise). ``data_dir`` and ``download`` are ignored (generated locally).
    """
    gray, y = _generated_images("digits-c", "digits", split, augment, options, extra=("upscale", "upscale_mode"))
    return ImageTensorDataset(_to_model_input(gray, upscale, upscale_mode, options.get("split_seed", 0)),
                              torch.from_numpy(y.copy()))


def get_mnist5k_c(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, **options: Any,
) -> Dataset:
    """mnist5k-c: items ``(x float32 [1, 28, 28], y int)`` for one corruption/severity of the
    mnist5k ``split``; ``options`` as :func:`get_digits_c`'s (``split_seed`` = mnist5k's split
    seed). ``data_dir`` and ``download`` are ignored (generated locally)."""
    gray, y = _generated_images("mnist5k-c", "mnist5k", split, augment, options)
    return ImageTensorDataset(_crop_to_model_input(gray, options.get("split_seed", 0)), torch.from_numpy(y.copy()))


def get_fmnist_c(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False,
    augment: bool | None = None, **options: Any,
) -> Dataset:
    """fmnist-c: items ``(x float32 [1, 28, 28] in [0, 1], y int)``: one corruption/severity of the
    Fashion-MNIST ``split`` (60,000 train / 10,000 test), made as mnist5k-c is (zero-padded to the
    32x32 canvas, corrupted, centre-cropped back) and left unstandardised like ``fmnist``.
    ``options`` as :func:`get_digits_c`'s (``split_seed`` must be 0: one official split). The clean
    images are found where ``fmnist`` finds them by default (``$SZO_DATA_DIR`` or ``./data``, else
    the Debian package); ``data_dir`` / ``download`` are not used."""
    gray, y = _generated_images("fmnist-c", "fmnist", split, augment, options)
    return ImageTensorDataset(_crop_to_model_input(gray, options.get("split_seed", 0), "fmnist"),
                              torch.from_numpy(y.copy()))


def generate_corrupted(
    base: str, *, splits: Sequence[str] = ("test",), seed: int = 0, split_seed: int = 0,
    cache_dir: str | os.PathLike | None = None, corruptions: Sequence[str] = CORRUPTIONS,
    severities: Sequence[int] = SEVERITIES, progress: bool = True,
) -> dict[str, float]:
    """Fill the cache of ``<base>-c`` for every (split, corruption, severity), with a progress bar;
    returns the seconds spent per corruption (all its splits and severities; ~0 for cache hits)."""
    from tqdm.auto import tqdm

    b = _base(base)
    for s in splits:
        if s not in ("train", "test"):
            raise ValueError(f"split must be one of ['train', 'test'], got {s!r}")
    corruptions = [_check_corruption(c) for c in corruptions]
    severities = [_check_severity(s) for s in severities]
    seconds: dict[str, float] = {}
    jobs = [(c, sp, sv) for c in corruptions for sp in splits for sv in severities]
    with tqdm(total=len(jobs), desc=f"{b.name}-c cache", unit="set", disable=not progress,
              dynamic_ncols=True) as bar:
        for c, sp, sv in jobs:
            bar.set_postfix_str(f"{sp} {c} s{sv}", refresh=True)
            t0 = time.perf_counter()
            corrupted_images(b.name, c, sv, split=sp, seed=seed, split_seed=split_seed, cache_dir=cache_dir,
                             progress=progress)
            seconds[c] = seconds.get(c, 0.0) + time.perf_counter() - t0
            bar.update(1)
    return seconds


def generate_digits_c(
    *, split: str = "test", seed: int = 0, split_seed: int = 0, cache_dir: str | os.PathLike | None = None,
    corruptions: Sequence[str] = CORRUPTIONS, severities: Sequence[int] = SEVERITIES, progress: bool = True,
) -> dict[str, float]:
    """Fill the digits-c cache for every (corruption, severity); returns seconds per corruption."""
    return generate_corrupted("digits", splits=(split,), seed=seed, split_seed=split_seed, cache_dir=cache_dir,
                              corruptions=corruptions, severities=severities, progress=progress)
