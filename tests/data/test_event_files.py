"""Event files as cameras and data sets publish them, read chunk by chunk by maintained readers
(``szo.data.event_files``): each format on a tiny file written in its official format (AEDAT 4 by
iniVation's dv-processing, DAT / EVT 2.0 / EVT 3.0 by expelliarmus, AEDAT 2.0 / 3.1 and N-MNIST in their
documented byte layouts, the real N-MNIST recording), the sensor size each states, chunked reads equal
to whole reads, unknown formats and truncated files in one line, the resolution option (tonic's
CenterCrop / Downsample) and the bounded-memory stream against the whole-file stream."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from szo.data import dvs
from szo.data.event_files import FORMATS, open_event_file, read_events

tonic = pytest.importorskip("tonic")

RECORDING = Path(__file__).parent / "nmnist" / "sample_nmnist.bin"
N = 50


def _written(n: int = N) -> np.ndarray:
    """What the tests write: x on a 40-wide, y on a 30-high sensor, increasing t, alternating p."""
    i = np.arange(n)
    ev = np.zeros(n, dtype=[("t", "<i8"), ("x", "<i2"), ("y", "<i2"), ("p", "u1")])
    ev["t"], ev["x"], ev["y"], ev["p"] = 5 + 100 * i, i % 40, (3 * i) % 30, i % 2
    return ev


def _check(ev: np.ndarray, want: np.ndarray) -> None:
    for f in ("x", "y", "t", "p"):
        np.testing.assert_array_equal(ev[f], want[f].astype(np.int64), err_msg=f)


@pytest.mark.parametrize("encoding, suffix", [("dat", ".dat"), ("evt2", ".raw"), ("evt3", ".raw")])
def test_prophesee_files_written_by_expelliarmus(tmp_path, encoding, suffix):
    expelliarmus = pytest.importorskip("expelliarmus")
    path = tmp_path / f"rec{suffix}"
    expelliarmus.Wizard(encoding=encoding).save(path, _written())
    ev, sensor = read_events(path)
    _check(ev, _written())
    chunks = list(open_event_file(path).chunks(16))  # chunk by chunk, the same events
    assert len(chunks) > 1
    _check(np.concatenate(chunks), _written())


def test_raw_file_states_its_encoding_and_sensor(tmp_path):
    expelliarmus = pytest.importorskip("expelliarmus")
    path = tmp_path / "rec.raw"
    expelliarmus.Wizard(encoding="evt3").save(path, _written())
    body = path.read_bytes()
    assert b"% evt 3.0 \n" in body  # expelliarmus writes Metavision's '%' header
    path.write_bytes(b"% format EVT3;height=30;width=40\n" + body)
    assert open_event_file(path).sensor_size == (40, 30, 2)
    _check(read_events(path)[0], _written())
    no_encoding = tmp_path / "plain.raw"
    no_encoding.write_bytes(body.replace(b"% evt 3.0 \n", b""))
    with pytest.raises(ValueError, match="must state its encoding in its '%' header"):
        open_event_file(no_encoding)


def test_aedat4_written_by_dv_processing(tmp_path):
    dv = pytest.importorskip("dv_processing")
    pytest.importorskip("aedat")
    path = tmp_path / "rec.aedat4"
    writer = dv.io.MonoCameraWriter(str(path), dv.io.MonoCameraWriter.EventOnlyConfig("DVXplorer_test", (40, 30)))
    want = _written()
    for part in (want[:20], want[20:]):  # two packets
        store = dv.EventStore()
        for e in part:
            store.push_back(int(e["t"]), int(e["x"]), int(e["y"]), bool(e["p"]))
        writer.writeEvents(store)
    del writer  # closes the file
    ev, sensor = read_events(path)
    assert sensor == (40, 30, 2)
    _check(ev, want)


def _aedat2(path: Path, chip: str, address: np.ndarray, t: np.ndarray) -> None:
    """AEDAT 2.0 as jAER writes it: '#' header lines (CRLF), then big-endian (address, timestamp) pairs."""
    header = f"#!AER-DAT2.0\r\n# This is a raw AE data file\r\n# AEChip: {chip}\r\n".encode()
    pairs = np.empty(len(t), dtype=[("a", ">u4"), ("t", ">u4")])
    pairs["a"], pairs["t"] = address, t
    path.write_bytes(header + pairs.tobytes())


def test_aedat2_dvs128_and_davis346_chips(tmp_path):
    want = _written()
    x, y, p = (want[f].astype(np.int64) for f in ("x", "y", "p"))
    _aedat2(tmp_path / "dvs128.aedat", "ch.unizh.ini.jaer.chip.retina.DVS128", (x << 8) | (y << 1) | p, want["t"])
    ev, sensor = read_events(tmp_path / "dvs128.aedat")
    assert sensor == (128, 128, 2)
    _check(ev, want)
    # DAVIS346 (tonic.io.read_davis_346's layout, axes flipped); an APS sample (bit 31 set) is not an event
    a = ((259 - y) << 22) | ((345 - x) << 12) | (p << 11)
    _aedat2(tmp_path / "davis.aedat", "eu.seebetter.ini.chips.davis.Davis346red", np.append(a, 1 << 31),
            np.append(want["t"], 9999))
    ev, sensor = read_events(tmp_path / "davis.aedat")
    assert sensor == (346, 260, 2)
    _check(ev, want)
    _aedat2(tmp_path / "other.aedat", "ch.unizh.ini.jaer.chip.cochlea.CochleaAMS1c", a, want["t"])
    with pytest.raises(ValueError, match="CochleaAMS1c is not supported; supported chips: dvs128, davis346"):
        open_event_file(tmp_path / "other.aedat")
    (tmp_path / "cut.aedat").write_bytes((tmp_path / "dvs128.aedat").read_bytes()[:-3])
    with pytest.raises(ValueError, match="cut.aedat is truncated"):
        open_event_file(tmp_path / "cut.aedat")


def test_aedat31_polarity_packets(tmp_path):
    """AEDAT 3.1: a 28-byte packet header (type, source, size, offset, overflow, capacity, number, valid),
    then (data, timestamp) pairs; polarity data: x bits 17-31, y bits 2-16, polarity bit 1, valid bit 0."""
    want = _written()
    x, y, p = (want[f].astype(np.int64) for f in ("x", "y", "p"))
    body = b""
    for part in (slice(0, 30), slice(30, N)):  # two packets
        n = len(want[part])
        ev = np.empty(n, dtype=[("d", "<u4"), ("t", "<i4")])
        ev["d"], ev["t"] = (x[part] << 17) | (y[part] << 2) | (p[part] << 1) | 1, want["t"][part]
        body += struct.pack("<hhiiiiii", 1, 1, 8, 4, 0, n, n, n) + ev.tobytes()
    path = tmp_path / "rec.aedat"
    path.write_bytes(b"#!AER-DAT3.1\r\n#Format: RAW\r\n#!END-HEADER\r\n" + body)
    ev, sensor = read_events(path)
    assert sensor is None  # AEDAT 3 states no size here: --sensor-size gives it
    _check(ev, want)


def test_nmnist_bin_in_chunks_equals_tonic_whole(tmp_path):
    whole = tonic.io.read_mnist_file(str(RECORDING), dtype=tonic.datasets.NMNIST.dtype)
    ef = open_event_file(RECORDING)
    assert ef.sensor_size == (34, 34, 2)
    _check(np.concatenate(list(ef.chunks(100))), whole)
    # a timestamp-overflow marker (y = 240) in the first chunk shifts the later chunks' timestamps too
    raw = RECORDING.read_bytes()
    marked = tmp_path / "marked.bin"
    marked.write_bytes(raw[:50] + bytes([0, 240, 0, 0, 0]) + raw[50:])
    want = tonic.io.read_mnist_file(str(marked), dtype=tonic.datasets.NMNIST.dtype)
    assert want["t"][-1] == whole["t"][-1] + 2**13
    _check(np.concatenate(list(open_event_file(marked).chunks(20))), want)


def test_unknown_missing_and_bad_files_are_one_line(tmp_path):
    (tmp_path / "rec.mat").write_bytes(b"MATLAB 5.0")
    with pytest.raises(ValueError) as info:
        open_event_file(tmp_path / "rec.mat")
    msg = str(info.value)
    assert "\n" not in msg and "unsupported event file format '.mat'" in msg and all(k in msg for k in FORMATS)
    assert "pickle" not in msg
    with pytest.raises(ValueError, match="does not exist"):
        open_event_file(tmp_path / "none.aedat4")
    (tmp_path / "x.aedat").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is not an AEDAT file"):
        open_event_file(tmp_path / "x.aedat")
    (tmp_path / "cut.bin").write_bytes(RECORDING.read_bytes()[:-2])
    with pytest.raises(ValueError, match="cut.bin is not an N-MNIST recording: 21623 bytes"):
        open_event_file(tmp_path / "cut.bin")
    np.save(tmp_path / "plain.npy", np.zeros((3, 4)))
    with pytest.raises(ValueError, match="must hold a structured array with fields x, y, t"):
        open_event_file(tmp_path / "plain.npy")
    if pytest.importorskip("aedat"):
        (tmp_path / "bad.aedat4").write_bytes(b"#!AER-DAT4.0\r\nnonsense")
        with pytest.raises(ValueError, match="bad.aedat4"):
            list(open_event_file(tmp_path / "bad.aedat4").chunks())


@pytest.mark.parametrize("mode, crop", [("crop", (32, 32)), ("downsample", (34, 34)), ("crop+downsample", (34, 34))])
def test_sensor_fit_is_tonics_transforms(mode, crop):
    ev = tonic.io.read_mnist_file(str(RECORDING), dtype=tonic.datasets.NMNIST.dtype)
    fit = dvs.SensorFit((34, 34, 2), (32, 32, 2), mode)
    assert fit.crop_size == crop
    want = ev
    if mode == "crop":
        want = tonic.transforms.CenterCrop(sensor_size=(34, 34, 2), size=(32, 32))(ev)
    else:
        want = tonic.transforms.Downsample(sensor_size=(34, 34, 2), target_size=(32, 32))(ev)
    got = fit(ev)
    _check(got, want)
    assert got["x"].max() < 32 and got["y"].max() < 32
    assert len(got) == (4325 - 14 if mode == "crop" else 4325)  # crop drops the 1-pixel border, and says so


def test_sensor_fit_crop_then_downsample_keeps_the_aspect_ratio():
    fit = dvs.SensorFit((346, 260, 2), (32, 32, 2), "crop+downsample")
    assert fit.crop_size == (260, 260) and fit.describe() == "346x260 -> centre crop 260x260, downsample to 32x32"
    ev = np.zeros(4, dtype=dvs.EVENT_DTYPE)
    ev["x"], ev["y"], ev["t"] = [0, 43, 302, 345], [0, 259, 130, 100], [1, 2, 3, 4]
    out = fit(ev)  # the crop keeps 43 <= x < 303; then 260 -> 32 pixels
    assert out["x"].tolist() == [0, 31] and out["y"].tolist() == [31, 16]
    with pytest.raises(ValueError) as info:
        dvs.SensorFit((346, 260, 2), (32, 32, 2), None, source="rec.aedat4")
    msg = str(info.value)
    assert "\n" not in msg and "rec.aedat4 is a 346x260 sensor but the model takes 32x32" in msg and "--fit" in msg
    with pytest.raises(ValueError, match="smaller than the model's 32x32"):
        dvs.SensorFit((20, 20, 2), (32, 32, 2), "downsample")
    with pytest.raises(ValueError, match="1 polarity channel"):
        dvs.SensorFit((32, 32, 1), (32, 32, 2))


def test_file_stream_in_small_chunks_gives_the_whole_file_windows():
    """The bounded-memory stream (chunks of 300 events, fewer than a window holds) gives exactly the
    frames of the whole-file stream, window after window, and again on a second replay."""
    whole, _ = dvs.load_event_file(RECORDING, (34, 34, 2))
    stream = dvs.FileEventStream(open_event_file(RECORDING), (34, 34, 2), chunk_events=300)
    assert stream.n_events == whole.n_events == 4325
    starts = stream.window_starts(20_000)
    np.testing.assert_array_equal(starts, whole.window_starts(20_000))
    for _ in range(2):
        for t0 in starts.tolist():
            np.testing.assert_array_equal(stream.frames(t0, t0 + 20_000, 4).numpy(),
                                          whole.frames(t0, t0 + 20_000, 4).numpy())
    assert stream.n_late == 0 and stream.n_cropped == 0
    with pytest.raises(ValueError, match="11 of 4325 events lie outside the 32x32 sensor"):
        dvs.FileEventStream(open_event_file(RECORDING), (32, 32, 2))
