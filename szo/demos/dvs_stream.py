"""On-line classification (and optional on-line SZO adaptation) of an event stream.

The stream is cut into fixed time windows (``window_ms``, default 50 ms). Each window's
events are binned into ``window_us / bin_us`` frames (a numpy histogram, the same counts as
``tonic.transforms.ToFrame``: channel = polarity, ``[bins, P, H, W]``) where ``bin_us`` is the
frame length the source model was trained with (gesture length / T). The network keeps its
neuron state from window to window (``with model.persistent_state():``).

On-line adaptation (``adapt="szo-cge" | "szo-rge"``): after a window is classified, one SZO
step on that window. The loss is the entropy of the prediction (unlabeled, default) or the
TET loss against the window's label (``use_labels=True``). Every probe evaluates the same
window from the same saved neuron state (the state before the window); after the step the
state is put back to what it was after the classification, so probes never disturb the
stream. The prediction for a window is always made before adapting on it (causal).

Source model: when no ``model_dir`` is given, a small ``spike_convnet`` is trained with BPTT
on synthetic gestures (``szo.data.synthetic_events``), its trajectory recorded
(``szo.trajectory``), and a k-dimensional subspace built (``subspace_store``); all of it is
cached under ``out_dir/source`` keyed by the training settings.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from spikingjelly.activation_based.base import MemoryModule
from torch import nn

from subspace_store import SubspaceStore, build_subspace
from szo import plots
from szo.data import make_loader
from szo.data import synthetic_events as se
from szo.data.dvs import validate_events
from szo.data.synthetic_events import CLASSES, SyntheticGesture, segment_labels_at
from szo.export import from_nir
from szo.io import atomic_write_json, load_weights, save_weights
from szo.losses import entropy_loss, tet_loss
from szo.methods import NO_ADAPTATION, TTA_METHODS, get_method, method_label
from szo.models import create
from szo.optim import build_optimizer
from szo.rundir import run_lock
from szo.runs import load_run_model
from szo.train import fit
from szo.train.callbacks import TrajectoryCallback
from szo.trajectory import TrajectoryRecorder

__all__ = [
    "ADAPT_METHODS",
    "SourceSettings",
    "StreamSettings",
    "SourceModel",
    "snapshot_state",
    "restore_state",
    "stack_states",
    "window_frames",
    "load_event_file",
    "synthetic_stream",
    "train_source_model",
    "load_source_model",
    "OnlineClassifier",
    "replay",
    "EventStream",
    "plot_timeline",
    "run_demo",
    "StreamInput",
]

#: the on-line adaptation methods (forward-only SZO in the source subspace), then no adaptation
ADAPT_METHODS = tuple(m for m in TTA_METHODS if get_method(m).adapter == "subspace-zo") + (NO_ADAPTATION,)
SOURCE_FORMAT = "szo-dvs-stream-source"
SOURCE_VERSION = 1
SUBSPACE_NAME = "source"
LABELS_LR = 0.2  # tuned on the synthetic noise shift (see docs in cli.py --lr)


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SourceSettings:
    """How the cached source model is trained (BPTT on synthetic gestures).

    ``T`` frames per ``duration_us`` gesture, so one frame covers ``duration_us / T`` (50 ms
    at the defaults); T = 10 instead of the paper's 20 keeps CPU training under a minute.
    """

    model: str = "spike_convnet"
    width: int = 16
    T: int = 10
    duration_us: int = 500_000
    sensor_size: tuple[int, int, int] = (32, 32, 2)
    n_train_per_class: int = 16
    n_test_per_class: int = 5
    epochs: int = 6
    batch_size: int = 16
    lr: float = 0.01
    record_every_steps: int = 2
    k: int = 20
    seed: int = 0

    def key(self) -> str:
        """Short hash of the settings (the cache key)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StreamSettings:
    """On-line settings (defaults: the unlabeled entropy loss; ``LABELS_LR`` is the tuned lr
    with ``use_labels=True``). ``lr`` / ``mu`` / ``momentum`` / ``q`` are SZO's (q: RGE only);
    ``buffer``: the SZO loss is taken over the last ``buffer`` windows (1 = the current one)."""

    window_ms: float = 50.0
    adapt: str = "szo-cge"
    use_labels: bool = False
    lr: float = 0.005
    mu: float = 0.5
    momentum: float = 0.0
    q: int = 4
    buffer: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.adapt not in ADAPT_METHODS:
            raise ValueError(f"adapt must be one of {ADAPT_METHODS}, got {self.adapt!r}")
        if not (isinstance(self.window_ms, (int, float)) and math.isfinite(self.window_ms) and self.window_ms > 0):
            raise ValueError(f"window_ms must be a positive number, got {self.window_ms!r}")
        if not self.lr >= 0 or not self.mu > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"need lr >= 0, mu > 0, 0 <= momentum < 1; got lr={self.lr}, mu={self.mu}, "
                             f"momentum={self.momentum}")
        if isinstance(self.q, bool) or not isinstance(self.q, int) or self.q < 1:
            raise ValueError(f"q must be a positive int, got {self.q!r}")
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 1:
            raise ValueError(f"buffer must be a positive int (windows per SZO loss), got {self.buffer!r}")


