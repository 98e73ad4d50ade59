"""mnist5k-c: the 15 imagecorruptions on mnist5k (zero-padded to 32x32, gray, centre-cropped),
sharing digits-c's generator and cache (base data set in the key)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import szo.data as D
from szo.data import corrupted, mnist5k


def test_registered_with_both_splits():
    info = D.dataset_info("mnist5k-c")
    assert (info.num_classes, info.in_channels, info.image_size, info.splits) == (10, 1, (28, 28), ("train", "test"))
    assert corrupted.GENERATED == {"digits-c": "digits", "mnist5k-c": "mnist5k", "fmnist-c": "fmnist"}


def test_pad_and_crop_are_exact_inverses_on_clean_images():
    """The geometry: zero-pad 28 -> 32 (centred), crop back; standardised with the clean train stats."""
    x01, _ = mnist5k.load_split("test")
    canvas = corrupted._to_canvas(x01[:3], "pad")
    assert canvas.shape == (3, 32, 32) and canvas.dtype == np.uint8
    assert not canvas[:, :2].any() and not canvas[:, -2:].any() and not canvas[:, :, :2].any()
    back = corrupted._crop_to_model_input(canvas, 0)
    clean = D.get_dataset("mnist5k", "test", limit=3).images
    assert back.shape == (3, 1, 28, 28)
    assert torch.allclose(back, clean, atol=0.6 / 255 / mnist5k.train_stats(0)[1])  # uint8 rounding only


def test_tiny_slice_standardised_deterministic_and_cached(tmp_path, monkeypatch):
    kw = dict(corruption="gaussian_noise", severity=5, cache_dir=tmp_path, indices=[0, 1, 2, 3])
    state = np.random.get_state()
    a = D.get_dataset("mnist5k-c", "test", **kw)
    assert np.array_equal(np.random.get_state()[1], state[1])  # global numpy RNG untouched
    assert a.images.shape == (4, 1, 28, 28) and a.images.dtype == torch.float32
    clean = D.get_dataset("mnist5k", "test", limit=4)
    assert torch.equal(a.targets, clean.targets)
    assert 0.3 < (a.images - clean.images).abs().mean() < 2.0  # visibly corrupted, still the digits
    # standardisation: the centre crop of the cached 32x32 gray canvas with the CLEAN train statistics
    gray, y = corrupted.mnist5k_c_images("gaussian_noise", 5, cache_dir=tmp_path, indices=[0, 1, 2, 3])
    mean, std = mnist5k.train_stats(0)
    assert gray.shape == (4, 32, 32) and gray.dtype == np.uint8 and np.array_equal(y, clean.targets.numpy())
    assert torch.allclose(a.images[:, 0], (torch.from_numpy(gray[:, 2:30, 2:30]).float() / 255 - mean) / std,
                          atol=1e-5)
    (path,) = tmp_path.rglob("*.npy")
    assert path.relative_to(tmp_path).parts[0].startswith("mnist5k-c-v1-imagecorruptions")  # base in the key
    assert "seed0" in str(path) and "/test/" in str(path)
    # per image: fresh generation identical, a subset equals the rows of the larger selection,
    # another seed differs, the same position in the train split differs (the split is in the seed)
    assert torch.equal(D.get_dataset("mnist5k-c", "test", **{**kw, "cache": False}).images, a.images)
    sub = D.get_dataset("mnist5k-c", "test", **{**kw, "indices": [2], "cache": False})
    assert torch.equal(sub.images[0], a.images[2])
    assert not torch.equal(D.get_dataset("mnist5k-c", "test", **{**kw, "seed": 1, "cache": False}).images, a.images)
    tr_gray, _ = corrupted.mnist5k_c_images("gaussian_noise", 5, split="train", cache=False, indices=[0])
    tr_clean = corrupted._to_canvas(mnist5k.load_split("train")[0][:1], "pad").astype(int)
    te_clean = corrupted._to_canvas(mnist5k.load_split("test")[0][:1], "pad").astype(int)
    border = np.zeros((32, 32), bool)
    border[:2], border[-2:], border[:, :2], border[:, -2:] = True, True, True, True  # clean pixels 0 in both
    assert not np.array_equal((tr_gray[0] - tr_clean[0])[border], (gray[0] - te_clean[0])[border])
    # cache hit: with the corruption library disabled, the cached file still serves
    def boom(*_a, **_k):
        raise RuntimeError("should have come from the cache")
    monkeypatch.setattr(corrupted, "_imagecorruptions", boom)
    assert torch.equal(D.get_dataset("mnist5k-c", "test", **kw).images, a.images)
    path.write_bytes(b"garbage")  # a damaged entry is regenerated, not trusted
    with pytest.raises(RuntimeError, match="should have come from the cache"):
        D.get_dataset("mnist5k-c", "test", **kw)


def test_limit_and_the_full_split_cache_serving_subsets(tmp_path, monkeypatch):
    kw = dict(corruption="pixelate", severity=2, cache_dir=tmp_path)  # the cheapest corruption: 1,000 in ~0.3 s
    full = D.get_dataset("mnist5k-c", "test", **kw)
    assert len(full) == 1000 and torch.equal(full.targets, D.get_dataset("mnist5k", "test").targets)
    monkeypatch.setattr(corrupted, "_imagecorruptions", lambda: pytest.fail("subsets come from the full file"))
    first = D.get_dataset("mnist5k-c", "test", limit=5, **kw)
    assert torch.equal(first.images, full.images[:5]) and torch.equal(first.targets, full.targets[:5])
    picked = D.get_dataset("mnist5k-c", "test", indices=[999, 3], **kw)
    assert torch.equal(picked.images, full.images[[999, 3]])
    assert torch.equal(D.get_dataset("mnist5k-c", "test", limit=5, indices=[4], **kw).images, full.images[4:5])
    assert len(list(tmp_path.rglob("*.npy"))) == 1  # served from the full file, nothing new written
    assert corrupted.split_length("mnist5k", "train") == 4000
    assert corrupted.split_length("mnist5k", "test", limit=7) == 7


def test_generate_fills_the_cache_and_reports_seconds(tmp_path):
    seconds = corrupted.generate_corrupted("mnist5k", splits=("test",), cache_dir=tmp_path,
                                           corruptions=["contrast"], severities=[1, 5], progress=False)
    assert list(seconds) == ["contrast"] and seconds["contrast"] > 0
    assert sorted(p.name for p in tmp_path.rglob("*.npy")) == ["contrast-s1.npy", "contrast-s5.npy"]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown corruption 'blur'.*defocus_blur"):
        D.get_dataset("mnist5k-c", "test", corruption="blur", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"severity must be one of \[1, 2, 3, 4, 5\], got 0"):
        D.get_dataset("mnist5k-c", "test", severity=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"indices must be .* \[0, 1000\)"):
        D.get_dataset("mnist5k-c", "test", indices=[1000], cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"indices must be .* \[0, 3\)"):
        D.get_dataset("mnist5k-c", "test", indices=[3], limit=3, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="limit must be a positive int"):
        D.get_dataset("mnist5k-c", "test", limit=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"unknown option.*upscale.*valid: \['corruption'"):
        D.get_dataset("mnist5k-c", "test", upscale=2)
    with pytest.raises(ValueError, match="no augmentation"):
        D.get_dataset("mnist5k-c", "train", augment=True)
    with pytest.raises(ValueError, match="unknown base data set 'cifar10'.*digits.*mnist5k"):
        corrupted.corrupted_images("cifar10", "fog", 1)
    with pytest.raises(ValueError, match="split must be one of"):
        corrupted.generate_corrupted("mnist5k", splits=("val",), cache_dir=tmp_path)
    assert not list(tmp_path.rglob("*.npy"))  # nothing generated by bad calls
