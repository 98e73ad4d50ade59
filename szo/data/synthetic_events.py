"""Seeded synthetic event-camera gestures: 11 classes, tonic's event format, same frame pipeline
as DVS128 Gesture.

A shape (blob, bar or ring) moves over a dark background; a pixel emits an ON event (p=1)
each time its brightness rose by ``threshold`` since its last event and an OFF event (p=0)
each time it fell by ``threshold`` (the DVS contrast model, on a linear intensity scale,
simulated every ``step_us`` with timestamps uniform inside the step). Sensor noise adds
background events uniformly at ``noise_rate_hz`` per pixel. Events are numpy structured
arrays with tonic's dtype (``tonic.io.events_struct``: x, y int16; t int64 microseconds;
p bool) sorted by t.

Domain-shift knobs (used by the streaming demo): ``noise_rate_hz``, ``speed`` (multiplies
the rate of motion), ``offset`` (pixels added to the gesture centre, (dx, dy)).
``random_stream`` strings seeded random gestures together, the shift from half way on.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from szo.data.dvs import EventsToFrames, EventStream, segment_labels_at

__all__ = [
    "CLASSES",
    "EVENT_DTYPE",
    "SEGMENT_DTYPE",
    "SPLITS",
    "SHIFT_KEYS",
    "check_shift",
    "generate_sample",
    "stream",
    "random_stream",
    "segment_labels_at",
    "SyntheticGesture",
    "get_dataset",
]

CLASSES: tuple[str, ...] = (
    "move_right",
    "move_left",
    "move_up",
    "move_down",
    "move_diagonal",
    "rotate_cw",
    "rotate_ccw",
    "wave",
    "zoom_in",
    "zoom_out",
    "flicker",
)
EVENT_DTYPE = np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", bool)])
SEGMENT_DTYPE = np.dtype([("start_us", np.int64), ("end_us", np.int64), ("label", np.int64), ("shifted", bool)])
SPLITS: tuple[str, ...] = ("train", "test")
_SPLIT_CODE = {"train": 0, "test": 1}
SHIFT_KEYS: tuple[str, ...] = ("noise_rate_hz", "speed", "offset")

# unit direction (dx, dy) of the linear motions; image y grows downwards, so "up" is -y
_DIRECTIONS = {0: (1.0, 0.0), 1: (-1.0, 0.0), 2: (0.0, -1.0), 3: (0.0, 1.0), 4: (math.sqrt(0.5), math.sqrt(0.5))}


def _check_label(label: Any) -> int:
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < len(CLASSES):
        raise ValueError(f"label must be an int in 0..{len(CLASSES) - 1} ({', '.join(CLASSES)}), got {label!r}")
    return int(label)


def _check_knobs(sensor_size: Any, duration_us: Any, noise_rate_hz: Any, speed: Any, offset: Any) -> tuple:
    try:
        w, h, p = (int(v) for v in sensor_size)
    except (TypeError, ValueError):
        raise ValueError(f"sensor_size must be (W, H, P) ints, got {sensor_size!r}") from None
    if w < 4 or h < 4 or p not in (1, 2):
        raise ValueError(f"sensor_size must be (W, H, P) with W, H >= 4 and P in (1, 2), got {sensor_size!r}")
    if not isinstance(duration_us, (int, np.integer)) or duration_us < 1000:
        raise ValueError(f"duration_us must be an int >= 1000 (microseconds), got {duration_us!r}")
    if not (isinstance(noise_rate_hz, (int, float)) and math.isfinite(noise_rate_hz) and noise_rate_hz >= 0):
        raise ValueError(f"noise_rate_hz must be a finite number >= 0 (events/s per pixel), got {noise_rate_hz!r}")
    if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
    try:
        dx, dy = (float(v) for v in offset)
    except (TypeError, ValueError):
        raise ValueError(f"offset must be a pair (dx, dy) of numbers in pixels, got {offset!r}") from None
    if not (math.isfinite(dx) and math.isfinite(dy)):
        raise ValueError(f"offset must be finite, got {offset!r}")
    return (w, h, p), (dx, dy)


def _render(label: int, u: np.ndarray, w: int, h: int, centre: tuple[float, float], scale: float,
            phase: float, speed: float) -> np.ndarray:
    """Brightness ``[S, H, W]`` in [0, 1] of gesture ``label`` at progress ``u`` (``[S]``, 0..1)."""
    size = float(min(w, h))
    xs = np.arange(w, dtype=np.float64)[None, None, :]
    ys = np.arange(h, dtype=np.float64)[None, :, None]
    cx0, cy0 = centre
    col = lambda a: np.asarray(a, dtype=np.float64)[:, None, None]  # noqa: E731
    sigma = 0.09 * size * scale

    def blob(cx: Any, cy: Any, amp: Any = 1.0) -> np.ndarray:
        return col(np.broadcast_to(amp, u.shape)) * np.exp(
            -((xs - col(cx)) ** 2 + (ys - col(cy)) ** 2) / (2.0 * sigma**2))

    if label in _DIRECTIONS:  # linear motion through the centre
        dx, dy = _DIRECTIONS[label]
        s = 0.3 * size * speed * (2.0 * u - 1.0)
        return blob(cx0 + dx * s, cy0 + dy * s)
    if label in (5, 6):  # bar rotating about the centre, half a turn at speed 1
        sign = 1.0 if label == 5 else -1.0  # +angle is clockwise on screen (y down)
        theta = col(0.5 * np.pi + phase + sign * np.pi * speed * u)
        rx, ry = xs - cx0, ys - cy0
        along = rx * np.cos(theta) + ry * np.sin(theta)
        across = -rx * np.sin(theta) + ry * np.cos(theta)
        half_len, width = 0.4 * size * scale, 0.06 * size
        return np.exp(-(across**2) / (2.0 * width**2)) * (1.0 / (1.0 + np.exp((np.abs(along) - half_len) / 0.7)))
    if label == 7:  # wave: horizontal oscillation, two periods at speed 1
        return blob(cx0 + 0.25 * size * np.sin(2.0 * np.pi * 2.0 * speed * u + phase), np.full_like(u, cy0))
    if label in (8, 9):  # expanding / contracting ring
        frac = np.clip(speed * u, 0.0, 1.0)
        radius = (0.06 + 0.34 * frac) * size * scale if label == 8 else (0.40 - 0.34 * frac) * size * scale
        r = np.sqrt((xs - cx0) ** 2 + (ys - cy0) ** 2)
        return np.exp(-((r - col(radius)) ** 2) / (2.0 * (0.05 * size) ** 2))
    # label 10, flicker: a static blob switching on and off, four periods at speed 1
    on = (np.sin(2.0 * np.pi * 4.0 * speed * u + phase) > 0).astype(np.float64)
    return blob(np.full_like(u, cx0), np.full_like(u, cy0), on)


def check_shift(shift: Mapping[str, Any] | None) -> dict[str, Any]:
    """A domain shift (keys from ``SHIFT_KEYS``) checked, as a plain dict (``offset`` a list)."""
    shift = dict(shift or {})
    unknown = sorted(set(shift) - set(SHIFT_KEYS))
    if unknown:
        raise ValueError(f"unknown shift key(s) {unknown}; valid keys: {', '.join(SHIFT_KEYS)}")
    kw = {"noise_rate_hz": 1.0, "speed": 1.0, "offset": (0.0, 0.0), **shift}
    _check_knobs((32, 32, 2), 1000, kw["noise_rate_hz"], kw["speed"], kw["offset"])
    if "offset" in shift:
        shift["offset"] = [float(v) for v in shift["offset"]]
    return shift


def generate_sample(
    label: int,
    *,
    sensor_size: tuple[int, int, int] = (32, 32, 2),
    duration_us: int = 500_000,
    rng: np.random.Generator,
    noise_rate_hz: float = 1.0,
    speed: float = 1.0,
    offset: tuple[float, float] = (0.0, 0.0),
    step_us: int = 5000,
    threshold: float = 0.15,
) -> np.ndarray:
    """One gesture as a time-sorted structured event array (``EVENT_DTYPE``), t in [0, duration_us).

    ``rng`` drives everything (per-sample jitter of centre, size and phase; event timing;
    noise), so the same generator state gives identical events.
    """
    label = _check_label(label)
    (w, h, n_pol), (ox, oy) = _check_knobs(sensor_size, duration_us, noise_rate_hz, speed, offset)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
    if not isinstance(step_us, (int, np.integer)) or not 1 <= step_us <= duration_us:
        raise ValueError(f"step_us must be an int in 1..duration_us={duration_us}, got {step_us!r}")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")

    size = min(w, h)
    centre = ((w - 1) / 2.0 + ox + rng.uniform(-0.06, 0.06) * size, (h - 1) / 2.0 + oy + rng.uniform(-0.06, 0.06) * size)
    scale = rng.uniform(0.85, 1.15)
    phase = rng.uniform(-0.2, 0.2)
    n_steps = -(-duration_us // step_us)  # ceil
    u = np.arange(n_steps + 1, dtype=np.float64) * step_us / duration_us
    frames = _render(label, np.minimum(u, 1.0), w, h, centre, scale, phase, float(speed))

    xs_list, ys_list, ts_list, ps_list = [], [], [], []
    ref = frames[0].copy()  # level at each pixel's last event
    for k in range(1, n_steps + 1):
        diff = frames[k] - ref
        n = np.floor(np.abs(diff) / threshold).astype(np.int64)
        if not n.any():
            continue
        ref += np.sign(diff) * n * threshold
        yy, xx = np.nonzero(n)
        counts = n[yy, xx]
        start = (k - 1) * step_us
        span = min(step_us, duration_us - start)
        xs_list.append(np.repeat(xx, counts))
        ys_list.append(np.repeat(yy, counts))
        ts_list.append(start + rng.integers(0, span, size=int(counts.sum())))
        ps_list.append(np.repeat(diff[yy, xx] > 0, counts))
    n_noise = int(rng.poisson(noise_rate_hz * w * h * duration_us * 1e-6))
    if n_noise:
        xs_list.append(rng.integers(0, w, n_noise))
        ys_list.append(rng.integers(0, h, n_noise))
        ts_list.append(rng.integers(0, duration_us, n_noise))
        ps_list.append(rng.integers(0, 2, n_noise).astype(bool))

    events = np.empty(sum(len(a) for a in xs_list), dtype=EVENT_DTYPE)
    if len(events):
        events["x"] = np.concatenate(xs_list)
        events["y"] = np.concatenate(ys_list)
        events["t"] = np.concatenate(ts_list)
        events["p"] = np.concatenate(ps_list) if n_pol == 2 else False
        events = events[np.argsort(events["t"], kind="stable")]
    return events


def stream(
    labels: Iterable[int],
    *,
    segment_us: int,
    rng: np.random.Generator,
    sensor_size: tuple[int, int, int] = (32, 32, 2),
    noise_rate_hz: float = 1.0,
    speed: float = 1.0,
    offset: tuple[float, float] = (0.0, 0.0),
    shift_at: int | None = None,
    shift: dict[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gestures ``labels`` one after another, each ``segment_us`` long, as one event stream.

    Every segment whose start time is ``>= shift_at`` (microseconds) is generated with the
    settings in ``shift`` (keys from ``SHIFT_KEYS``) overriding the base ones.
    Returns ``(events, segments)``: time-sorted ``EVENT_DTYPE`` events and a ``SEGMENT_DTYPE``
    array (start_us, end_us, label, shifted) per gesture; see ``segment_labels_at``.
    """
    labels = [_check_label(v) for v in labels]
    if not labels:
        raise ValueError("labels must hold at least one gesture label")
    shift = check_shift(shift)
    if shift and shift_at is None:
        raise ValueError("shift given without shift_at (the stream time in microseconds where it starts)")
    if shift_at is not None and (not isinstance(shift_at, (int, np.integer)) or shift_at < 0):
        raise ValueError(f"shift_at must be an int >= 0 (microseconds) or None, got {shift_at!r}")
    base = {"noise_rate_hz": noise_rate_hz, "speed": speed, "offset": offset}
    shifted_kw = {**base, **shift}
    for kw in (base, shifted_kw):  # validate both settings before generating anything
        _check_knobs(sensor_size, segment_us, kw["noise_rate_hz"], kw["speed"], kw["offset"])

    parts, segments = [], np.empty(len(labels), dtype=SEGMENT_DTYPE)
    for i, label in enumerate(labels):
        start = i * segment_us
        is_shifted = shift_at is not None and start >= shift_at
        ev = generate_sample(label, sensor_size=sensor_size, duration_us=segment_us, rng=rng,
                             **(shifted_kw if is_shifted else base))
        ev["t"] += start
        parts.append(ev)
        segments[i] = (start, start + segment_us, label, is_shifted)
    return np.concatenate(parts), segments


