"""DVS128 Gesture (IBM) through tonic, event validation and the event -> frame pipeline, event streams.

Paper setting (Sec. 6, App. G): 11 classes, each sample integrated into ``T = 20`` frames,
batch 16. Frames are ``float32 [T, 2, H, W]`` (polarity channel 0 = OFF, 1 = ON).

On-disk layout (what ``tonic.datasets.DVSGesture`` reads, tonic's preprocessed release)::

    <data_dir>/DVSGesture/ibmGestureTrain.tar.gz          (archive, optional once extracted)
    <data_dir>/DVSGesture/ibmGestureTrain/user01_fluorescent/0.npy ... 10.npy
    <data_dir>/DVSGesture/ibmGestureTest/user24_led/...

Each ``<label>.npy`` is a plain (non-object) ``[N, 4]`` array with columns ``x, y, p, t``
and ``t`` in milliseconds; tonic's ``__getitem__`` converts t to microseconds and builds a
structured array. tonic's own existence check wants the archive file *and* at least 100
extracted ``.npy`` files, otherwise it starts a download. szo checks only the extracted
folder (a subclass overriding ``_check_exists``; tonic's directory walk and ``__getitem__``
are used unchanged; the subclass keeps the name ``DVSGesture`` because tonic derives the
folder ``<save_to>/<class name>`` from it), so an extracted copy without the archive works offline, and the
download is attempted only when the folder is missing and ``download=True``.

A continuous stream (``EventStream``: an event file read by ``load_event_file``, or
``szo.data.synthetic_events.random_stream``) is cut into fixed time windows, each binned into
frames by ``window_frames`` (tonic's ``ToFrame`` with a fixed time window).

Frames are cached as one ``.npy`` per recording under
``<data_dir>/cache/<settings-hash>/<split>/`` (written atomically, loaded without pickle).
tonic's ``DiskCachedDataset`` (h5py) is not used because its writes are not atomic.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from szo.data.event_files import (
    CHUNK_EVENTS,
    EVENT_DTYPE,
    EventFile,
    open_event_file,
    read_events,
    require_tonic,
    supported_formats,
)
from szo.data.registry import DataNotFoundError, default_data_dir
from szo.io import atomic_write_bytes, atomic_write_json

__all__ = [
    "CLASSES",
    "SENSOR_SIZE",
    "SPLITS",
    "REQUIRED_FIELDS",
    "DataNotFoundError",
    "EventReport",
    "check_sensor_size",
    "validate_events",
    "EventsToFrames",
    "EventStream",
    "FileEventStream",
    "FITS",
    "SensorFit",
    "load_event_file",
    "load_segments",
    "open_event_file",
    "supported_formats",
    "segment_labels_at",
    "stream_window_starts",
    "window_frames",
    "DVSGestureFrames",
    "EventFrames",
    "open_tonic_set",
    "require_tonic",
    "get_dataset",
    "default_data_dir",
]

CLASSES: tuple[str, ...] = (
    "hand_clapping",
    "right_hand_wave",
    "left_hand_wave",
    "right_arm_cw",
    "right_arm_ccw",
    "left_arm_cw",
    "left_arm_ccw",
    "arm_roll",
    "air_drums",
    "air_guitar",
    "other_gestures",
)
SENSOR_SIZE: tuple[int, int, int] = (128, 128, 2)  # (W, H, P), as tonic
SPLITS: tuple[str, ...] = ("train", "test")
REQUIRED_FIELDS: tuple[str, ...] = ("x", "y", "t", "p")
POLICIES: tuple[str, ...] = ("drop", "raise")
_FOLDERS = {"train": "ibmGestureTrain", "test": "ibmGestureTest"}
_CACHE_FORMAT = 1

OFFICIAL_SOURCE = "https://research.ibm.com/interactive/dvsgesture/ (IBM, original AEDAT release)"
TONIC_ARCHIVES = {
    "train": ("ibmGestureTrain.tar.gz", "https://figshare.com/ndownloader/files/38022171"),
    "test": ("ibmGestureTest.tar.gz", "https://figshare.com/ndownloader/files/38020584"),
}


# --------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class EventReport:
    """What ``validate_events`` did. An event can count under several drop reasons;
    ``n_dropped`` counts each dropped event once. ``n_unsorted`` is the number of positions
    where a timestamp was smaller than the previous one (0 for a sorted stream)."""

    n_in: int
    n_out: int
    n_dropped: int
    n_out_of_sensor: int
    n_bad_time: int
    n_bad_polarity: int
    n_unsorted: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def check_sensor_size(sensor_size: Any) -> tuple[int, int, int]:
    """``(W, H, P)`` as ints, or one ValueError line saying what is valid."""
    try:
        w, h, p = (int(v) for v in sensor_size)
    except (TypeError, ValueError):
        raise ValueError(f"sensor_size must be (W, H, P) with positive ints, got {sensor_size!r}") from None
    if w <= 0 or h <= 0 or p not in (1, 2):
        raise ValueError(f"sensor_size must be (W, H, P) with W, H > 0 and P in (1, 2), got {sensor_size!r}")
    return w, h, p


def validate_events(
    events: np.ndarray, sensor_size: tuple[int, int, int], *, policy: str = "drop"
) -> tuple[np.ndarray, EventReport]:
    """Check an event array against a sensor; return ``(clean_events, report)``.

    ``events`` must be a numpy structured array with integer (or bool) fields x, y, p and a
    numeric field t (microseconds). Bad events are out-of-sensor coordinates
    (``0 <= x < W``, ``0 <= y < H``), negative or non-finite t, and polarity outside
    ``0 .. P-1``. ``policy="drop"`` drops and counts them; ``policy="raise"`` raises
    ``ValueError`` if there is any. Unsorted timestamps are stably sorted and counted under
    both policies. Only a wrong array type/dtype raises under ``"drop"``, so a stream
    consumer never crashes on event content. The dtype of the input is kept.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    w, h, n_pol = check_sensor_size(sensor_size)
    names = getattr(getattr(events, "dtype", None), "names", None)
    if not isinstance(events, np.ndarray) or names is None:
        raise ValueError(
            f"events must be a numpy structured array with fields {REQUIRED_FIELDS}, "
            f"got {type(events).__name__} with dtype {getattr(events, 'dtype', None)}"
        )
    missing = [f for f in REQUIRED_FIELDS if f not in names]
    if missing:
        raise ValueError(f"events lack field(s) {missing}; required fields are {REQUIRED_FIELDS}, got {names}")
    for f in ("x", "y", "p"):
        if events.dtype[f].kind not in "iub":
            raise ValueError(f"event field {f!r} must be integer or bool, got dtype {events.dtype[f]}")
    if events.dtype["t"].kind not in "iuf":
        raise ValueError(f"event field 't' must be numeric (microseconds), got dtype {events.dtype['t']}")
    events = np.ravel(events)

    x = events["x"].astype(np.int64)
    y = events["y"].astype(np.int64)
    p = events["p"].astype(np.int64)
    t = events["t"]
    out_of_sensor = (x < 0) | (x >= w) | (y < 0) | (y >= h)
    bad_time = ~np.isfinite(t) | (t < 0) if t.dtype.kind == "f" else (t < 0)
    bad_pol = (p < 0) | (p >= n_pol)
    bad = out_of_sensor | bad_time | bad_pol
    n_bad = int(bad.sum())
    if n_bad and policy == "raise":
        raise ValueError(
            f"{n_bad} invalid event(s) for sensor_size (W, H, P)={(w, h, n_pol)}: "
            f"{int(out_of_sensor.sum())} outside 0<=x<{w}, 0<=y<{h}; {int(bad_time.sum())} with negative "
            f"or non-finite t; {int(bad_pol.sum())} with polarity outside 0..{n_pol - 1}. "
            "Use policy='drop' to drop them."
        )
    clean = events[~bad]
    tc = clean["t"]
    n_unsorted = int(np.count_nonzero(tc[1:] < tc[:-1])) if len(tc) > 1 else 0
    if n_unsorted:
        clean = clean[np.argsort(tc, kind="stable")]
    else:
        clean = clean.copy()
    report = EventReport(
        n_in=len(events),
        n_out=len(clean),
        n_dropped=n_bad,
        n_out_of_sensor=int(out_of_sensor.sum()),
        n_bad_time=int(bad_time.sum()),
        n_bad_polarity=int(bad_pol.sum()),
        n_unsorted=n_unsorted,
    )
    return clean, report


