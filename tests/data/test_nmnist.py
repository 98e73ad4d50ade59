"""N-MNIST through tonic on one real recording (tests/data/nmnist/README.md: origin, format,
attribution), laid out in N-MNIST's on-disk format: the loader, szo's binning against tonic's
``ToFrame``, the recipes' data path, the streaming demo on the recording's events."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from szo.data import DataNotFoundError, dataset_info, dvs, get_dataset, nmnist

tonic = pytest.importorskip("tonic")

RECORDING = Path(__file__).parent / "nmnist" / "sample_nmnist.bin"
LABEL = 3  # the recording's digit is not known (README): it is filed under this arbitrary label


@pytest.fixture
def nmnist_dir(tmp_path):
    """``<root>/NMNIST/{Train,Test}/3/00001.bin``: the extracted layout, without the archives."""
    root = tmp_path / "data"
    for split in ("Train", "Test"):
        folder = root / "NMNIST" / split / str(LABEL)
        folder.mkdir(parents=True)
        shutil.copyfile(RECORDING, folder / "00001.bin")
    return root


def _events() -> np.ndarray:
    return tonic.io.read_mnist_file(str(RECORDING), dtype=tonic.datasets.NMNIST.dtype)


def test_the_recording_is_what_its_readme_says():
    ev = _events()
    assert len(ev) == 4325 and int(ev["p"].sum()) == 2145
    assert (ev["x"].min(), ev["x"].max(), ev["y"].min(), ev["y"].max()) == (0, 33, 0, 33)
    assert (ev["t"].min(), ev["t"].max()) == (654, 311175)


def test_loader_reads_the_real_recording_without_the_archive(nmnist_dir):
    assert dataset_info("nmnist").image_size == (34, 34) and dataset_info("nmnist").in_channels == 2
    for split in ("train", "test"):
        ds = get_dataset("nmnist", split, data_dir=nmnist_dir, T=10, cache=False)
        assert len(ds) == 1 and ds.targets == [LABEL]
        frames, label = ds[0]
        assert label == LABEL and frames.dtype == torch.float32 and frames.shape == (10, 2, 34, 34)
        events, _ = ds.events_ds[0]  # tonic's own NMNIST reader under szo's offline existence check
        assert len(events) == 4325 and int(frames.sum()) <= 4325 and frames.sum() > 4000
    assert not list((nmnist_dir / "NMNIST").glob("*.zip"))


@pytest.mark.parametrize("T", [1, 10, 25])
def test_szo_binning_equals_tonic_to_frame(nmnist_dir, T):
    """szo's event -> frame pipeline (validation, then ToFrame) on the recording gives tonic's
    ``ToFrame(n_time_bins=T)`` of the raw events, through the data set and directly."""
    ev = _events()
    want = tonic.transforms.ToFrame(sensor_size=nmnist.SENSOR_SIZE, n_time_bins=T)(ev)
    got = dvs.EventsToFrames(sensor_size=nmnist.SENSOR_SIZE, T=T, denoise_us=None)(ev)
    np.testing.assert_array_equal(got, want)
    frames, _ = get_dataset("nmnist", "test", data_dir=nmnist_dir, T=T)[0]
    np.testing.assert_array_equal(frames.numpy(), want)
    frames, _ = get_dataset("nmnist", "test", data_dir=nmnist_dir, T=T)[0]  # the cached frames: the same
    np.testing.assert_array_equal(frames.numpy(), want)
    # the streaming path: fixed windows of the stream, each tonic's ToFrame(time_window) over it
    stream, rep = dvs.load_event_file(RECORDING, nmnist.SENSOR_SIZE)
    assert rep.n_in == rep.n_out == 4325 and rep.n_unsorted == 0
    for t0 in stream.window_starts(50_000).tolist():
        want_w = tonic.transforms.ToFrame(sensor_size=nmnist.SENSOR_SIZE, time_window=10_000, start_time=t0,
                                          end_time=t0 + 50_000)(ev[(ev["t"] >= t0) & (ev["t"] < t0 + 50_000)])
        np.testing.assert_array_equal(stream.frames(t0, t0 + 50_000, 5).numpy(), want_w)


def test_a_missing_set_is_one_line_saying_where_to_put_it(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        get_dataset("nmnist", "train", data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "nowhere" / "NMNIST" / "Train") in msg
    assert "garrickorchard.com" in msg and "train.zip" in msg and "unzip" in msg and "download=True" in msg
    with pytest.raises(ValueError, match="unknown option"):
        get_dataset("nmnist", "test", data_dir=tmp_path, frames=3)
    bad = tmp_path / "r.bin"
    bad.write_bytes(RECORDING.read_bytes()[:-2])
    with pytest.raises(ValueError, match="not an N-MNIST recording: 21623 bytes"):
        dvs.load_event_file(bad, nmnist.SENSOR_SIZE)


@pytest.mark.parametrize("fit", ["crop", "downsample"])
def test_the_recipes_resolution_option_is_tonics_transforms(nmnist_dir, fit):
    """``data.kwargs={size: 32, fit: crop}``: the 34 x 34 recordings as a 32 x 32 sensor (tonic's CenterCrop
    or Downsample, then ToFrame), e.g. for a model trained at 32 x 32; a size that fits nothing is one line."""
    ev = _events()
    moved = (tonic.transforms.CenterCrop(sensor_size=nmnist.SENSOR_SIZE, size=(32, 32)) if fit == "crop" else
             tonic.transforms.Downsample(sensor_size=nmnist.SENSOR_SIZE, target_size=(32, 32)))(ev)
    want = tonic.transforms.ToFrame(sensor_size=(32, 32, 2), n_time_bins=4)(moved)
    frames, _ = get_dataset("nmnist", "test", data_dir=nmnist_dir, T=4, size=32, fit=fit, cache=False)[0]
    np.testing.assert_array_equal(frames.numpy(), want)
    with pytest.raises(ValueError, match="size must be a positive int dividing"):
        get_dataset("nmnist", "test", data_dir=nmnist_dir, T=4, size=32)
    with pytest.raises(ValueError, match="smaller than the model's 40x40"):
        get_dataset("nmnist", "test", data_dir=nmnist_dir, T=4, size=40, fit=fit)


def test_a_truncated_recording_in_the_set_is_one_line_naming_it(nmnist_dir):
    bad = nmnist_dir / "NMNIST" / "Test" / str(LABEL) / "00002.bin"
    bad.write_bytes(RECORDING.read_bytes()[:-2])  # a copy cut short by two bytes
    ds = get_dataset("nmnist", "test", data_dir=nmnist_dir, T=4, cache=False)
    index = [str(p) for p in ds.events_ds.data].index(str(bad))
    with pytest.raises(ValueError) as info:
        ds[index]
    assert "\n" not in str(info.value) and f"cannot read recording {bad}" in str(info.value)
    assert ds[1 - index][0].shape == (4, 2, 34, 34)  # the good one still loads


def test_nmnist_recipes_run_on_the_recording(nmnist_dir, tmp_path, monkeypatch):
    """nmnist-bp -> nmnist-scratch end to end on the one recording (filed as train and test), with a
    small model in place of the recipe's Spike-VGG11."""
    from szo.config import load_recipe
    from szo.pipeline import run_recipe

    monkeypatch.setenv("SZO_DATA_DIR", str(nmnist_dir))
    cfg = load_recipe("nmnist-scratch")
    assert (cfg["model"]["name"], cfg["model"]["T"], cfg["data"]["kwargs"]["T"], cfg["data"]["batch_size"]) == \
        ("spike_vgg11", 20, 20, 16)
    sets = ["model.name=spike_convnet", "model.kwargs={width: 4}", "model.T=4", "data.kwargs={T: 4}",
            "data.num_workers=0", "progress=false", "bptt.epochs=1", "trajectory.every=1", "subspace.k=1",
            f"subspace.root={tmp_path / 'subspaces'}"]
    s = run_recipe(load_recipe("nmnist-bp", sets), tmp_path / "bp")
    assert s["dataset"] == "nmnist" and s["bp"] == 1 and s["best_test_acc"] is not None
    s = run_recipe(load_recipe("nmnist-scratch", sets + ["train.epochs=1"]), tmp_path / "scratch")
    assert s["label"] == "SZO-CGE" and s["bp"] == 0 and s["fp"] >= 2


def test_streaming_demo_runs_on_the_recording(tmp_path):
    """``szo demo dvs-stream`` on the recording's events (the .bin read as a stream, 50 ms windows
    of 5 frames, carried neuron state) with a model exported for N-MNIST's 34 x 34 sensor."""
    pytest.importorskip("nir")
    from szo.demos.cli import main
    from szo.export import to_nir, write_nir
    from szo.models import create

    torch.manual_seed(0)
    model = create("spike_convnet", in_channels=2, num_classes=10, T=5, width=4).eval()
    write_nir(to_nir(model, (2, 34, 34), metadata={"bin_us": 10_000, "sensor_size": [34, 34, 2],
                                                    "duration_us": 300_000}), tmp_path / "m.nir")
    out = tmp_path / "out"
    assert main(["dvs-stream", "--source", str(RECORDING), "--model", str(tmp_path / "m.nir"), "--adapt", "none",
                 "--window-ms", "50", "--out", str(out), "--print-every", "0"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["n_events"] == 4325 and s["validation"]["n_dropped"] == 0
    run = s["runs"]["none"]
    assert run["n_windows"] == 7 and run["bins_per_window"] == 5  # 654 .. 311,175 us in 50 ms windows
