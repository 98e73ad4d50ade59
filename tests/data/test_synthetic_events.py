"""Synthetic event-camera gestures: determinism, tonic validity, separability, streams."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from szo.data import synthetic_events as se
from szo.data.dvs import validate_events

tonic = pytest.importorskip("tonic")

SENSOR = (32, 32, 2)


def test_same_seed_identical_different_seed_differs():
    a = se.generate_sample(5, rng=np.random.default_rng(7))
    b = se.generate_sample(5, rng=np.random.default_rng(7))
    c = se.generate_sample(5, rng=np.random.default_rng(8))
    assert a.dtype == b.dtype and np.array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


@pytest.mark.parametrize("label", range(len(se.CLASSES)))
def test_events_valid_for_tonic(label):
    ev = se.generate_sample(label, sensor_size=SENSOR, duration_us=300_000, rng=np.random.default_rng(label))
    assert ev.dtype == tonic.io.events_struct  # tonic's event dtype: x, y int16, t int64 (us), p bool
    assert len(ev) > 200
    assert np.all(np.diff(ev["t"]) >= 0)
    assert ev["x"].min() >= 0 and ev["x"].max() < SENSOR[0]
    assert ev["y"].min() >= 0 and ev["y"].max() < SENSOR[1]
    assert ev["t"].min() >= 0 and ev["t"].max() < 300_000
    assert set(np.unique(ev["p"].astype(int))) == {0, 1}
    clean, report = validate_events(ev, SENSOR, policy="raise")
    assert report.n_dropped == 0 and report.n_unsorted == 0 and np.array_equal(clean, ev)
    frames = tonic.transforms.ToFrame(sensor_size=SENSOR, n_time_bins=20)(ev)
    assert frames.shape == (20, 2, 32, 32)


def test_polarity_follows_brightness():
    # an expanding ring brightens its outside edge: more ON than OFF events; contracting: the reverse
    zin = se.generate_sample(8, rng=np.random.default_rng(0), noise_rate_hz=0.0)
    zout = se.generate_sample(9, rng=np.random.default_rng(0), noise_rate_hz=0.0)
    assert zin["p"].mean() > 0.55 and zout["p"].mean() < 0.45


def test_noise_rate_matches():
    quiet = se.generate_sample(10, rng=np.random.default_rng(1), noise_rate_hz=0.0)
    noisy = se.generate_sample(10, rng=np.random.default_rng(1), noise_rate_hz=20.0)
    expected = 20.0 * 32 * 32 * 0.5  # events/s/pixel * pixels * seconds
    extra = len(noisy) - len(quiet)
    assert abs(extra - expected) < 5 * np.sqrt(expected) + 0.1 * len(quiet)


def test_dataset_frames_and_determinism():
    train = se.SyntheticGesture(2, "train")
    test = se.SyntheticGesture(2, "test")
    assert len(train) == 22 and train.targets[:12] == list(range(11)) + [0]
    x, y = train[3]
    assert x.dtype == torch.float32 and x.shape == (20, 2, 32, 32) and y == 3
    assert x.sum() > 0
    assert torch.equal(x, se.SyntheticGesture(2, "train")[3][0])
    assert not torch.equal(x, test[3][0])
    assert torch.equal(train[-1][0], train[21][0])


def test_classes_separable_by_nearest_centroid():
    train = se.get_dataset("train", n_per_class=20)
    test = se.get_dataset("test", n_per_class=5)

    def feats(ds):
        x = torch.stack([ds[i][0] for i in range(len(ds))])
        return x.reshape(len(ds), -1).numpy(), np.array(ds.targets)

    xtr, ytr = feats(train)
    xte, yte = feats(test)
    centroids = np.stack([xtr[ytr == k].mean(0) for k in range(len(se.CLASSES))])
    pred = ((xte[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
    acc = float((pred == yte).mean())
    assert acc > 0.8, f"nearest-centroid accuracy {acc:.2f} (chance {1 / 11:.2f})"


def test_stream_shift_changes_statistics():
    labels = [0, 3, 7, 10, 0, 3, 7, 10]
    seg = 200_000
    ev, segments = se.stream(labels, segment_us=seg, rng=np.random.default_rng(3), noise_rate_hz=1.0,
                             shift_at=4 * seg, shift=dict(noise_rate_hz=40.0, offset=(6.0, 0.0)))
    assert np.all(np.diff(ev["t"]) >= 0) and ev["t"].max() < len(labels) * seg
    assert validate_events(ev, SENSOR, policy="raise")[1].n_dropped == 0
    assert list(segments["label"]) == labels
    assert list(segments["shifted"]) == [False] * 4 + [True] * 4
    before, after = ev[ev["t"] < 4 * seg], ev[ev["t"] >= 4 * seg]
    assert len(after) > 1.5 * len(before)  # 40 Hz/pixel noise after the shift vs 1 Hz before
    # same gestures, no noise: the offset moves the event centroid right by about 6 px
    ev0, _ = se.stream(labels, segment_us=seg, rng=np.random.default_rng(3), noise_rate_hz=0.0,
                       shift_at=4 * seg, shift=dict(offset=(6.0, 0.0)))
    b0, a0 = ev0[ev0["t"] < 4 * seg], ev0[ev0["t"] >= 4 * seg]
    assert 3.0 < a0["x"].mean() - b0["x"].mean() < 9.0
    assert list(se.segment_labels_at(segments, [0, seg - 1, seg, 7 * seg + 5, 8 * seg])) == [0, 0, 3, 10, -1]


def test_stream_without_shift_is_concatenation():
    ev, segments = se.stream([1, 2], segment_us=100_000, rng=np.random.default_rng(0))
    rng = np.random.default_rng(0)
    first = se.generate_sample(1, duration_us=100_000, rng=rng)
    second = se.generate_sample(2, duration_us=100_000, rng=rng)
    second["t"] += 100_000
    assert np.array_equal(ev, np.concatenate([first, second]))
    assert not segments["shifted"].any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(label=11), "label must be an int in 0..10"),
        (dict(label=0, speed=0.0), "speed must be"),
        (dict(label=0, noise_rate_hz=-1.0), "noise_rate_hz"),
        (dict(label=0, offset=(1.0,)), "offset must be a pair"),
        (dict(label=0, sensor_size=(32, 32, 3)), "sensor_size"),
    ],
)
def test_generate_sample_bad_input(kwargs, match):
    label = kwargs.pop("label")
    with pytest.raises(ValueError, match=match):
        se.generate_sample(label, rng=np.random.default_rng(0), **kwargs)


def test_bad_dataset_and_stream_options():
    with pytest.raises(ValueError, match="split must be one of"):
        se.SyntheticGesture(1, "val")
    with pytest.raises(ValueError, match="unknown option"):
        se.get_dataset("train", n_per_clas=3)
    with pytest.raises(ValueError, match="valid keys"):
        se.stream([0], segment_us=100_000, rng=np.random.default_rng(0), shift_at=0, shift=dict(nois=1.0))
    with pytest.raises(ValueError, match="shift_at"):
        se.stream([0], segment_us=100_000, rng=np.random.default_rng(0), shift=dict(speed=2.0))


def test_frames_cached_per_index(monkeypatch):
    kw = dict(T=4, duration_us=50_000)
    ds = se.SyntheticGesture(1, "train", **kw)
    calls = []
    orig = se.SyntheticGesture.events
    monkeypatch.setattr(se.SyntheticGesture, "events", lambda self, i: calls.append(i) or orig(self, i))
    x, y = ds[2]
    x[:] = -1.0  # items are copies: changing one leaves the cached frames alone
    x2, y2 = ds[2]
    assert calls == [2] and y == y2 == 2
    assert torch.equal(ds[-9][0], x2) and calls == [2]  # a negative index hits the same entry
    off = se.SyntheticGesture(1, "train", cache=False, **kw)
    assert torch.equal(off[2][0], x2) and x2.min() >= 0 and x2.sum() > 0
    off[2]
    assert calls == [2, 2, 2]  # cache=False simulates on every access
    assert se.get_dataset("test", n_per_class=1, cache=False, **kw)._frames is None


def test_segment_labels_at_without_segments():
    none = np.empty(0, dtype=se.SEGMENT_DTYPE)  # e.g. a labels file with no rows
    assert list(se.segment_labels_at(none, [0, 5])) == [-1, -1]


def test_random_stream_is_seeded_and_shifts_from_half_way():
    a = se.random_stream(6, seed=3, segment_us=100_000, shift={"noise_rate_hz": 30.0})
    b = se.random_stream(6, seed=3, segment_us=100_000, shift={"noise_rate_hz": 30.0})
    assert np.array_equal(a.events, b.events) and np.array_equal(a.segments, b.segments)
    assert a.shift_at == 300_000 and list(a.segments["shifted"]) == [False] * 3 + [True] * 3
    assert not np.array_equal(a.segments["label"], se.random_stream(6, seed=4, segment_us=100_000).segments["label"])
    none = se.random_stream(6, seed=3, segment_us=100_000)
    assert none.shift_at is None and not none.segments["shifted"].any()
    assert list(none.segments["label"]) == list(a.segments["label"])  # the labels come first from the seed
    with pytest.raises(ValueError, match="n_gestures must be a positive int"):
        se.random_stream(0, seed=0, segment_us=100_000)


def test_check_shift_is_one_line_per_mistake():
    assert se.check_shift(None) == {} and se.check_shift({"offset": (4, 0)}) == {"offset": [4.0, 0.0]}
    for shift, match in (({"blur": 1.0}, "unknown shift key.*valid keys: noise_rate_hz, speed, offset"),
                         ({"speed": 0.0}, "speed must be"), ({"offset": (1.0,)}, "offset must be a pair"),
                         ({"noise_rate_hz": "loud"}, "noise_rate_hz must be")):
        with pytest.raises(ValueError, match=match):
            se.check_shift(shift)
