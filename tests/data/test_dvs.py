"""DVS128 Gesture loader (through tonic, on tiny files in tonic's on-disk format) and validation."""
from __future__ import annotations

import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from szo.data import dvs
from szo.data import synthetic_events as se

tonic = pytest.importorskip("tonic")

# --------------------------------------------------------------------------- helpers


def _write_recording(folder: Path, label: int, seed: int) -> np.ndarray:
    """A 128x128 recording saved like tonic's preprocessed release: [N, 4] x, y, p, t(ms)."""
    ev = se.generate_sample(label, sensor_size=(128, 128, 2), duration_us=400_000,
                            rng=np.random.default_rng(seed), step_us=10_000)
    raw = np.stack([ev["x"], ev["y"], ev["p"], ev["t"] // 1000], axis=1).astype(np.int64)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{label}.npy", raw)
    return raw


def _hand_frames(raw: np.ndarray, T: int, size: int) -> np.ndarray:
    """Independent oracle: bin events (t in us) into T equal windows from the first event on,
    as tonic's ToFrame(n_time_bins) defines them, on a [T, P, H, W] grid."""
    x, y, p, t = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3] * 1000
    window = (t.max() - t.min()) // T
    k = (t - t.min()) // window
    keep = k < T
    f = 128 // size
    out = np.zeros((T, 2, size, size), dtype=np.float32)
    np.add.at(out, (k[keep], p[keep], y[keep] // f, x[keep] // f), 1)
    return out


@pytest.fixture
def gesture_dir(tmp_path):
    root = tmp_path / "data"
    train = root / "DVSGesture" / "ibmGestureTrain"
    raws = {
        ("user01_fluorescent", 0): _write_recording(train / "user01_fluorescent", 0, 1),
        ("user01_fluorescent", 7): _write_recording(train / "user01_fluorescent", 7, 2),
        ("user02_led", 5): _write_recording(train / "user02_led", 5, 3),
    }
    _write_recording(root / "DVSGesture" / "ibmGestureTest" / "user24_led", 9, 4)
    return root, raws


# --------------------------------------------------------------------------- real loader path


def test_real_loader_frames_match_oracle(gesture_dir):
    root, raws = gesture_dir
    ds = dvs.get_dataset("train", data_dir=root, size=32, denoise_us=None)
    assert len(ds) == 3 and sorted(ds.targets) == [0, 5, 7]
    assert sorted(ds.events_ds.users) == [1, 1, 2]  # tonic parsed the user folders
    for i in range(len(ds)):
        frames, label = ds[i]
        assert frames.dtype == torch.float32 and frames.shape == (20, 2, 32, 32)
        user = Path(ds.events_ds.data[i]).parent.name
        np.testing.assert_array_equal(frames.numpy(), _hand_frames(raws[(user, label)], 20, 32))
    test = dvs.get_dataset("test", data_dir=root, size=64)
    frames, label = test[0]
    assert label == 9 and frames.shape == (20, 2, 64, 64) and frames.sum() > 0


def test_real_loader_denoise_native_size_and_cache(gesture_dir):
    root, _ = gesture_dir
    ds = dvs.get_dataset("train", data_dir=root)  # defaults: T=20, 128x128, Denoise(10 ms)
    frames, label = ds[0]
    assert frames.shape == (20, 2, 128, 128)
    plain, _ = dvs.get_dataset("train", data_dir=root, denoise_us=None, cache=False)[0]
    assert 0 < frames.sum() < 0.9 * plain.sum()  # Denoise dropped the isolated noise events
    cached = sorted((root / "cache").glob("*/train/*.npy"))
    assert len(cached) == 1 and (cached[0].parent.parent / "settings.json").is_file()
    # a second data set with the same settings reads the cache, not the recording
    Path(ds.events_ds.data[0]).write_bytes(b"not an npy file")
    again, label2 = dvs.get_dataset("train", data_dir=root)[0]
    assert label2 == label and torch.equal(again, frames)
    # other settings -> other cache directory
    dvs.get_dataset("train", data_dir=root, T=10, size=32, denoise_us=None)[1]
    assert len(list((root / "cache").iterdir())) == 2


def test_corrupt_cache_entry_is_recomputed(gesture_dir):
    root, _ = gesture_dir
    ds = dvs.get_dataset("train", data_dir=root, size=32, denoise_us=None)
    good = ds[1][0]
    entry = ds._cache_path(ds.cache_dir, 1)
    assert entry.is_file()
    entry.write_bytes(b"garbage")
    assert torch.equal(ds[1][0], good)
    assert np.load(entry, allow_pickle=False).shape == (20, 2, 32, 32)


def test_missing_data_names_path_and_source(tmp_path):
    with pytest.raises(dvs.DataNotFoundError) as info:
        dvs.get_dataset("train", data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nowhere" / "DVSGesture" / "ibmGestureTrain") in msg
    assert "research.ibm.com" in msg and "ibmGestureTrain.tar.gz" in msg and "download=True" in msg


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    def no_network(self):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(tonic.datasets.DVSGesture, "download", no_network)
    with pytest.raises(dvs.DataNotFoundError, match="download failed") as info:
        dvs.get_dataset("test", data_dir=tmp_path, download=True)
    assert str(tmp_path / "DVSGesture" / "ibmGestureTest") in str(info.value)


def test_bad_options(gesture_dir):
    root, _ = gesture_dir
    with pytest.raises(ValueError, match="split must be one of"):
        dvs.get_dataset("validation", data_dir=root)
    with pytest.raises(ValueError, match="size must be a positive int dividing"):
        dvs.get_dataset("train", data_dir=root, size=48)
    with pytest.raises(ValueError, match="unknown option"):
        dvs.get_dataset("train", data_dir=root, frames=20)


# --------------------------------------------------------------------------- validation


def _events(x, y, t, p, dtype=se.EVENT_DTYPE):
    ev = np.zeros(len(x), dtype=dtype)
    ev["x"], ev["y"], ev["t"], ev["p"] = x, y, t, p
    return ev


INT_DTYPE = np.dtype([("x", np.int64), ("y", np.int64), ("t", np.int64), ("p", np.int64)])


def test_validate_drops_and_counts():
    ev = _events(x=[0, 31, 32, -1, 5, 5, 5], y=[0, 31, 0, 3, 40, 5, 5], t=[0, 1, 2, 3, 4, -5, 6],
                 p=[0, 1, 1, 0, 1, 0, 2], dtype=INT_DTYPE)
    clean, rep = dvs.validate_events(ev, (32, 32, 2))
    assert rep.n_in == 7 and rep.n_out == 2 and rep.n_dropped == 5
    assert (rep.n_out_of_sensor, rep.n_bad_time, rep.n_bad_polarity, rep.n_unsorted) == (3, 1, 1, 0)
    assert clean.dtype == INT_DTYPE and clean["x"].tolist() == [0, 31]
    with pytest.raises(ValueError, match=r"3 outside 0<=x<32.*1 with negative.*1 with polarity"):
        dvs.validate_events(ev, (32, 32, 2), policy="raise")


def test_validate_sorts_stably_and_counts():
    ev = _events(x=[1, 2, 3, 4, 5], y=[0] * 5, t=[10, 5, 5, 20, 1], p=[1, 0, 1, 0, 1])
    clean, rep = dvs.validate_events(ev, (32, 32, 2), policy="raise")
    assert rep.n_unsorted == 2 and rep.n_dropped == 0
    assert clean["t"].tolist() == [1, 5, 5, 10, 20]
    assert clean["x"].tolist() == [5, 2, 3, 1, 4]  # equal timestamps keep their order


def test_validate_rejects_wrong_dtype():
    no_p = np.zeros(3, dtype=[("x", np.int16), ("y", np.int16), ("t", np.int64)])
    with pytest.raises(ValueError, match=r"lack field\(s\) \['p'\]; required fields are \('x', 'y', 't', 'p'\)"):
        dvs.validate_events(no_p, (32, 32, 2))
    with pytest.raises(ValueError, match="structured array with fields"):
        dvs.validate_events(np.zeros((3, 4)), (32, 32, 2))
    floaty = np.zeros(2, dtype=[("x", float), ("y", float), ("t", float), ("p", int)])
    with pytest.raises(ValueError, match="field 'x' must be integer"):
        dvs.validate_events(floaty, (32, 32, 2))
    with pytest.raises(ValueError, match="policy must be one of"):
        dvs.validate_events(_events([0], [0], [0], [0]), (32, 32, 2), policy="fix")


def test_validate_float_time_and_empty():
    ev = np.zeros(3, dtype=[("x", np.int16), ("y", np.int16), ("t", np.float64), ("p", bool)])
    ev["t"] = [1.0, np.nan, np.inf]
    clean, rep = dvs.validate_events(ev, (32, 32, 2))
    assert rep.n_bad_time == 2 and len(clean) == 1
    clean, rep = dvs.validate_events(ev[:0], (32, 32, 2))
    assert len(clean) == 0 and rep.n_in == 0


def test_events_to_frames_never_crashes_on_bad_content():
    to_frames = dvs.EventsToFrames(sensor_size=(32, 32, 2), T=20, denoise_us=10000.0)
    all_bad = _events(x=[40, 50], y=[0, 0], t=[0, 1], p=[0, 1], dtype=INT_DTYPE)
    out = to_frames(all_bad)
    assert out.shape == (20, 2, 32, 32) and out.sum() == 0
    good = se.generate_sample(0, rng=np.random.default_rng(0))
    mixed = np.concatenate([good.astype(INT_DTYPE), all_bad])[::-1]  # unsorted, with bad events
    expected = to_frames(good)
    np.testing.assert_array_equal(to_frames(mixed), expected)
    assert expected.dtype == np.float32 and expected.sum() > 0


def test_error_type_and_data_dir_are_the_registry_ones():
    import szo.data

    assert dvs.DataNotFoundError is szo.data.DataNotFoundError  # `except szo.data.DataNotFoundError` catches DVS too
    assert dvs.default_data_dir is szo.data.default_data_dir


# --------------------------------------------------------------------------- streams


def _hand_window(ev: np.ndarray, t0: int, t1: int, bins: int, w: int, h: int, d: int) -> np.ndarray:
    """Independent oracle: every event of [t0, t1) counted once in its time bin and (x // d, y // d) pixel."""
    out = np.zeros((bins, 2, h // d, w // d), dtype=np.float32)
    for x, y, t, p in zip(ev["x"], ev["y"], ev["t"], ev["p"]):
        if t0 <= t < t1:
            out[(t - t0) * bins // (t1 - t0), int(p), y // d, x // d] += 1
    return out


@pytest.mark.parametrize("sensor, d, bins", [((32, 32, 2), 1, 1), ((32, 32, 2), 1, 5), ((96, 48, 2), 3, 2)])
def test_window_frames_match_oracle(sensor, d, bins):
    stream = se.random_stream(3, seed=2, segment_us=60_000, sensor_size=sensor, shift={"noise_rate_hz": 40.0})
    starts = stream.window_starts(30_000)
    assert starts.tolist() == list(range(0, 180_000, 30_000))
    for t0 in starts.tolist():
        got = dvs.window_frames(stream.events, t0, t0 + 30_000, bins, sensor, d)
        np.testing.assert_array_equal(got, _hand_window(stream.events, t0, t0 + 30_000, bins, sensor[0],
                                                        sensor[1], d))
        assert got.dtype == np.float32
    assert sum(float(stream.frames(t, t + 30_000, bins, d).sum()) for t in starts.tolist()) == len(stream.events)


def test_window_frames_empty_window_and_bad_bins():
    ev = _events([1], [2], [5_000], [1])
    out = dvs.window_frames(ev, 10_000, 20_000, 2, (32, 16, 2))
    assert out.shape == (2, 2, 16, 32) and out.sum() == 0  # no events: zeros of the right shape
    with pytest.raises(ValueError, match="multiple of its 3 bins"):
        dvs.window_frames(ev, 0, 10_000, 3, (32, 32, 2))


def test_event_stream_labels_and_range():
    seg = np.array([(100, 200, 4), (200, 300, 7)], dtype=[("start_us", np.int64), ("end_us", np.int64),
                                                           ("label", np.int64)])
    ev = _events([0, 0], [0, 0], [150, 420], [0, 1])
    stream = dvs.EventStream(ev, seg, (32, 32, 2))
    assert stream.window_starts(100).tolist() == [100, 200, 300, 400]  # from the first segment to the last event
    assert stream.labels_at(np.array([150, 250, 350])).tolist() == [4, 7, -1]
    assert dvs.EventStream(ev, None, (32, 32, 2)).labels_at(np.array([150])).tolist() == [-1]
    with pytest.raises(ValueError, match="no complete window"):
        dvs.EventStream(ev[:0], None, (32, 32, 2)).window_starts(100)


def test_load_event_file_validates_and_names_bad_files(tmp_path):
    ev = _events(x=[3, 40, 3], y=[1, 1, 1], t=[20, 10, 5], p=[1, 0, 0], dtype=INT_DTYPE)
    np.save(tmp_path / "ev.npy", ev)
    stream, rep = dvs.load_event_file(tmp_path / "ev.npy", (32, 32, 2))
    assert stream.events["t"].tolist() == [5, 20] and rep.n_dropped == 1 and rep.n_unsorted == 1
    assert stream.segments is None and stream.sensor_size == (32, 32, 2)
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="cannot read .*x.npy as a .npy array without pickle"):
        dvs.load_event_file(tmp_path / "x.npy", (32, 32, 2))
    with pytest.raises(ValueError, match="event file .*missing.npy does not exist"):
        dvs.load_event_file(tmp_path / "missing.npy", (32, 32, 2))
    np.save(tmp_path / "seg.npy", np.zeros(2, dtype=[("start", np.int64), ("label", np.int64)]))
    with pytest.raises(ValueError, match="fields start_us, end_us, label"):
        dvs.load_event_file(tmp_path / "ev.npy", (32, 32, 2), tmp_path / "seg.npy")
