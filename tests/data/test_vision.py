"""CIFAR-10/100 through torchvision's real loader on generated official-format files; ImageFolder.

The official CIFAR "python version" batches are Python 2 pickles of a dict whose keys are
Python 2 ``str`` (read back as ``b'data'`` with ``encoding='bytes'``, as ``'data'`` with
``encoding='latin1'``, which torchvision uses). ``_py2_dict_pickle`` writes the same opcodes
(SHORT_BINSTRING keys and strings), with the numpy array pickled by numpy itself.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import szo.data as D
from szo.data import vision


def _py2_str(s: str) -> bytes:
    b = s.encode("latin1")
    assert len(b) < 256
    return b"U" + bytes([len(b)]) + b  # SHORT_BINSTRING: a Python 2 str


def _py2_value(v) -> bytes:
    if isinstance(v, str):
        return _py2_str(v)
    if isinstance(v, list) and v and isinstance(v[0], str):
        return b"](" + b"".join(_py2_str(s) for s in v) + b"e"  # EMPTY_LIST MARK ... APPENDS
    body = pickle.dumps(v, protocol=2)
    return body[2:-1]  # strip PROTO 2 and STOP


def _py2_dict_pickle(d: dict) -> bytes:
    out = b"\x80\x02}("  # PROTO 2, EMPTY_DICT, MARK
    for k, v in d.items():
        out += _py2_str(k) + _py2_value(v)
    return out + b"u."  # SETITEMS, STOP


def _write_cifar(root: Path, which: str, n_per_batch: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """Tiny CIFAR-10 (5 train batches + test) or CIFAR-100 (train + test) in the official layout."""
    rng = np.random.default_rng(seed)
    if which == "cifar10":
        folder = root / "cifar-10-batches-py"
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        label_key, n_cls = "labels", 10
        meta_name, meta = "batches.meta", {"num_cases_per_batch": 10000, "label_names":
                                           [f"class{i}" for i in range(10)], "num_vis": 3072}
    else:
        folder = root / "cifar-100-python"
        files = ["train", "test"]
        label_key, n_cls = "fine_labels", 100
        meta_name, meta = "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                                   "coarse_label_names": [f"coarse{i}" for i in range(20)]}
    folder.mkdir(parents=True)
    written = {}
    for name in files:
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, n_cls, size=n_per_batch)]
        entry = {"batch_label": f"batch {name}", label_key: labels, "data": data,
                 "filenames": [f"img_{name}_{i}.png" for i in range(n_per_batch)]}
        if which == "cifar100":
            entry["coarse_labels"] = [v // 5 for v in labels]
        (folder / name).write_bytes(_py2_dict_pickle(entry))
        written[name] = (data, labels)
    (folder / meta_name).write_bytes(_py2_dict_pickle(meta))
    return written


def test_py2_pickle_writer_matches_the_official_key_types(tmp_path):
    blob = _py2_dict_pickle({"data": np.arange(3, dtype=np.uint8), "labels": [1, 2]})
    as_bytes = pickle.loads(blob, encoding="bytes")
    assert set(as_bytes) == {b"data", b"labels"}
    as_latin1 = pickle.loads(blob, encoding="latin1")
    assert as_latin1["labels"] == [1, 2] and as_latin1["data"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("which", ["cifar10", "cifar100"])
def test_cifar_through_torchvision_loader(tmp_path, which):
    written = _write_cifar(tmp_path, which)
    train_files = [k for k in written if k not in ("test_batch", "test")]
    test_file = "test_batch" if which == "cifar10" else "test"
    test = D.get_dataset(which, "test", data_dir=tmp_path)
    assert len(test) == 6
    mean = torch.tensor(vision.CIFAR10_MEAN if which == "cifar10" else vision.CIFAR100_MEAN).view(3, 1, 1)
    std = torch.tensor(vision.CIFAR10_STD if which == "cifar10" else vision.CIFAR100_STD).view(3, 1, 1)
    data, labels = written[test_file]
    for i in (0, 5):
        x, y = test[i]
        assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and y == labels[i]
        raw = torch.from_numpy(data[i].reshape(3, 32, 32).astype(np.float32)) / 255.0  # official: CHW rows
        assert torch.allclose(x, (raw - mean) / std, atol=1e-5)
    train = D.get_dataset(which, "train", data_dir=tmp_path)  # augmented by default
    assert len(train) == 6 * len(train_files)
    assert train.targets == sum((written[f][1] for f in train_files), [])
    torch.manual_seed(0)
    xs = torch.stack([train[0][0] for _ in range(12)])
    assert xs.shape == (12, 3, 32, 32)
    assert any(not torch.equal(xs[0], v) for v in xs[1:])
    plain = D.get_dataset(which, "train", data_dir=tmp_path, augment=False)
    raw0 = torch.from_numpy(written[train_files[0]][0][0].reshape(3, 32, 32).astype(np.float32)) / 255.0
    assert torch.allclose(plain[0][0], (raw0 - mean) / std, atol=1e-5)
    # each augmented view = a 32x32 crop of the zero-padded (pad 4) image, maybe flipped
    padded = torch.nn.functional.pad(raw0, (4, 4, 4, 4))
    crops = torch.stack([padded[:, i:i + 32, j:j + 32] for i in range(9) for j in range(9)])
    cands = (torch.cat([crops, crops.flip(-1)]) - mean) / std
    for v in xs:
        assert ((cands - v).abs().amax(dim=(1, 2, 3)) < 1e-5).any()
    b = D.make_loader(train, 4, shuffle=True, generator=torch.Generator().manual_seed(0))
    xb, yb = next(iter(b))
    assert xb.shape == (4, 3, 32, 32) and yb.dtype == torch.int64


def test_cifar_official_md5_check_rejects_generated_files(tmp_path):
    _write_cifar(tmp_path, "cifar10")
    with pytest.raises(D.DataNotFoundError, match="failed torchvision's check"):
        D.get_dataset("cifar10", "test", data_dir=tmp_path, verify_md5=True)


def test_cifar_missing(tmp_path):
    with pytest.raises(D.DataNotFoundError) as e:
        D.get_dataset("cifar10", "train", data_dir=tmp_path / "nowhere")
    msg = str(e.value)
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in msg and "data_batch_1" in msg
    assert "cifar-10-python.tar.gz" in msg and "data.download=true" in msg and "\n" not in msg
    with pytest.raises(D.DataNotFoundError, match="cifar-100-python"):
        D.get_dataset("cifar100", "test", data_dir=tmp_path)
    with pytest.raises(ValueError, match="train split only"):
        D.get_dataset("cifar10", "test", data_dir=tmp_path, augment=True)


def _write_image_folder(root: Path, classes=("cat", "dog"), n=2, size=(40, 30)) -> None:
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_imagenet_image_folder(tmp_path):
    _write_image_folder(tmp_path / "train")
    _write_image_folder(tmp_path / "val", size=(300, 260))
    train = D.get_dataset("imagenet", "train", data_dir=tmp_path)
    test = D.get_dataset("imagenet", "test", data_dir=tmp_path)
    assert len(train) == 4 and len(test) == 4 and train.classes == ["cat", "dog"]
    x, y = train[3]
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32 and y == 1
    # eval pipeline = Resize(256) + CenterCrop(224) + normalize, checked against PIL directly
    img = Image.open(tmp_path / "val" / "cat" / "0.png").convert("RGB")
    w, h = 256 * 300 // 260, 256  # shorter side -> 256
    ref = np.asarray(img.resize((w, h), Image.BILINEAR), dtype=np.float32) / 255.0
    top, left = int(round((h - 224) / 2)), int(round((w - 224) / 2))
    ref = torch.from_numpy(ref[top:top + 224, left:left + 224].copy()).permute(2, 0, 1)
    ref = (ref - torch.tensor(vision.IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(vision.IMAGENET_STD).view(3, 1, 1)
    assert torch.allclose(test[0][0], ref, atol=0.1)  # PIL vs torchvision antialias resampling
    with pytest.raises(D.DataNotFoundError, match=str(tmp_path / "missing" / "val")):
        D.get_dataset("imagenet", "test", data_dir=tmp_path / "missing")
    with pytest.raises(D.DataNotFoundError, match="manual download"):
        D.get_dataset("imagenet", "train", data_dir=tmp_path, download=True)
