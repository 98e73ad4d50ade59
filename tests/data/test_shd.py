"""SHD (Spiking Heidelberg Digits) through tonic's own reader, on a tiny file written in SHD's HDF5
layout (spikes/times and spikes/units as variable-length arrays per recording, labels, extra/keys,
extra/speaker): the binned frames, a missing set in one line, the feed-forward and recurrent LIF
networks, and ``shd-bp`` -> ``shd-scratch`` end to end."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from szo.data import DataNotFoundError, dataset_info, get_dataset
from szo.models import create

tonic = pytest.importorskip("tonic")
h5py = pytest.importorskip("h5py")

N_REC = 4


def write_shd(path, n: int = N_REC, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """A file in SHD's layout (what the official shd_{train,test}.h5 hold); returns what it wrote."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    with h5py.File(path, "w") as f:
        times = f.create_dataset("spikes/times", (n,), dtype=h5py.vlen_dtype(np.dtype("float16")))
        units = f.create_dataset("spikes/units", (n,), dtype=h5py.vlen_dtype(np.dtype("uint16")))
        labels = (np.arange(n) * 7) % 20
        for i in range(n):
            t = np.sort(rng.uniform(0.0, 0.9, 40)).astype(np.float16)
            u = rng.integers(0, 700, 40).astype(np.uint16)
            times[i], units[i] = t, u
            written.append((t, u, int(labels[i])))
        f.create_dataset("labels", data=labels.astype(np.uint16))
        f.create_dataset("extra/keys", data=np.array([f"digit-{i}".encode() for i in range(20)]))
        f.create_dataset("extra/speaker", data=np.arange(n, dtype=np.uint16) % 3)
        f.create_dataset("extra/meta_info/gender", data=np.zeros(n, np.uint8))
    return written


@pytest.fixture
def shd_dir(tmp_path):
    root = tmp_path / "data"
    write_shd(root / "SHD" / "shd_train.h5")
    write_shd(root / "SHD" / "shd_test.h5", seed=1)
    return root


def test_frames_are_tonics_events_binned(shd_dir):
    written = write_shd(shd_dir / "SHD" / "shd_train.h5")
    ds = get_dataset("shd", "train", data_dir=shd_dir, T=10, bin_ms=100.0)
    assert len(ds) == N_REC and dataset_info("shd").num_classes == 20
    for i, (t, u, label) in enumerate(written):
        frames, y = ds[i]
        assert frames.shape == (10, 1, 1, 700) and y == label
        want = np.zeros((10, 700), np.float32)  # spike i in bin floor(t_us / 100 ms) of its unit
        np.add.at(want, ((t.astype(np.float64) * 1e6).astype(np.int64) // 100_000, u.astype(np.int64)), 1)
        np.testing.assert_array_equal(frames[:, 0, 0].numpy(), want)
    short = get_dataset("shd", "train", data_dir=shd_dir, T=2, bin_ms=100.0)[0][0]  # spikes after 200 ms: outside
    assert short.shape == (2, 1, 1, 700) and short.sum() < 40


def test_a_missing_set_is_one_line_saying_where_to_put_it(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        get_dataset("shd", "train", data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "nowhere" / "SHD" / "shd_train.h5") in msg
    assert "zenkelab.org/datasets/shd_train.h5.zip" in msg and "unzip" in msg
    with pytest.raises(ValueError, match="unknown option"):
        get_dataset("shd", "test", data_dir=tmp_path, frames=3)
    (tmp_path / "SHD").mkdir()
    (tmp_path / "SHD" / "shd_test.h5").write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match="cannot read .*shd_test.h5 as SHD"):
        get_dataset("shd", "test", data_dir=tmp_path)


@pytest.mark.parametrize("name", ["snn_mlp", "snn_rlif"])
def test_lif_networks_run_frames_and_carry_state(name):
    torch.manual_seed(0)
    model = create(name, num_classes=20, T=6, hidden=8)
    x = (torch.rand(6, 3, 1, 1, 700) < 0.05).float()
    y = model(x)
    assert y.shape == (6, 3, 20) and torch.equal(y, model(x))  # state reset between forwards
    with model.persistent_state():  # two halves with carried state: the whole sequence
        halves = torch.cat([model(x[:3]), model(x[3:])])
    torch.testing.assert_close(halves, y)
    with pytest.raises(ValueError, match="takes frames of 700 values"):
        model(torch.zeros(6, 3, 1, 1, 10))


def test_recurrent_layer_feeds_back_its_spikes():
    torch.manual_seed(0)
    model = create("snn_rlif", num_classes=20, T=6, hidden=8)
    x = (torch.rand(6, 2, 1, 1, 700) < 0.2).float()
    with torch.no_grad():
        model.hidden[0].fc.weight.fill_(0.01)  # ~140 active inputs: a drive of ~1.4, the hidden layer spikes
        model.hidden[0].rec.weight.zero_()
        ff = create("snn_mlp", num_classes=20, T=6, hidden=8)
        ff.hidden[0].weight.copy_(model.hidden[0].fc.weight)
        ff.hidden[0].bias.copy_(model.hidden[0].fc.bias)
        ff.fc.load_state_dict(model.fc.state_dict())
        torch.testing.assert_close(ff(x), model(x))  # without recurrent weights: the feed-forward network
        model.hidden[0].rec.weight.fill_(-1.0)  # each spike inhibits the next step
        assert not torch.allclose(ff(x), model(x))


def test_shd_recipes_run_end_to_end_on_the_tiny_file(shd_dir, tmp_path, monkeypatch):
    """``shd-bp`` then ``shd-scratch`` (the BPTT trajectory's subspace, SZO-CGE) on the file in SHD's layout,
    found through SZO_DATA_DIR as the other recipes find their data, with a small network."""
    from szo.config import load_recipe
    from szo.pipeline import run_recipe

    monkeypatch.setenv("SZO_DATA_DIR", str(shd_dir))
    cfg = load_recipe("shd-scratch")
    assert (cfg["model"]["name"], cfg["data"]["name"], cfg["method"]) == ("snn_rlif", "shd", "szo-cge")
    sets = ["model.T=5", "data.kwargs={T: 5, bin_ms: 200.0}", "model.kwargs={hidden: 8}", "data.batch_size=2",
            "bptt.epochs=2", "trajectory.every=1", "subspace.k=2", "progress=false",
            f"subspace.root={tmp_path / 'subspaces'}"]
    s = run_recipe(load_recipe("shd-bp", sets), tmp_path / "bp")
    assert s["dataset"] == "shd" and s["bp"] > 0 and s["best_test_acc"] is not None
    s = run_recipe(load_recipe("shd-scratch", sets + ["train.epochs=1"]), tmp_path / "scratch")
    assert s["label"] == "SZO-CGE" and s["bp"] == 0 and s["fp"] >= 2