# ----------------------------------------------------------------------------- neuron state
def snapshot_state(model: nn.Module) -> list[dict[str, Any]]:
    """A copy of every stateful (SpikingJelly ``MemoryModule``) layer's memories (membrane v)."""
    snap = []
    for m in model.modules():
        if isinstance(m, MemoryModule):
            snap.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in m._memories.items()})
    return snap


def restore_state(model: nn.Module, snap: list[dict[str, Any]]) -> None:
    """Put back a ``snapshot_state`` copy (the snapshot itself stays untouched and reusable)."""
    mods = [m for m in model.modules() if isinstance(m, MemoryModule)]
    if len(mods) != len(snap):
        raise ValueError(f"state snapshot has {len(snap)} stateful layers, the model has {len(mods)}")
    for m, mem in zip(mods, snap):
        for k, v in mem.items():
            m._memories[k] = v.clone() if isinstance(v, torch.Tensor) else v


# ----------------------------------------------------------------------------- events
def window_frames(events: np.ndarray, t0: int, t1: int, bins: int, sensor_size: tuple[int, int, int],
                  downsample: int = 1) -> torch.Tensor:
    """Event counts of ``events`` with ``t0 <= t < t1`` in ``bins`` equal time bins.

    ``events`` must be valid for ``sensor_size`` and sorted by t (``validate_events``).
    Returns float32 ``[bins, P, H // downsample, W // downsample]``.
    """
    w, h, p = (int(v) for v in sensor_size)
    ow, oh = w // downsample, h // downsample
    t = events["t"]
    a, b = np.searchsorted(t, t0, side="left"), np.searchsorted(t, t1, side="left")
    ev = events[a:b]
    flat = np.zeros(bins * p * oh * ow, dtype=np.float32)
    if len(ev):
        bi = np.minimum(((ev["t"].astype(np.int64) - t0) * bins) // (t1 - t0), bins - 1)
        pol = ev["p"].astype(np.int64) if p == 2 else np.zeros(len(ev), dtype=np.int64)
        idx = ((bi * p + pol) * oh + ev["y"].astype(np.int64) // downsample) * ow + ev["x"].astype(np.int64) // downsample
        flat += np.bincount(idx, minlength=flat.size).astype(np.float32)
    return torch.from_numpy(flat.reshape(bins, p, oh, ow))


def load_event_file(path: str | os.PathLike, sensor_size: tuple[int, int, int],
                    labels_path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Read a ``.npy`` structured event array (x, y, t, p; t in microseconds), validated.

    Malformed events (outside the sensor, negative t, bad polarity) are dropped and counted;
    unsorted timestamps are sorted. ``labels_path``: a ``.npy`` structured array with fields
    ``start_us``, ``end_us``, ``label`` (one row per labeled segment, as
    ``synthetic_events.stream`` returns). Returns ``(events, segments or None, report dict)``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"event file {path} does not exist (expected a .npy structured array x, y, t, p)")
    try:
        raw = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read {path} as a .npy array without pickle: {e}") from None
    events, report = validate_events(raw, sensor_size, policy="drop")
    segments = None
    if labels_path is not None:
        lp = Path(labels_path)
        if not lp.is_file():
            raise ValueError(f"labels file {lp} does not exist")
        try:
            segments = np.load(lp, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot read {lp} as a .npy array without pickle: {e}") from None
        names = segments.dtype.names or ()
        if not {"start_us", "end_us", "label"} <= set(names):
            raise ValueError(f"labels file {lp} must be a structured array with fields start_us, end_us, label; "
                             f"got dtype {segments.dtype}")
        segments = np.sort(segments, order="start_us")
    return events, segments, report.as_dict()


def synthetic_stream(n_gestures: int, *, seed: int, segment_us: int, sensor_size: tuple[int, int, int],
                     shift: dict[str, Any] | None, shift_fraction: float = 0.5) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Random gestures back to back, the settings in ``shift`` applied from ``shift_fraction`` of
    the stream on. Returns ``(events, segments, shift_at_us or None)``."""
    if isinstance(n_gestures, bool) or not isinstance(n_gestures, int) or n_gestures < 1:
        raise ValueError(f"n_gestures must be a positive int, got {n_gestures!r}")
    rng = np.random.default_rng([int(seed), 7])
    labels = [int(v) for v in rng.integers(0, len(se.CLASSES), n_gestures)]
    shift_at = int(round(n_gestures * shift_fraction)) * segment_us if shift else None
    events, segments = se.stream(labels, segment_us=segment_us, rng=rng, sensor_size=sensor_size,
                                 shift_at=shift_at, shift=shift)
    return events, segments, shift_at


# ----------------------------------------------------------------------------- source model
@dataclass
class SourceModel:
    """A trained model, its subspace and what the stream needs to feed it."""

    model: Any
    subspace: Any
    meta: dict
    directory: Path

    @property
    def bin_us(self) -> int:
        return int(self.meta["bin_us"])

    @property
    def sensor_size(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in self.meta["sensor_size"])  # type: ignore[return-value]

    def fresh_model(self) -> Any:
        """A private copy of the source model (eval mode) that a replay may adapt in place."""
        model = copy.deepcopy(self.model)
        model.reset_state()
        return model.eval()


def _build_and_load(meta: dict, directory: Path) -> Any:
    """The model ``source.json`` describes, with ``model.safetensors`` (strict: names and shapes)."""
    model = create(meta["model"], **meta["model_kwargs"])
    try:
        model.load_state_dict(load_weights(directory / "model.safetensors"), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{directory / 'model.safetensors'} does not fit {meta['model']} "
                         f"{meta['model_kwargs']}: {e}") from None
    return model.eval()


def _load_recipe_run(directory: Path) -> SourceModel:
    """A ``szo recipe synthetic-gesture`` run directory (config.yaml + model.safetensors + store entry),
    its model rebuilt by ``szo.pipeline.load_run_model``."""
    import yaml


    raw = yaml.safe_load((directory / "config.yaml").read_text(encoding="utf-8")) or {}
    data = raw.get("data") or {}
    if data.get("name") != "synthetic-gesture" or raw.get("kind") != "bp":
        raise ValueError(f"{directory} is a recipe run of kind {raw.get('kind')!r} on {data.get('name')!r}; the "
                         "demo needs a BPTT run on synthetic-gesture (szo recipe synthetic-gesture)")
    if not (directory / "model.safetensors").is_file():
        raise ValueError(f"{directory} has no model.safetensors (did the recipe finish?)")
    model, cfg = load_run_model(directory)
    model.eval()
    kw = cfg["data"]["kwargs"]
    # the frame length the model was trained with: the data set's settings (its defaults filled in)
    ds = SyntheticGesture(n_per_class=1, **{k: v for k, v in kw.items() if k in ("T", "duration_us", "sensor_size")})
    meta = {"format": SOURCE_FORMAT, "version": SOURCE_VERSION, "model": cfg["model"]["name"],
            "bin_us": ds.duration_us // int(ds.to_frames.T), "sensor_size": list(ds.sensor_size),
            "settings": {"duration_us": ds.duration_us}, "recipe": cfg["name"]}
    results = directory / "results.json"
    if results.is_file():
        meta["test_acc"] = json.loads(results.read_text(encoding="utf-8")).get("final_test_acc")
    sub = cfg["subspace"]
    subspace = SubspaceStore(sub["root"]).load(sub["name"], model=model)
    return SourceModel(model=model, subspace=subspace, meta=meta, directory=directory)


def _load_nir(path: Path) -> SourceModel:
    """A model exported with ``szo export`` (``szo.export.from_nir``): runs as is; it has no
    subspace (BN folded, its own parameter layout), so the stream runs without adaptation."""
    model = from_nir(path).eval()
    meta = dict(model.nir_metadata)
    if "bin_us" not in meta or "sensor_size" not in meta:
        raise ValueError(f"{path} does not record the frame length (metadata 'bin_us' / 'sensor_size'); export a "
                         "dvs-stream source model or a synthetic-gesture run: szo export DIR --to nir OUT.nir")
    meta = {"format": SOURCE_FORMAT, "version": SOURCE_VERSION, "model": model.model_name,
            "bin_us": int(meta["bin_us"]), "sensor_size": [int(v) for v in meta["sensor_size"]], "nir": str(path),
            "settings": {"duration_us": int(meta.get("duration_us", int(meta["bin_us"]) * model.T))}}
    return SourceModel(model=model, subspace=None, meta=meta, directory=path)


def load_source_model(directory: str | os.PathLike) -> SourceModel:
    """Read a source-model directory written by ``train_source_model``, a ``szo recipe
    synthetic-gesture`` run directory (its subspace from the recipe's store), or a ``.nir``
    file written by ``szo export`` from either (no subspace: ``adapt="none"`` only)."""
    directory = Path(directory)
    if directory.suffix == ".nir" and directory.is_file():
        return _load_nir(directory)
    meta_path = directory / "source.json"
    if not meta_path.is_file() and (directory / "config.yaml").is_file():
        return _load_recipe_run(directory)
    if not meta_path.is_file():
        raise ValueError(f"{directory} is neither a dvs-stream source model directory (source.json) nor a "
                         "recipe run (config.yaml); omit --model to train one")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format") != SOURCE_FORMAT or meta.get("version") != SOURCE_VERSION:
        raise ValueError(f"{meta_path} has format {meta.get('format')!r} v{meta.get('version')!r}; "
                         f"expected {SOURCE_FORMAT!r} v{SOURCE_VERSION}")
    model = _build_and_load(meta, directory)
    subspace = SubspaceStore(directory / "subspaces").load(SUBSPACE_NAME, model=model)
    return SourceModel(model=model, subspace=subspace, meta=meta, directory=directory)


def train_source_model(directory: str | os.PathLike, settings: SourceSettings = SourceSettings(), *,
                       progress: bool = True, log: Callable[[str], None] = print) -> SourceModel:
    """Train (BPTT, TET loss) on synthetic gestures, record the trajectory, build the subspace.

    Reuses ``directory`` when it already holds a model trained with the same settings.
    """
    directory = Path(directory)
    meta_path = directory / "source.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            meta = {}
        if meta.get("settings_key") == settings.key():
            log(f"source model: reusing {directory} (test acc {meta.get('test_acc', float('nan')):.3f})")
            return load_source_model(directory)
    if directory.exists():  # stale or different settings: train afresh in a clean run directory
        import shutil

        for sub in ("run", "trajectory", "subspaces"):
            shutil.rmtree(directory / sub, ignore_errors=True)
    t_start = time.perf_counter()
    s = settings
    n_classes = 11
    gen = torch.Generator().manual_seed(s.seed)
    torch.manual_seed(s.seed)  # SpikingJelly/torch init draws from the global generator
    kw = dict(sensor_size=s.sensor_size, T=s.T, duration_us=s.duration_us, seed=s.seed)
    train_ds = SyntheticGesture(n_per_class=s.n_train_per_class, split="train", **kw)
    test_ds = SyntheticGesture(n_per_class=s.n_test_per_class, split="test", **kw)

    train_loader = make_loader(train_ds, s.batch_size, shuffle=True, generator=gen)  # frames cached by the data set
    test_loader = make_loader(test_ds, 64, shuffle=False)
    model_kwargs = dict(num_classes=n_classes, T=s.T, in_channels=int(s.sensor_size[2]), width=s.width)
    model = create(s.model, **model_kwargs)
    recorder = TrajectoryRecorder(directory / "trajectory", model, every=s.record_every_steps)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    summary = fit(model, train_loader, test_loader, opt, epochs=s.epochs, loss_fn=tet_loss,
                  run_dir=directory / "run", callbacks=[TrajectoryCallback(recorder)], generator=gen,
                  progress=progress, plot=False, info={"demo": "dvs-stream source", "optimizer": "adam"})
    subspace = build_subspace([directory / "trajectory"], s.k, reference="last", progress=False)
    SubspaceStore(directory / "subspaces").save(SUBSPACE_NAME, subspace, overwrite=True)
    model.eval()
    save_weights(directory / "model.safetensors", model.state_dict(), {"model": s.model})
    meta = {
        "format": SOURCE_FORMAT, "version": SOURCE_VERSION, "settings_key": settings.key(),
        "settings": asdict(settings), "model": s.model, "model_kwargs": model_kwargs,
        "fingerprint": model.fingerprint(), "bin_us": s.duration_us // s.T,
        "sensor_size": list(s.sensor_size), "test_acc": float(summary["final_test_acc"]),
        "n_trajectory_samples": len(recorder), "k": s.k,
        "train_seconds": round(time.perf_counter() - t_start, 2),
    }
    atomic_write_json(meta_path, meta)
    log(f"source model: trained in {meta['train_seconds']:.1f}s, test acc {meta['test_acc']:.3f}, "
        f"subspace k={s.k} from {meta['n_trajectory_samples']} trajectory samples -> {directory}")
    return SourceModel(model=model, subspace=subspace, meta=meta, directory=directory)


# ----------------------------------------------------------------------------- on-line loop
def stack_states(snaps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Concatenate single-stream state snapshots along the batch dimension (dim 0).

    A memory that is still SpikingJelly's initial float (no forward yet) becomes zeros.
    """
    if len(snaps) == 1:
        return snaps[0]
    out = []
    for layer in zip(*snaps):
        merged = {}
        for k in layer[0]:
            vals = [m[k] for m in layer]
            ref = next((v for v in vals if isinstance(v, torch.Tensor)), None)
            if ref is None:
                merged[k] = vals[0]
            else:
                merged[k] = torch.cat([v if isinstance(v, torch.Tensor) else torch.full_like(ref, float(v))
                                       for v in vals])
        out.append(merged)
    return out


class OnlineClassifier:
    """Classifies windows with carried neuron state; optionally one SZO step per window.

    The SZO loss is evaluated on the last ``settings.buffer`` windows (the current one and
    the ones before it), each from the neuron state saved before it, as one batch. Call
    inside ``with model.persistent_state():``.
    """

    def __init__(self, model: Any, subspace: Any, settings: StreamSettings) -> None:
        self.model = model
        self.settings = settings
        self.opt = None
        if settings.adapt != NO_ADAPTATION:
            self.opt = build_optimizer(settings.adapt, model, subspace=subspace, lr=settings.lr,
                                       momentum=settings.momentum, mu=settings.mu, q=settings.q,
                                       generator=torch.Generator().manual_seed(settings.seed), start="current")
        self._entropy, self._tet = entropy_loss, tet_loss
        self._buffer: list[tuple[torch.Tensor, list[dict[str, Any]], int]] = []

    @property
    def forward_passes(self) -> int:
        return 0 if self.opt is None else self.opt.forward_passes

    @torch.no_grad()
    def classify(self, frames: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Prediction for one window ``[bins, P, H, W]`` (state carried); also the logits ``[bins, 1, C]``."""
        out = self.model(frames.unsqueeze(1))
        return int(out.mean(0).argmax(1)), out

    @torch.no_grad()
    def adapt(self, frames: torch.Tensor, before: list[dict[str, Any]], label: int | None) -> float:
        """One SZO step on this window (and the buffered ones); every probe starts each window
        from the neuron state saved before it (``before`` for this one).

        Leaves the neuron state as it was when called. Returns the mean probe loss.
        """
        if self.opt is None:
            raise ValueError("adapt() called with adapt='none'")
        if self.settings.use_labels and (label is None or label < 0):
            raise ValueError("use_labels needs a label for every adapted window")
        self._buffer.append((frames, before, -1 if label is None else int(label)))
        del self._buffer[: -self.settings.buffer]
        after = snapshot_state(self.model)
        x = torch.stack([b[0] for b in self._buffer], 1)  # [bins, B, P, H, W]
        start = stack_states([b[1] for b in self._buffer])
        if self.settings.use_labels:
            y = torch.tensor([b[2] for b in self._buffer])
            loss_fn = lambda out: self._tet(out, y)  # noqa: E731
        else:
            loss_fn = self._entropy

        def closure() -> torch.Tensor:
            restore_state(self.model, start)
            return loss_fn(self.model(x))

        try:
            loss = float(self.opt.step(closure))
        finally:
            restore_state(self.model, after)
        return loss


@dataclass(frozen=True)
class EventStream:
    """A recorded event stream cut into windows: ``events`` (structured ``x, y, t, p``),
    ``segments`` (labelled time ranges, or ``None``), the window and the model's frame length
    in microseconds, the sensor and its integer ``downsample`` onto the model's input, the time
    range (default: the events' / segments') and ``shift_at`` (when a domain shift begins)."""

    events: np.ndarray
    segments: np.ndarray | None
    window_us: int
    bin_us: int
    sensor_size: tuple[int, int, int]
    downsample: int = 1
    t_start: int | None = None
    t_end: int | None = None
    shift_at: int | None = None


def replay(stream: EventStream, classifier: OnlineClassifier, *, print_every: int = 0, name: str = "",
           log: Callable[[str], None] = print) -> dict:
    """Feed the stream window by window; returns per-window records and the summary numbers."""
    events, segments, window_us, bin_us = stream.events, stream.segments, stream.window_us, stream.bin_us
    t_start, t_end, shift_at = stream.t_start, stream.t_end, stream.shift_at
    if window_us % bin_us:
        raise ValueError(f"window ({window_us / 1000:g} ms) must be a multiple of the model's frame length "
                         f"({bin_us / 1000:g} ms)")
    bins = window_us // bin_us
    t0 = int(events["t"][0]) if t_start is None and len(events) else int(t_start or 0)
    if segments is not None and t_start is None and len(segments):
        t0 = int(segments["start_us"][0])
    t1 = int(t_end) if t_end is not None else (int(events["t"][-1]) + 1 if len(events) else t0)
    if segments is not None and t_end is None and len(segments):
        t1 = max(t1, int(segments["end_us"][-1]))
    starts = np.arange(t0, t1, window_us, dtype=np.int64)
    if len(starts) == 0:
        raise ValueError("the stream holds no complete window (no events / empty time range)")
    labels = (segment_labels_at(segments, starts + window_us // 2) if segments is not None
              else np.full(len(starts), -1, dtype=np.int64))
    names = _class_names()
    recs: list[dict] = []
    n_lab = n_ok = 0
    model = classifier.model
    compute = 0.0
    with model.persistent_state():
        for i, (ws, lab) in enumerate(zip(starts, labels)):
            frames = window_frames(events, int(ws), int(ws) + window_us, bins, stream.sensor_size, stream.downsample)
            tic = time.perf_counter()
            before = snapshot_state(model) if classifier.opt is not None else None
            pred, _ = classifier.classify(frames)
            latency = time.perf_counter() - tic  # time to a prediction
            loss = None
            if classifier.opt is not None and (lab >= 0 or not classifier.settings.use_labels):
                loss = classifier.adapt(frames, before, int(lab))
            compute += time.perf_counter() - tic
            if lab >= 0:
                n_lab += 1
                n_ok += int(pred == lab)
            rec = {"window": i, "t_ms": round(float(ws) / 1000, 3), "label": int(lab), "pred": pred,
                   "latency_ms": round(latency * 1000, 3),
                   "step_ms": round((time.perf_counter() - tic) * 1000, 3),
                   "running_acc": (n_ok / n_lab) if n_lab else None, "loss": loss}
            recs.append(rec)
            if print_every and (i % print_every == 0 or i == len(starts) - 1):
                acc = f"{rec['running_acc']:.3f}" if n_lab else "  n/a"
                true = names[lab] if 0 <= lab < len(names) else "?"
                log(f"[{name}] w{i:04d} t={ws / 1e6:7.2f}s true={true:<13} pred={names[pred] if pred < len(names) else pred:<13} "
                    f"lat={rec['latency_ms']:6.2f}ms step={rec['step_ms']:6.2f}ms acc={acc}")
    stream_s = len(starts) * window_us / 1e6
    lab = np.array([r["label"] for r in recs])
    pred = np.array([r["pred"] for r in recs])

    def acc(mask: np.ndarray) -> float | None:
        m = mask & (lab >= 0)
        return float((pred[m] == lab[m]).mean()) if m.any() else None

    t = starts
    lat = np.array([r["latency_ms"] for r in recs])
    summary = {
        "n_windows": len(recs), "window_ms": window_us / 1000, "bins_per_window": bins,
        "stream_seconds": stream_s, "compute_seconds": round(compute, 4),
        "real_time_factor": round(stream_s / compute, 3) if compute > 0 else None,
        "accuracy": acc(np.ones(len(t), bool)),
        "accuracy_before_shift": acc(t < shift_at) if shift_at is not None else None,
        "accuracy_after_shift": acc(t >= shift_at) if shift_at is not None else None,
        "latency_ms_mean": round(float(lat.mean()), 3), "latency_ms_p95": round(float(np.percentile(lat, 95)), 3),
        "step_ms_mean": round(float(np.mean([r["step_ms"] for r in recs])), 3),
        "forward_passes_adapt": classifier.forward_passes,
    }
    return {"summary": summary, "windows": recs}


def _class_names() -> tuple[str, ...]:
    return CLASSES


# ----------------------------------------------------------------------------- plot
def _run_name(name: str) -> str:
    """A run's name in the plot: the method's label (``No adapt.``), ``+labels`` kept."""
    method, plus, rest = name.partition("+")
    return method_label(method) + plus + rest


def plot_timeline(path: str | os.PathLike, runs: dict[str, dict], *, shift_at_s: float | None,
                  n_classes: int, class_names: Sequence[str] | None = None, smooth: int = 20) -> None:
    """PNG: true label and predictions per window (top, classes by name when ``class_names``
    has one per class), running and sliding accuracy (bottom); the legends sit right of the
    panels, never over the data."""
    names = list(class_names) if class_names is not None and len(class_names) == n_classes else None
    fig, (ax1, ax2) = plots.pyplot().subplots(2, 1, figsize=(12, 6.5), sharex=True)
    smooth = max(1, min(smooth, len(next(iter(runs.values()))["windows"])))
    first = next(iter(runs.values()))["windows"]
    t = np.array([r["t_ms"] for r in first]) / 1000
    lab = np.array([r["label"] for r in first])
    ax1.step(t, np.where(lab >= 0, lab, np.nan), where="post", color="k", lw=2, label="true class")
    for j, (name, run) in enumerate(runs.items()):
        pred = np.array([r["pred"] for r in run["windows"]])
        ax1.scatter(t, pred + 0.15 * (j - 0.5), s=10, marker=plots.MARKERS[j % len(plots.MARKERS)],
                    label=f"predicted ({_run_name(name)})")
        ok = (pred == lab).astype(float)
        valid = lab >= 0
        run_acc = np.array([r["running_acc"] if r["running_acc"] is not None else np.nan for r in run["windows"]])
        slide = np.convolve(np.where(valid, ok, 0), np.ones(smooth), "same") / np.maximum(
            np.convolve(valid.astype(float), np.ones(smooth), "same"), 1)
        line, = ax2.plot(t, run_acc, lw=2, label=f"since the start ({_run_name(name)})")
        ax2.plot(t, slide, lw=1, ls="--", color=line.get_color(), label=f"last {smooth} windows ({_run_name(name)})")
    for ax in (ax1, ax2):
        if shift_at_s is not None:
            ax.axvline(shift_at_s, color="r", ls=":", lw=2, label="domain shift")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("class")
    ax1.set_yticks(range(n_classes))
    if names is not None:
        ax1.set_yticklabels(names, fontsize=8)
    ax1.set_ylim(-0.6, n_classes - 0.4)
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("stream time (s)")
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="per window", title_fontsize=8)
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="accuracy", title_fontsize=8)
    plots.save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------- demo
DEFAULT_SHIFT = {"noise_rate_hz": 5.0}


@dataclass(frozen=True)
class StreamInput:
    """Where the demo's events and model come from: ``source`` ``"synthetic"`` (``n_gestures``
    random gestures, a domain ``shift`` half way) or a ``.npy`` event file (``labels_file``,
    ``sensor_size``); ``model_dir``: an earlier source model (default: train one)."""

    source: str = "synthetic"
    labels_file: str | None = None
    model_dir: str | None = None
    n_gestures: int = 30
    shift: dict[str, Any] | None = None
    sensor_size: tuple[int, int, int] | None = None


def run_demo(out_dir: str | os.PathLike, *, stream: StreamSettings = StreamSettings(),
             source_settings: SourceSettings = SourceSettings(), compare: bool = True, print_every: int = 20,
             threads: int | None = 1, progress: bool = True, log: Callable[[str], None] = print,
             **inputs: Any) -> dict:
    """The whole demo; writes ``summary.json`` and ``timeline.png`` under ``out_dir`` (holding the
    directory's lock; ``summary.json`` says ``"status": "completed"``). ``inputs``: the fields of
    :class:`StreamInput`. With ``compare`` and an adapting method, the same stream is also
    replayed without adaptation, from the same source weights.
    """
    with run_lock(out_dir):
        return _run_demo(Path(out_dir), StreamInput(**inputs), stream, source_settings, compare, print_every,
                         threads, progress, log)


def _run_demo(out_dir: Path, inp: StreamInput, stream: StreamSettings, source_settings: SourceSettings,
              compare: bool, print_every: int, threads: int | None, progress: bool,
              log: Callable[[str], None]) -> dict:
    source, labels_file, model_dir, n_gestures = inp.source, inp.labels_file, inp.model_dir, inp.n_gestures
    shift, sensor_size = inp.shift, inp.sensor_size
    out_dir.mkdir(parents=True, exist_ok=True)
    t_wall = time.perf_counter()
    src = load_source_model(model_dir) if model_dir else train_source_model(
        out_dir / "source", source_settings, progress=progress, log=log)
    if src.subspace is None and stream.adapt != NO_ADAPTATION:
        raise ValueError(f"{model_dir} is an exported NIR model: it has no subspace to adapt in; "
                         f"run it with --adapt none")
    shift_at = None
    report = None
    if source == "synthetic":
        if labels_file is not None:
            raise ValueError("--labels-file is only for a FILE source")
        shift = DEFAULT_SHIFT if shift is None else shift
        events, segments, shift_at = synthetic_stream(
            n_gestures, seed=stream.seed, segment_us=int(src.meta["settings"]["duration_us"]),
            sensor_size=src.sensor_size, shift=shift)
        sensor = src.sensor_size
    else:
        sensor = tuple(sensor_size) if sensor_size is not None else src.sensor_size
        events, segments, report = load_event_file(source, sensor, labels_file)
        if report["n_dropped"] or report["n_unsorted"]:
            log(f"event file: dropped {report['n_dropped']} malformed event(s) of {report['n_in']} "
                f"({report['n_out_of_sensor']} outside the sensor, {report['n_bad_time']} bad t, "
                f"{report['n_bad_polarity']} bad polarity); {report['n_unsorted']} out of order (sorted)")
        shift = None
    if stream.use_labels and segments is None:
        raise ValueError("--labels needs a labeled stream (a synthetic source, or --labels-file for a FILE)")
    sw, sh = sensor[0], sensor[1]
    mw, mh = src.sensor_size[0], src.sensor_size[1]
    if sw % mw or sh % mh or sw // mw != sh // mh or sensor[2] != src.sensor_size[2]:
        raise ValueError(f"sensor {tuple(sensor)} cannot be mapped onto the model's input {src.sensor_size} "
                         "(W and H must be the same integer multiple; same polarity count)")
    downsample = sw // mw
    window_us = int(round(stream.window_ms * 1000))
    methods = [stream.adapt] + ([NO_ADAPTATION] if compare and stream.adapt != NO_ADAPTATION else [])
    prev_threads = torch.get_num_threads()
    if threads is not None:  # one window is a tiny tensor: thread hand-off costs more than it saves
        torch.set_num_threads(int(threads))
    try:
        recorded = EventStream(events, segments, window_us, src.bin_us, sensor, downsample, shift_at=shift_at)
        runs = _replay_all(methods, src, stream, recorded, print_every, log)
    finally:
        torch.set_num_threads(prev_threads)
    summary = {
        "source": str(source), "model_dir": str(src.directory), "source_test_acc": src.meta.get("test_acc"),
        "stream": asdict(stream), "shift": shift, "shift_at_s": None if shift_at is None else shift_at / 1e6,
        "n_events": int(len(events)), "validation": report,
        "runs": {k: v["summary"] for k, v in runs.items()},
        "wall_seconds": None, "status": "completed",
    }
    plot_timeline(out_dir / "timeline.png", runs, shift_at_s=summary["shift_at_s"],
                  n_classes=int(src.model.num_classes), class_names=_class_names())
    atomic_write_json(out_dir / "windows.json", {k: v["windows"] for k, v in runs.items()})
    summary["wall_seconds"] = round(time.perf_counter() - t_wall, 2)
    atomic_write_json(out_dir / "summary.json", summary)
    log(f"wrote {out_dir / 'summary.json'} and {out_dir / 'timeline.png'} ({summary['wall_seconds']:.1f}s)")
    return summary


def _replay_all(methods: list[str], src: SourceModel, stream: StreamSettings, recorded: EventStream,
                print_every: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Replay the same stream once per method, each from fresh source weights."""
    runs: dict[str, dict] = {}
    for method in methods:
        settings = StreamSettings(**{**asdict(stream), "adapt": method})
        clf = OnlineClassifier(src.fresh_model(), src.subspace, settings)
        name = method + ("+labels" if settings.use_labels and method != NO_ADAPTATION else "")
        runs[name] = replay(recorded, clf, print_every=print_every, name=name, log=log)
        s = runs[name]["summary"]
        log(f"[{name}] accuracy {_fmt(s['accuracy'])} (before shift {_fmt(s['accuracy_before_shift'])}, "
            f"after shift {_fmt(s['accuracy_after_shift'])}); real-time factor {s['real_time_factor']} "
            f"(stream {s['stream_seconds']:.2f}s / compute {s['compute_seconds']:.2f}s); "
            f"latency {s['latency_ms_mean']:.2f}ms mean")
    return runs


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
