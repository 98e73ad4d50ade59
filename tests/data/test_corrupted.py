"""CIFAR-C (official .npy layout), ImageNet-C (folders) and digits-c (imagecorruptions, cached)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import szo.data as D
from szo.data import corrupted, digits, vision

B = 4  # images per severity block in the generated files (official: 10000)


def test_corruption_names_in_paper_order():
    assert D.CORRUPTIONS == (
        "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
        "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
        "jpeg_compression")
    assert D.SEVERITIES == (1, 2, 3, 4, 5)


def _write_cifar_c(root: Path, folder: str, corruptions=("gaussian_noise", "fog")) -> np.ndarray:
    d = root / folder
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=5 * B).astype(np.uint8)
    for k, c in enumerate(corruptions):
        data = rng.integers(0, 256, size=(5 * B, 32, 32, 3), dtype=np.uint8)
        data[:, 7, 9, 1] = np.arange(5 * B) * 10 + k  # known pixel: encodes row and corruption
        np.save(d / f"{c}.npy", data)
    np.save(d / "labels.npy", labels)
    return labels


@pytest.mark.parametrize("name,folder,stats", [
    ("cifar10-c", "CIFAR-10-C", (vision.CIFAR10_MEAN, vision.CIFAR10_STD)),
    ("cifar100-c", "CIFAR-100-C", (vision.CIFAR100_MEAN, vision.CIFAR100_STD)),
])
def test_cifar_c_blocks_and_pixels(tmp_path, name, folder, stats):
    labels = _write_cifar_c(tmp_path, folder)
    mean, std = stats
    for corruption, k in (("gaussian_noise", 0), ("fog", 1)):
        for severity in (1, 3, 5):
            ds = D.get_dataset(name, "test", data_dir=tmp_path, corruption=corruption, severity=severity)
            assert len(ds) == B
            for i in range(B):
                x, y = ds[i]
                row = (severity - 1) * B + i
                assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == int(labels[row])
                pixel = x[1, 7, 9].item() * std[1] + mean[1]
                assert abs(pixel * 255 - (row * 10 + k)) < 1e-3
    raw = np.load(tmp_path / folder / "fog.npy")
    x, _ = D.get_dataset(name, "test", data_dir=tmp_path, corruption="fog", severity=2)[3]
    ref = (torch.from_numpy(raw[B + 3].astype(np.float32) / 255).permute(2, 0, 1)
           - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    assert torch.allclose(x, ref, atol=1e-6)


def test_cifar_c_errors(tmp_path):
    _write_cifar_c(tmp_path, "CIFAR-10-C")
    with pytest.raises(ValueError, match="unknown corruption 'gauss'.*gaussian_noise.*jpeg_compression"):
        D.get_dataset("cifar10-c", "test", data_dir=tmp_path, corruption="gauss", severity=1)
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ValueError, match=r"severity must be one of \[1, 2, 3, 4, 5\]"):
            D.get_dataset("cifar10-c", "test", data_dir=tmp_path, corruption="fog", severity=bad)
    with pytest.raises(ValueError, match=r"no split 'train'.*\['test'\]"):
        D.get_dataset("cifar10-c", "train", data_dir=tmp_path)
    with pytest.raises(D.DataNotFoundError) as e:
        D.get_dataset("cifar10-c", "test", data_dir=tmp_path, corruption="snow", severity=1)
    assert str(tmp_path / "CIFAR-10-C") in str(e.value) and "snow.npy" in str(e.value)
    with pytest.raises(D.DataNotFoundError, match="CIFAR-100-C.*zenodo"):
        D.get_dataset("cifar100-c", "test", data_dir=tmp_path)
    np.save(tmp_path / "CIFAR-10-C" / "contrast.npy", np.zeros((7, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="not 5 severity blocks"):
        D.get_dataset("cifar10-c", "test", data_dir=tmp_path, corruption="contrast", severity=1)


def test_imagenet_c_folders(tmp_path):
    rng = np.random.default_rng(0)
    for c in ("a_cls", "b_cls"):
        (tmp_path / "fog" / "3" / c).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (240, 250, 3), dtype=np.uint8)).save(tmp_path / "fog" / "3" / c / "0.png")
    ds = D.get_dataset("imagenet-c", "test", data_dir=tmp_path, corruption="fog", severity=3)
    assert len(ds) == 2 and ds[1][0].shape == (3, 224, 224) and ds[1][1] == 1
    with pytest.raises(D.DataNotFoundError, match=str(tmp_path / "fog" / "4")):
        D.get_dataset("imagenet-c", "test", data_dir=tmp_path, corruption="fog", severity=4)


def test_digits_c_deterministic_cached_and_corrupted(tmp_path, monkeypatch):
    kw = dict(corruption="gaussian_noise", severity=5, cache_dir=tmp_path, indices=[0, 1, 2, 3])
    state = np.random.get_state()
    a = D.get_dataset("digits-c", "test", **kw)
    assert np.array_equal(np.random.get_state()[1], state[1])  # global numpy RNG untouched
    assert a.images.shape == (4, 1, 8, 8) and a.images.dtype == torch.float32
    clean = D.get_dataset("digits", "test")
    assert torch.equal(a.targets, clean.targets[:4])
    assert (a.images - clean.images[:4]).abs().mean() > 0.2  # visibly corrupted
    assert (a.images - clean.images[:4]).abs().mean() < 2.0  # ...but still the same digits
    files = list(tmp_path.rglob("*.npy"))
    assert len(files) == 1 and "seed0" in str(files[0])
    # same seed, fresh generation -> identical; other seed -> different
    b = D.get_dataset("digits-c", "test", **{**kw, "cache": False})
    assert torch.equal(a.images, b.images)
    c = D.get_dataset("digits-c", "test", **{**kw, "seed": 1})
    assert not torch.equal(a.images, c.images)
    # a subset holds exactly the same images as the larger selection
    sub = D.get_dataset("digits-c", "test", **{**kw, "indices": [2], "cache": False})
    assert torch.equal(sub.images[0], a.images[2])
    # cache reuse: with the corruption library disabled, the cached file still serves
    def boom(*_a, **_k):
        raise RuntimeError("should have come from the cache")
    monkeypatch.setattr(corrupted, "_imagecorruptions", boom)
    again = D.get_dataset("digits-c", "test", **kw)
    assert torch.equal(again.images, a.images)
    files[0].write_bytes(b"garbage")  # a damaged cache entry is regenerated, not trusted
    with pytest.raises(RuntimeError, match="should have come from the cache"):
        D.get_dataset("digits-c", "test", **kw)


def test_digits_c_sizes_and_seeded_library_calls(tmp_path):
    kw = dict(corruption="impulse_noise", severity=3, cache_dir=tmp_path, indices=[5, 9])
    big = D.get_dataset("digits-c", "test", upscale=4, **kw)
    small = D.get_dataset("digits-c", "test", **kw)
    assert big.images.shape == (2, 1, 32, 32) and small.images.shape == (2, 1, 8, 8)
    # 8x8 input = 4x4 area average of the corrupted 32x32 image (standardization is affine)
    assert torch.allclose(torch.nn.functional.avg_pool2d(big.images, 4), small.images, atol=1e-5)
    # impulse_noise takes a seed= argument in imagecorruptions-imaug: must be fixed by szo too
    gray1, _ = corrupted.digits_c_images("impulse_noise", 3, cache=False, indices=[5, 9])
    gray2, _ = corrupted.digits_c_images("impulse_noise", 3, cache=False, indices=[5, 9])
    assert np.array_equal(gray1, gray2) and gray1.dtype == np.uint8 and gray1.shape == (2, 32, 32)
    mean, std = digits.train_stats(0)
    assert torch.allclose(big.images[:, 0], (torch.from_numpy(gray1).float() / 255 - mean) / std, atol=1e-5)
    train = D.get_dataset("digits-c", "train", corruption="contrast", severity=1, cache_dir=tmp_path, indices=[0])
    assert torch.equal(train.targets, D.get_dataset("digits", "train").targets[:1])


def test_digits_c_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown corruption 'blur'.*defocus_blur"):
        D.get_dataset("digits-c", "test", corruption="blur", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="severity must be one of"):
        D.get_dataset("digits-c", "test", severity=9, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"indices must be .* \[0, 360\)"):
        D.get_dataset("digits-c", "test", indices=[360], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown option.*severty"):
        D.get_dataset("digits-c", "test", severty=2)
    with pytest.raises(ValueError, match="no augmentation"):
        D.get_dataset("digits-c", "test", augment=True)
