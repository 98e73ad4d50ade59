"""Digits (scikit-learn 8x8), the registry and make_loader."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import szo.data as D
from szo.data import digits


def test_names_and_info():
    assert D.names() == ["digits", "mnist5k", "fmnist", "cifar10", "cifar100", "imagenet", "digits-c", "mnist5k-c",
                         "fmnist-c", "cifar10-c",
                         "cifar100-c", "imagenet-c", "dvs-gesture", "nmnist", "shd", "synthetic-gesture"]
    info = D.dataset_info("digits")
    assert (info.num_classes, info.in_channels, info.image_size, info.is_sequence) == (10, 1, (8, 8), False)
    assert D.dataset_info("dvs-gesture").is_sequence and D.dataset_info("dvs-gesture").default_T == 20
    assert D.dataset_info("cifar100").num_classes == 100
    with pytest.raises(ValueError, match="valid: .*cifar10"):
        D.dataset_info("mnist")
    with pytest.raises(AttributeError):
        info.num_classes = 3  # frozen


def test_unknown_name_split_option():
    with pytest.raises(ValueError, match="unknown data set 'mnist'.*digits"):
        D.get_dataset("mnist", "train")
    with pytest.raises(ValueError, match=r"no split 'val'.*\['train', 'test'\]"):
        D.get_dataset("digits", "val")
    with pytest.raises(ValueError, match="unknown option.*upscal"):
        D.get_dataset("digits", "train", upscal=2)
    with pytest.raises(ValueError, match="upscale must be an int >= 1"):
        D.get_dataset("digits", "train", upscale=0)
    with pytest.raises(ValueError, match="upscale_mode must be one of"):
        D.get_dataset("digits", "train", upscale=2, upscale_mode="bicubic")
    with pytest.raises(ValueError, match="train split only"):
        D.get_dataset("digits", "test", augment=True)


def test_split_sizes_stratified_and_deterministic():
    tr, te = D.get_dataset("digits", "train"), D.get_dataset("digits", "test")
    assert (len(tr), len(te)) == (1437, 360)
    x, y = tr[0]
    assert x.dtype == torch.float32 and x.shape == (1, 8, 8) and isinstance(y, int)
    # stratified: every class has ~20% of its images in test
    full = np.bincount(load_digits().target, minlength=10)
    counts = np.bincount(te.targets.numpy(), minlength=10)
    assert np.all(np.abs(counts - 0.2 * full) <= 1)
    # same seed -> identical; other seed -> a different split
    again = D.get_dataset("digits", "test")
    assert torch.equal(again.images, te.images) and torch.equal(again.targets, te.targets)
    other = D.get_dataset("digits", "test", seed=1)
    assert not torch.equal(other.images, te.images)


def test_standardized_with_train_stats_and_values_match_sklearn():
    tr, te = D.get_dataset("digits", "train"), D.get_dataset("digits", "test")
    assert abs(tr.images.mean().item()) < 1e-5 and abs(tr.images.std(unbiased=False).item() - 1) < 1e-4
    # test split uses the train statistics, so it is not exactly standardized itself
    mean, std = digits.train_stats(0)
    x01, _ = digits.load_split("test", 0)
    assert torch.allclose(te.images[:, 0], (torch.from_numpy(x01.copy()) - mean) / std, atol=1e-6)
    # every test image is a real sklearn image (pixel/16)
    raw = {(im / 16.0).astype(np.float32).tobytes() for im in load_digits().images}
    assert all(im.tobytes() in raw for im in x01)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upscale(mode):
    base = D.get_dataset("digits", "test")
    up = D.get_dataset("digits", "test", upscale=4, upscale_mode=mode)
    assert up.images.shape == (360, 1, 32, 32)
    if mode == "nearest":
        assert torch.equal(up.images[:, :, ::4, ::4], base.images)
    else:
        # align_corners=False at scale 4: output index 4k+2 samples the source at k + 1/8, so
        # bilinear gives 7/8 of pixel k and 1/8 of pixel k+1 along each axis
        b = base.images
        a, c = 7 / 8, 1 / 8
        expected = (a * a * b[..., :7, :7] + a * c * (b[..., 1:, :7] + b[..., :7, 1:]) + c * c * b[..., 1:, 1:])
        assert torch.allclose(up.images[..., 2:30:4, 2:30:4], expected, atol=1e-5)
        assert not torch.equal(up.images[:, :, ::4, ::4], base.images)


def test_shift_augmentation():
    torch.manual_seed(0)
    aug = D.get_dataset("digits", "train", augment=True)
    clean = D.get_dataset("digits", "train")
    mean, std = digits.train_stats(0)
    bg = (0.0 - mean) / std
    shifted = 0
    for i in range(40):
        x, y = aug[i]
        assert x.shape == (1, 8, 8) and y == int(clean.targets[i])
        ref = clean.images[i]
        ok = False
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                exp = torch.full_like(ref, bg)
                exp[..., max(dy, 0):8 + min(dy, 0), max(dx, 0):8 + min(dx, 0)] = \
                    ref[..., max(-dy, 0):8 - max(dy, 0), max(-dx, 0):8 - max(dx, 0)]
                ok |= torch.allclose(x, exp)
        assert ok, f"item {i} is not a <=1 pixel shift of the clean image"
        shifted += not torch.equal(x, ref)
    assert shifted > 20  # 8 of 9 shifts move the image
    up = D.get_dataset("digits", "train", augment=True, upscale=2)
    assert up[0][0].shape == (1, 16, 16)


def test_make_loader_seeded():
    ds = D.get_dataset("digits", "test")
    order = lambda g: torch.cat([y for _, y in D.make_loader(ds, 64, shuffle=True, generator=g)])  # noqa: E731
    a = order(torch.Generator().manual_seed(3))
    b = order(torch.Generator().manual_seed(3))
    c = order(torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert sorted(a.tolist()) == sorted(ds.targets.tolist())
    xb, yb = next(iter(D.make_loader(ds, 7, shuffle=False)))
    assert xb.shape == (7, 1, 8, 8) and yb.dtype == torch.int64
    assert len(D.make_loader(ds, 100, shuffle=False, drop_last=True)) == 3
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        D.make_loader(ds, 0, shuffle=False)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        D.make_loader(ds, 8, shuffle=True, generator=3)