# --------------------------------------------------------------------------- frames
@dataclass(frozen=True)
class EventsToFrames:
    """validate -> optional ``tonic.transforms.Denoise`` -> optional
    ``tonic.transforms.Downsample`` -> ``tonic.transforms.ToFrame(n_time_bins=T)``.

    ``size`` is the output width = height; without ``fit`` it must divide the sensor's W and H
    (e.g. 128 -> 64 or 32); with ``fit`` (``"crop"``, ``"downsample"``, ``"crop+downsample"``:
    ``SensorFit``, tonic's CenterCrop / Downsample) any size up to the sensor's (34 -> 32 by
    cropping). ``denoise_us=None`` skips denoising. Returns
    ``float32 [T, P, size, size]`` event counts. An empty stream gives zero frames.
    """

    sensor_size: tuple[int, int, int] = SENSOR_SIZE
    T: int = 20
    size: int | None = None
    denoise_us: float | None = 10000.0
    policy: str = "drop"
    fit: str | None = None

    def __post_init__(self) -> None:
        w, h, p = check_sensor_size(self.sensor_size)
        if not isinstance(self.T, (int, np.integer)) or isinstance(self.T, bool) or self.T < 1:
            raise ValueError(f"T (number of frames) must be a positive int, got {self.T!r}")
        if self.fit is not None:
            if self.size is None or isinstance(self.size, bool) or not isinstance(self.size, (int, np.integer)) \
                    or self.size < 1:
                raise ValueError(f"fit {self.fit!r} needs size (the output width = height), got size={self.size!r}")
            SensorFit((w, h, p), (int(self.size), int(self.size), p), self.fit, source="the data set's sensor")
        elif self.size is not None:
            if not isinstance(self.size, (int, np.integer)) or self.size < 1 or w % self.size or h % self.size:
                raise ValueError(
                    f"size must be a positive int dividing the sensor's W={w} and H={h} "
                    f"(or None for no downsampling), got {self.size!r}"
                )
            if w != h:
                raise ValueError(f"size needs a square sensor, got sensor_size={self.sensor_size}")
        if self.denoise_us is not None and not self.denoise_us > 0:
            raise ValueError(f"denoise_us must be > 0 or None, got {self.denoise_us!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    @property
    def out_sensor_size(self) -> tuple[int, int, int]:
        w, h, p = check_sensor_size(self.sensor_size)
        return (w, h, p) if self.size is None else (int(self.size), int(self.size), p)

    def settings(self) -> dict[str, Any]:
        return {
            "sensor_size": list(check_sensor_size(self.sensor_size)),
            "T": int(self.T),
            "size": None if self.size is None else int(self.size),
            "denoise_us": None if self.denoise_us is None else float(self.denoise_us),
            "policy": self.policy,
            **({"fit": self.fit} if self.fit is not None else {}),  # old cache keys stay valid
        }

    def __call__(self, events: np.ndarray) -> np.ndarray:
        tonic = require_tonic()
        events, _ = validate_events(events, self.sensor_size, policy=self.policy)
        w, h, p = self.out_sensor_size
        empty = np.zeros((int(self.T), p, h, w), dtype=np.float32)
        if self.denoise_us is not None and len(events):
            events = tonic.transforms.Denoise(filter_time=self.denoise_us)(events)
        if len(events) == 0:  # tonic's Denoise/ToFrame do not handle empty streams uniformly
            return empty
        if self.fit is not None:
            events = SensorFit(check_sensor_size(self.sensor_size), (w, h, p), self.fit)(events)
            if len(events) == 0:
                return empty
        elif self.size is not None and self.size != self.sensor_size[0]:
            factor = float(self.size) / float(self.sensor_size[0])
            events = tonic.transforms.Downsample(spatial_factor=factor)(events)
        frames = tonic.transforms.ToFrame(sensor_size=(w, h, p), n_time_bins=int(self.T))(events)
        return np.asarray(frames, dtype=np.float32)


# --------------------------------------------------------------------------- streams
def segment_labels_at(segments: np.ndarray | None, t_us: np.ndarray | int) -> np.ndarray:
    """Label of the segment (``start_us``, ``end_us``, ``label``; sorted) containing each time
    ``t_us`` (-1 outside every segment, and everywhere for an unlabelled stream: ``segments`` None)."""
    t = np.asarray(t_us, dtype=np.int64)
    if segments is None or len(segments) == 0:
        return np.full(t.shape, -1, dtype=np.int64)
    idx = np.searchsorted(segments["start_us"], t, side="right") - 1
    inside = (idx >= 0) & (t < segments["end_us"][np.clip(idx, 0, None)])
    return np.where(inside, segments["label"][np.clip(idx, 0, None)], -1)


def window_frames(events: np.ndarray, t0: int, t1: int, bins: int, sensor_size: tuple[int, int, int],
                  downsample: int = 1) -> np.ndarray:
    """Event counts of ``events`` (valid for ``sensor_size``, sorted by t) with ``t0 <= t < t1``
    in ``bins`` equal time bins: ``tonic.transforms.ToFrame(time_window=(t1 - t0) // bins,
    start_time=t0, end_time=t1)``, x and y first divided by the integer ``downsample``.
    Returns float32 ``[bins, P, H // downsample, W // downsample]``."""
    tonic = require_tonic()
    w, h, p = check_sensor_size(sensor_size)
    if t1 <= t0 or (t1 - t0) % bins:
        raise ValueError(f"the window [{t0}, {t1}) us must be a positive multiple of its {bins} bins")
    size = (w // downsample, h // downsample, p)
    t = events["t"]
    ev = events[np.searchsorted(t, t0):np.searchsorted(t, t1)]
    if len(ev) == 0:  # tonic's ToFrame returns one frame, W and H swapped, for no events
        return np.zeros((bins, p, size[1], size[0]), dtype=np.float32)
    if downsample != 1:  # integer division: tonic's Downsample multiplies by a float (1/3 rounds down)
        ev = ev.copy()
        ev["x"] //= downsample
        ev["y"] //= downsample
    frames = tonic.transforms.ToFrame(sensor_size=size, time_window=(t1 - t0) // bins, start_time=t0,
                                      end_time=t1)(ev)
    return np.asarray(frames, dtype=np.float32)


def stream_window_starts(segments: np.ndarray | None, t_first: int | None, t_last: int | None, window_us: int,
                         what: str) -> np.ndarray:
    """Start times of the ``window_us`` windows of a stream: over its labelled segments, else over its
    events' time range ``[t_first, t_last]`` (None: no events); one ValueError naming ``what`` if none."""
    labelled = segments is not None and len(segments) > 0
    t0 = int(segments["start_us"][0]) if labelled else t_first if t_first is not None else 0
    t1 = max(t_last + 1 if t_last is not None else t0, int(segments["end_us"][-1]) if labelled else t0)
    starts = np.arange(t0, t1, window_us, dtype=np.int64)
    if len(starts) == 0:
        raise ValueError(f"{what} holds no complete window (no events / empty time range)")
    return starts


@dataclass(frozen=True)
class EventStream:
    """A continuous event stream: valid, time-sorted ``events`` (x, y, t, p; t in microseconds)
    on ``sensor_size`` (W, H, P), its labelled ``segments`` (``start_us``, ``end_us``, ``label``,
    sorted; None: unlabelled) and ``shift_at`` (when a domain shift begins, or None)."""

    events: np.ndarray
    segments: np.ndarray | None
    sensor_size: tuple[int, int, int]
    shift_at: int | None = None

    @property
    def n_events(self) -> int:
        return int(len(self.events))

    def window_starts(self, window_us: int) -> np.ndarray:
        """Start times of the ``window_us`` windows covering the segments (else the events)."""
        t = self.events["t"]
        return stream_window_starts(self.segments, int(t[0]) if len(t) else None, int(t[-1]) if len(t) else None,
                                    window_us, "the stream")

    def labels_at(self, t_us: np.ndarray) -> np.ndarray:
        """The segment label at each time (-1: unlabelled)."""
        return segment_labels_at(self.segments, t_us)

    def frames(self, t0: int, t1: int, bins: int, downsample: int = 1) -> torch.Tensor:
        """``window_frames`` of ``[t0, t1)`` as a tensor."""
        return torch.from_numpy(window_frames(self.events, t0, t1, bins, self.sensor_size, downsample))


def _load_npy(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read {path} as a .npy array without pickle: {e}") from None


def load_event_file(path: str | os.PathLike, sensor_size: tuple[int, int, int],
                    labels_path: str | os.PathLike | None = None) -> tuple[EventStream, EventReport]:
    """An event file (any format of ``szo.data.event_files``) read whole, as a validated stream; for
    recordings of any length see ``FileEventStream`` (bounded memory).

    Malformed events (outside the sensor, negative t, bad polarity) are dropped and counted;
    unsorted timestamps are sorted (``validate_events``). ``labels_path``: a ``.npy``
    structured array with fields ``start_us``, ``end_us``, ``label``, one row per labelled
    segment (as ``szo.data.synthetic_events.stream`` returns them)."""
    events, _ = read_events(path)
    events, report = validate_events(events, sensor_size, policy="drop")
    segments = None
    if labels_path is not None:
        segments = load_segments(labels_path)
    return EventStream(events, segments, check_sensor_size(sensor_size)), report


FITS: tuple[str, ...] = ("crop", "downsample", "crop+downsample")


def load_segments(path: str | os.PathLike) -> np.ndarray:
    """A labels file: a ``.npy`` structured array with fields ``start_us``, ``end_us``, ``label`` (one row per
    labelled segment), sorted by start."""
    segments = _load_npy(Path(path), "labels file")
    if not {"start_us", "end_us", "label"} <= set(segments.dtype.names or ()):
        raise ValueError(f"labels file {path} must be a structured array with fields start_us, end_us, label; got "
                         f"dtype {segments.dtype}")
    return np.sort(segments, order="start_us")


@dataclass(frozen=True)
class SensorFit:
    """A recording's sensor ``sensor_size`` (W, H, P) mapped onto a model's input ``target`` (w, h, P) by
    tonic's transforms, as ``mode`` says: None (the sizes must be equal), ``"crop"``
    (``tonic.transforms.CenterCrop`` to w x h: events outside the centre are dropped, and counted),
    ``"downsample"`` (``tonic.transforms.Downsample`` from W x H to w x h, each axis by its own factor) or
    ``"crop+downsample"`` (the largest centred crop with the model's aspect ratio, then downsampled: no
    distortion). A size that cannot be mapped is refused in one line naming both sizes and the options."""

    sensor_size: tuple[int, int, int]
    target: tuple[int, int, int]
    mode: str | None = None
    source: str = "the recording"

    def __post_init__(self) -> None:
        (w, h, p), (mw, mh, mp) = check_sensor_size(self.sensor_size), check_sensor_size(self.target)
        object.__setattr__(self, "sensor_size", (w, h, p))
        object.__setattr__(self, "target", (mw, mh, mp))
        if self.mode is not None and self.mode not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)} (or none), got {self.mode!r}")
        if p != mp:
            raise ValueError(f"{self.source} has {p} polarity channel(s) but the model takes {mp}")
        if (w, h) == (mw, mh):
            return
        if self.mode is None:
            raise ValueError(f"{self.source} is a {w}x{h} sensor but the model takes {mw}x{mh} input; pass --fit crop "
                             f"(the centre {mw}x{mh}), --fit downsample (scale {w}x{h} to {mw}x{mh}) or --fit "
                             "crop+downsample (crop to the model's aspect ratio, then scale)")
        if w < mw or h < mh:
            raise ValueError(f"{self.source} is a {w}x{h} sensor, smaller than the model's {mw}x{mh} input: --fit "
                             f"{self.mode} only reduces a sensor")

    @property
    def crop_size(self) -> tuple[int, int]:
        """The centred window kept before downsampling (the whole sensor for ``downsample``)."""
        (w, h, _), (mw, mh, _) = self.sensor_size, self.target
        if self.mode == "crop":
            return mw, mh
        if self.mode == "crop+downsample":
            scale = min(w / mw, h / mh)
            return min(w, int(mw * scale)), min(h, int(mh * scale))
        return w, h

    def __call__(self, events: np.ndarray) -> np.ndarray:
        """``events`` (valid for ``sensor_size``) on the model's input; crop drops what lies outside."""
        (w, h, p), (mw, mh, _) = self.sensor_size, self.target
        if (w, h) == (mw, mh) or not len(events):
            return events
        tonic = require_tonic()
        cw, ch = self.crop_size
        if (cw, ch) != (w, h):
            events = tonic.transforms.CenterCrop(sensor_size=(w, h, p), size=(cw, ch))(events)
        if (cw, ch) != (mw, mh):
            events = tonic.transforms.Downsample(sensor_size=(cw, ch, p), target_size=(mw, mh))(events)
        return events

    def describe(self) -> str:
        (w, h, _), (mw, mh, _) = self.sensor_size, self.target
        if (w, h) == (mw, mh):
            return f"{w}x{h} (the model's input)"
        cw, ch = self.crop_size
        steps = ([f"centre crop {cw}x{ch}"] if (cw, ch) != (w, h) else []) + \
            ([f"downsample to {mw}x{mh}"] if (cw, ch) != (mw, mh) else [])
        return f"{w}x{h} -> " + ", ".join(steps)


class FileEventStream:
    """An event file streamed in bounded memory: the same interface as ``EventStream`` for
    ``szo.demos.online.replay`` (``window_starts``, ``labels_at``, ``frames`` in increasing time; going
    back in time reads the file again), but the events are read chunk by chunk (``EventFile.chunks``),
    validated against ``sensor_size``, mapped onto the model's input by ``fit`` and dropped once their
    window is past. A scan when built counts the events; events outside the sensor are refused in one
    line (never dropped silently); bad timestamps / polarities are dropped and counted (``report``). A
    chunk is sorted by time; an event earlier than a window already given is counted as late (dropped)."""

    shift_at = None

    def __init__(self, file: EventFile, sensor_size: tuple[int, int, int], fit: SensorFit | None = None,
                 segments: np.ndarray | None = None, *, chunk_events: int | None = None) -> None:
        self.file, self.segments = file, segments
        self.raw_sensor_size = check_sensor_size(sensor_size)
        self.fit = fit if fit is not None else SensorFit(self.raw_sensor_size, self.raw_sensor_size)
        self.sensor_size = self.fit.target
        self.chunk_events = chunk_events or CHUNK_EVENTS
        counts = dict.fromkeys(("n_in", "n_out", "n_dropped", "n_out_of_sensor", "n_bad_time", "n_bad_polarity",
                                "n_unsorted"), 0)
        t_first = t_last = None
        max_x = max_y = -1
        last_t = None
        for chunk in file.chunks(self.chunk_events):
            max_x, max_y = max(max_x, int(chunk["x"].max())), max(max_y, int(chunk["y"].max()))
            clean, rep = validate_events(chunk, self.raw_sensor_size, policy="drop")
            for k, v in rep.as_dict().items():
                counts[k] += v
            if len(clean):
                t = clean["t"]
                counts["n_unsorted"] += int(last_t is not None and int(t[0]) < last_t)
                t_first = int(t[0]) if t_first is None else min(t_first, int(t[0]))
                t_last = int(t[-1]) if t_last is None else max(t_last, int(t[-1]))
                last_t = int(t[-1])
        if counts["n_out_of_sensor"]:
            w, h, _ = self.raw_sensor_size
            raise ValueError(f"{file.path}: {counts['n_out_of_sensor']} of {counts['n_in']} events lie outside the "
                             f"{w}x{h} sensor (x up to {max_x}, y up to {max_y}); give the recording's sensor with "
                             "--sensor-size W H P (then --fit to map it onto the model)")
        self.report = EventReport(**counts)
        self.n_events = counts["n_out"]
        self._t_range = (t_first, t_last)
        self.n_cropped = self.n_late = 0
        self._reset()

    def _reset(self) -> None:
        self._chunks = iter(self.file.chunks(self.chunk_events))
        self._buf = np.empty(0, dtype=EVENT_DTYPE)
        self._given_until: int | None = None
        self._done = False
        self.n_cropped = self.n_late = 0

    def window_starts(self, window_us: int) -> np.ndarray:
        return stream_window_starts(self.segments, *self._t_range, window_us, str(self.file.path))

    def labels_at(self, t_us: np.ndarray) -> np.ndarray:
        return segment_labels_at(self.segments, t_us)

    def frames(self, t0: int, t1: int, bins: int, downsample: int = 1) -> torch.Tensor:
        """``window_frames`` of ``[t0, t1)`` on the model's input, reading on as far as ``t1``."""
        if self._given_until is not None and t0 < self._given_until:
            self._reset()  # a second replay: read the file again
        while not self._done and (len(self._buf) == 0 or int(self._buf["t"][-1]) < t1):
            chunk = next(self._chunks, None)
            if chunk is None:
                self._done = True
                break
            clean, _ = validate_events(chunk, self.raw_sensor_size, policy="drop")
            mapped = self.fit(clean)
            self.n_cropped += len(clean) - len(mapped)
            if self._given_until is not None:
                late = mapped["t"] < self._given_until
                self.n_late += int(late.sum())
                mapped = mapped[~late]
            buf = np.concatenate([self._buf, mapped.astype(EVENT_DTYPE, copy=False)])
            t = buf["t"]
            if len(t) > 1 and np.any(t[1:] < t[:-1]):
                buf = buf[np.argsort(t, kind="stable")]
            self._buf = buf
        out = window_frames(self._buf, t0, t1, bins, self.sensor_size, downsample)
        self._buf = self._buf[np.searchsorted(self._buf["t"], t1):]
        self._given_until = t1
        return torch.from_numpy(out)


# --------------------------------------------------------------------------- data set
def _not_found_message(root: Path, split: str, reason: str = "") -> str:
    folder = root / "DVSGesture" / _FOLDERS[split]
    name, url = TONIC_ARCHIVES[split]
    return (
        f"DVS128 Gesture {split} data not found{': ' + reason if reason else ''}. Expected the extracted "
        f"folder {folder} holding user*_<lighting>/<label>.npy files (tonic's preprocessed release). "
        f"Official source: {OFFICIAL_SOURCE}; tonic's preprocessed archive: {name} from {url}. "
        f"To install: download {name}, extract it into {root / 'DVSGesture'} so that {folder} exists "
        f"(e.g. `tar -xzf {name} -C {root / 'DVSGesture'}`), or pass download=True on a machine "
        "with network access."
    )


@functools.lru_cache(maxsize=1)
def _extracted_dvsgesture_class() -> type:
    """``tonic.datasets.DVSGesture`` whose existence check accepts an extracted folder only."""
    tonic = require_tonic()

    # the class name must stay "DVSGesture": tonic derives the folder <save_to>/<class name>
    class DVSGesture(tonic.datasets.DVSGesture):
        def _check_exists(self) -> bool:
            return self._folder_contains_at_least_n_files_of_type(1, ".npy")

    return DVSGesture


def _has_extracted(root: Path, split: str) -> bool:
    folder = root / "DVSGesture" / _FOLDERS[split]
    return folder.is_dir() and any(folder.glob("*/*.npy"))


def open_tonic_set(extracted: bool, offline: Any, online: Any, *, train: bool, download: bool,
                   not_found: Any) -> Any:
    """A tonic event data set from its extracted folder, offline (``offline(train=)``: a tonic class
    whose existence check accepts the folder alone); else, with ``download``, through tonic's own
    class (``online(train=)``, which downloads). ``not_found(reason)``: the one-line message of the
    ``DataNotFoundError`` raised when neither gives files."""
    if extracted:
        events_ds = offline(train=train)
    elif not download:
        raise DataNotFoundError(not_found(""))
    else:
        try:
            events_ds = online(train=train)
        except Exception as e:  # network errors, bad archive, ...
            raise DataNotFoundError(not_found(f"download failed ({e})")) from e
        if len(events_ds) == 0:
            raise DataNotFoundError(not_found("download produced no files"))
    if len(events_ds) == 0:
        raise DataNotFoundError(not_found("the folder holds no recordings"))
    return events_ds


class EventFrames(torch.utils.data.Dataset):
    """A tonic event data set as ``(frames float32 [T, P, H, W], label int)``: ``to_frames`` of each
    recording, cached on disk (module docstring) under a key of ``name`` and the frame settings."""

    classes: tuple[str, ...] = ()

    def __init__(self, events_ds: Any, to_frames: EventsToFrames, *, name: str, root: Path, split: str,
                 cache: bool) -> None:
        self.events_ds, self.to_frames, self.root, self.split = events_ds, to_frames, root, split
        self.targets: list[int] = [int(v) for v in self.events_ds.targets]
        bad = sorted({v for v in self.targets if not 0 <= v < len(self.classes)})
        if bad:
            raise ValueError(f"{name}: recordings must be filed under labels 0..{len(self.classes) - 1}, found labels "
                             f"{bad}")
        self.cache_dir: Path | None = None
        if cache:
            settings = {"format": _CACHE_FORMAT, "dataset": name, **self.to_frames.settings()}
            key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
            self.cache_dir = self.root / "cache" / key / split
            settings_file = self.cache_dir.parent / "settings.json"
            if not settings_file.exists():
                atomic_write_json(settings_file, settings)

    def __len__(self) -> int:
        return len(self.events_ds)

    def _cache_path(self, cache_dir: Path, index: int) -> Path:
        base = Path(self.events_ds.location_on_system) / self.events_ds.folder_name
        rel = Path(self.events_ds.data[index]).relative_to(base)
        return cache_dir / ("__".join(rel.parts))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index = index % len(self)
        label = self.targets[index]
        frames = None
        path = self._cache_path(self.cache_dir, index) if self.cache_dir is not None else None
        expected = (int(self.to_frames.T), *self.to_frames.out_sensor_size[::-1])
        if path is not None and path.exists():
            try:
                arr = np.load(path, allow_pickle=False)
                if arr.shape == expected:
                    frames = arr
            except (ValueError, OSError):
                frames = None  # unreadable cache entry: recompute and overwrite
        if frames is None:
            try:
                events, _ = self.events_ds[index]
            except (IndexError, ValueError, OSError, EOFError, KeyError) as e:  # a bad recording: name it
                raise ValueError(f"cannot read recording {self.events_ds.data[index]} ({type(e).__name__}: {e}); "
                                 "replace or remove it") from None
            frames = self.to_frames(events)
            if path is not None:
                buf = io.BytesIO()
                np.save(buf, frames, allow_pickle=False)
                atomic_write_bytes(path, buf.getvalue())
        return torch.from_numpy(np.ascontiguousarray(frames, dtype=np.float32)), label


class DVSGestureFrames(EventFrames):
    """DVS128 Gesture as ``(frames float32 [T, 2, H, W], label int)``, frames cached on disk."""

    classes = CLASSES

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        split: str = "train",
        *,
        T: int = 20,
        size: int | None = None,
        denoise_us: float | None = 10000.0,
        download: bool = False,
        cache: bool = True,
        fit: str | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        tonic = require_tonic()
        root = Path(data_dir) if data_dir is not None else default_data_dir()
        to_frames = EventsToFrames(sensor_size=SENSOR_SIZE, T=T, size=size, denoise_us=denoise_us, fit=fit)
        events_ds = open_tonic_set(
            _has_extracted(root, split), functools.partial(_extracted_dvsgesture_class(), save_to=str(root)),
            functools.partial(tonic.datasets.DVSGesture, save_to=str(root)), train=split == "train",
            download=download, not_found=lambda reason: _not_found_message(root, split, reason))
        super().__init__(events_ds, to_frames, name="dvs-gesture", root=root, split=split, cache=cache)


def get_dataset(
    split: str, *, data_dir: str | os.PathLike | None = None, download: bool = False, **kw: Any
) -> DVSGestureFrames:
    """Entry point for ``szo.data.get_dataset("dvs-gesture", split, ...)``.

    Keywords: ``T`` (20), ``size`` (None = 128, or 64 / 32; any size with ``fit``), ``fit`` (None, or
    ``crop`` / ``downsample`` / ``crop+downsample``: ``SensorFit``), ``denoise_us`` (10000 or None),
    ``cache`` (True).
    """
    valid = {"T", "size", "fit", "denoise_us", "cache"}
    unknown = sorted(set(kw) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for dvs-gesture; valid: {sorted(valid)}")
    return DVSGestureFrames(data_dir, split, download=download, **kw)