def random_stream(n_gestures: int, *, seed: int, segment_us: int, sensor_size: tuple[int, int, int] = (32, 32, 2),
                  shift: Mapping[str, Any] | None = None, shift_fraction: float = 0.5) -> EventStream:
    """``n_gestures`` random gestures back to back (labels and events from
    ``np.random.default_rng([seed, 7])``), the settings in ``shift`` applied from
    ``shift_fraction`` of the stream on."""
    if isinstance(n_gestures, bool) or not isinstance(n_gestures, (int, np.integer)) or n_gestures < 1:
        raise ValueError(f"n_gestures must be a positive int, got {n_gestures!r}")
    rng = np.random.default_rng([int(seed), 7])
    labels = [int(v) for v in rng.integers(0, len(CLASSES), n_gestures)]
    shift_at = int(round(n_gestures * shift_fraction)) * segment_us if shift else None
    events, segments = stream(labels, segment_us=segment_us, rng=rng, sensor_size=sensor_size, shift_at=shift_at,
                              shift=shift)
    return EventStream(events, segments, tuple(int(v) for v in sensor_size), shift_at)


class SyntheticGesture(torch.utils.data.Dataset):
    """``n_per_class * 11`` synthetic gestures as ``(frames float32 [T, 2, H, W], label int)``.

    Sample ``i`` has label ``i % 11`` and is generated from
    ``np.random.default_rng([seed, split, i])`` (train and test use different streams), so
    any sample is reproducible on its own. Frames go through ``EventsToFrames``, the same
    pipeline as DVS128 Gesture (``denoise_us=None`` by default: synthetic noise is the
    domain-shift knob).

    ``cache`` (default on): a sample is a pure function of (seed, split, index) and the
    settings, so its frames are simulated once, on first access, and kept in memory
    (``T * P * H * W * 4`` bytes each: 80 kB at T = 10 on the 32x32 sensor, about 14 MB for
    the 176 samples of a split at recipe size); items are copies, so the cache cannot be
    changed through them. With ``num_workers > 0`` each loader worker fills its own copy
    for one epoch only (``make_loader`` does not keep workers), so the cache pays off in the
    main process (``num_workers=0``).
    """

    classes = CLASSES

    def __init__(
        self,
        n_per_class: int = 20,
        split: str = "train",
        *,
        sensor_size: tuple[int, int, int] = (32, 32, 2),
        T: int = 20,
        duration_us: int = 500_000,
        noise_rate_hz: float = 1.0,
        speed: float = 1.0,
        offset: tuple[float, float] = (0.0, 0.0),
        denoise_us: float | None = None,
        seed: int = 0,
        cache: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(n_per_class, bool) or not isinstance(n_per_class, (int, np.integer)) or n_per_class < 1:
            raise ValueError(f"n_per_class must be a positive int, got {n_per_class!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.sensor_size, self.offset = _check_knobs(sensor_size, duration_us, noise_rate_hz, speed, offset)
        self.n_per_class, self.split, self.seed = int(n_per_class), split, int(seed)
        self.duration_us, self.noise_rate_hz, self.speed = int(duration_us), float(noise_rate_hz), float(speed)
        self.to_frames = EventsToFrames(sensor_size=self.sensor_size, T=T, size=None, denoise_us=denoise_us)
        self.targets = [i % len(CLASSES) for i in range(len(self))]
        self._frames: dict[int, torch.Tensor] | None = {} if cache else None

    def __len__(self) -> int:
        return self.n_per_class * len(CLASSES)

    def events(self, index: int) -> np.ndarray:
        """Raw events of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        rng = np.random.default_rng([self.seed, _SPLIT_CODE[self.split], int(index)])
        return generate_sample(self.targets[index], sensor_size=self.sensor_size, duration_us=self.duration_us,
                               rng=rng, noise_rate_hz=self.noise_rate_hz, speed=self.speed, offset=self.offset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = operator.index(index)
        if -len(self) <= index < 0:
            index += len(self)
        frames = self._frames.get(index) if self._frames is not None else None
        if frames is None:
            frames = torch.from_numpy(self.to_frames(self.events(index)))
            if self._frames is None:
                return frames, self.targets[index]
            self._frames[index] = frames
        return frames.clone(), self.targets[index]


def get_dataset(split: str, **kw: Any) -> SyntheticGesture:
    """Entry point for ``szo.data.get_dataset("synthetic-gesture", split, **kw)``.

    Keywords are ``SyntheticGesture``'s (``n_per_class`` defaults to 20).
    """
    valid = {"n_per_class", "sensor_size", "T", "duration_us", "noise_rate_hz", "speed", "offset",
             "denoise_us", "seed", "cache"}
    unknown = sorted(set(kw) - valid)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for synthetic-gesture; valid: {sorted(valid)}")
    return SyntheticGesture(split=split, **kw)
