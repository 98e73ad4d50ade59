"""fmnist: torchvision's FashionMNIST over files in the official IDX format (tiny ones the test writes)."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from szo.data import fmnist, get_dataset
from szo.data.registry import DataNotFoundError


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX format (LeCun's MNIST / Fashion-MNIST files): magic 0x0000 0x08 ndim, big-endian dims, uint8 data."""
    head = struct.pack(">HBB", 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", n) for n in arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def write_fmnist(raw, n_train=12, n_test=6, *, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    raw.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        out[split] = (x, y)
        for name, arr in ((f"{split}-images-idx3-ubyte", x), (f"{split}-labels-idx1-ubyte", y)):
            blob = idx_bytes(arr)
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(blob))
            else:
                (raw / name).write_bytes(blob)
    return out


@pytest.fixture(autouse=True)
def no_debian(monkeypatch, tmp_path):
    """Tests see neither the Debian package nor the user's cache."""
    monkeypatch.setattr(fmnist, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("gz", [True, False])
def test_reads_official_layout_as_totensor_values(tmp_path, gz):
    import torchvision

    data = write_fmnist(tmp_path / "d" / "FashionMNIST" / "raw", gz=gz)
    tr = get_dataset("fmnist", "train", data_dir=tmp_path / "d")
    te = get_dataset("fmnist", "test", data_dir=tmp_path / "d")
    assert (len(tr), len(te)) == (12, 6)
    x, y = te[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == int(data["t10k"][1][3])
    ref = torchvision.datasets.FashionMNIST(str(tmp_path / "d"), train=False,
                                            transform=torchvision.transforms.ToTensor())
    torch.testing.assert_close(x, ref[3][0], rtol=0, atol=0)  # exactly ToTensor's values
    assert get_dataset("fmnist", "train", data_dir=tmp_path / "d", limit=5).targets.tolist() == \
        data["train"][1][:5].tolist()


def test_debian_package_is_found_and_extracted_into_the_cache(tmp_path, monkeypatch):
    deb = tmp_path / "usr-share-datasets-fashion-mnist"
    data = write_fmnist(deb)
    monkeypatch.setattr(fmnist, "DEBIAN_DIR", deb)
    ds = get_dataset("fmnist", "test", data_dir=tmp_path / "empty")
    assert ds.targets.tolist() == data["t10k"][1].tolist()
    assert (tmp_path / "cache" / "szo" / "fashion-mnist" / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte").is_file()
    assert not (tmp_path / "empty").exists()


def test_missing_data_is_one_line_naming_both_ways(tmp_path):
    with pytest.raises(DataNotFoundError) as e:
        get_dataset("fmnist", "train", data_dir=tmp_path / "nothing")
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install dataset-fashion-mnist" in msg and "data.download=true" in msg
    assert str(tmp_path / "nothing" / "FashionMNIST" / "raw") in msg


def test_bad_files_and_options_are_one_line(tmp_path):
    raw = tmp_path / "d" / "FashionMNIST" / "raw"
    write_fmnist(raw)
    (raw / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(DataNotFoundError, match="not a readable gzip file"):
        get_dataset("fmnist", "test", data_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="no augmentation"):
        get_dataset("fmnist", "train", data_dir=tmp_path / "d", augment=True)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['upscale'\] for fmnist"):
        get_dataset("fmnist", "train", data_dir=tmp_path / "d", upscale=2)


@pytest.mark.parametrize("recipe", ["fmnist-bp", "fmnist-cpu-bp", "fmnist-scratch", "fmnist-continual"])
def test_recipe_without_data_fails_in_one_line_before_work(recipe, tmp_path, capsys):
    from szo.cli import main

    rc = main(["recipe", recipe, "--out", str(tmp_path / "run"), "--set", f"data.data_dir={tmp_path / 'none'}",
               "--set", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Fashion-MNIST not found" in err[0] and "apt-get install" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fmnist_c_is_mnist5k_c_geometry_unstandardised_and_deterministic(tmp_path, monkeypatch):
    """fmnist-c from tiny official-format files: the clean image padded, corrupted, cropped back, in [0, 1]."""
    data = write_fmnist(tmp_path / "d" / "FashionMNIST" / "raw", n_test=5)
    monkeypatch.setenv("SZO_DATA_DIR", str(tmp_path / "d"))
    kw = dict(corruption="gaussian_noise", severity=3, cache_dir=tmp_path / "cache-c")
    a = get_dataset("fmnist-c", "test", **kw)
    assert a.images.shape == (5, 1, 28, 28) and a.targets.tolist() == data["t10k"][1].tolist()
    assert 0.0 <= float(a.images.min()) and float(a.images.max()) <= 1.0  # not standardised, like fmnist
    clean = get_dataset("fmnist", "test").images
    assert 0.02 < float((a.images - clean).abs().mean()) < 0.5  # visibly corrupted, still the images
    torch.testing.assert_close(get_dataset("fmnist-c", "test", **kw).images, a.images, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one official split"):
        get_dataset("fmnist-c", "test", split_seed=1, cache_dir=tmp_path / "cache-c")
