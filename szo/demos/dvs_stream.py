"""``szo demo dvs-stream``: an event stream classified window by window, adapting on-line with SZO.

The stream (``szo.data.dvs.FileEventStream``: an event file of any format of ``szo.data.event_files``,
read chunk by chunk in bounded memory, its sensor mapped onto the model's input by ``fit``; or
``szo.data.synthetic_events.random_stream``: seeded gestures, a domain shift half way) is cut into
``window_ms`` windows that tonic bins into frames of the source model's frame length; ``szo.demos.online`` classifies them with carried
neuron state and adapts (``adapt``: one SZO step per window in the source subspace).

Source model: the recipe ``recipe`` (``synthetic-gesture``, ``overrides`` on top) trained in
``OUT/source`` by ``szo.stages.bptt_stage`` (trajectory, checkpoints, subspace in ``OUT/subspaces``),
or ``model``: a finished run directory of such a recipe, or a ``.nir`` file exported from one.

Settings: ``szo.demos.settings.StreamConfig``. Run contract (docs/runs.md): ``run_demo`` holds
``OUT/.lock`` and writes the settings to ``OUT/config.yaml``; a directory holding a demo run is
refused unless ``resume``, which continues it with its own settings (a changed one is refused in one
line): the BPTT stage from its checkpoint (its config pinned there), then the replays (one pass over
the stream) again, giving the same predictions.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from szo.build import load_run_model, subspace_store_for
from szo.config import RecipeConfig, load_recipe, write_config
from szo.data import get_dataset
from szo.data.dvs import EventStream, FileEventStream, SensorFit, load_segments, open_event_file
from szo.data.synthetic_events import random_stream
from szo.demos.online import OnlineClassifier, plot_timeline, replay
from szo.demos.settings import StreamConfig, resumed_settings
from szo.export import from_nir
from szo.io import atomic_write_json
from szo.methods import NO_ADAPTATION
from szo.rundir import check_resume_config, run_lock
from szo.stages import bptt_stage, device_for

__all__ = ["SourceModel", "load_source_model", "train_source_model", "run_demo"]

# ----------------------------------------------------------------------------- source model
@dataclass
class SourceModel:
    """A trained model, its subspace (None for a NIR file) and the frames it was trained on: one
    frame per ``bin_us``, a ``sensor_size`` (W, H, P) input, gestures of ``duration_us``, ``classes``."""

    model: Any
    subspace: Any
    bin_us: int
    sensor_size: tuple[int, int, int]
    duration_us: int
    classes: tuple[str, ...] | None
    directory: Path
    test_acc: float | None = None

    def fresh_model(self) -> Any:
        """A private copy of the source model (eval mode) that a replay may adapt in place."""
        model = copy.deepcopy(self.model)
        model.reset_state()
        return model.eval()


def _frames_of(cfg: RecipeConfig, directory: Path) -> SourceModel:
    """What the recipe's data set says of its frames (no model yet)."""
    if cfg.kind != "bp" or cfg.data.name != "synthetic-gesture":
        raise ValueError(f"{directory}: recipe {cfg.name!r} is kind {cfg.kind!r} on {cfg.data.name!r}; the demo needs "
                         "a BPTT run on synthetic-gesture (szo recipe synthetic-gesture)")
    ds = get_dataset(cfg.data.name, "test", **cfg.data.kwargs)
    return SourceModel(None, None, ds.duration_us // ds.to_frames.T, ds.sensor_size, ds.duration_us, ds.classes,
                       directory)


def load_source_model(path: str | Path) -> SourceModel:
    """A finished ``synthetic-gesture`` BPTT run directory (its subspace from the recipe's store),
    or a ``.nir`` file exported from one (``szo export``; no subspace)."""
    path = Path(path)
    if path.suffix == ".nir" and path.is_file():
        model = from_nir(path).eval()
        meta = model.nir_metadata
        if "bin_us" not in meta or "sensor_size" not in meta:
            raise ValueError(f"{path} does not record the frame length (metadata 'bin_us' / 'sensor_size'); export a "
                             "synthetic-gesture run: szo export RUN_DIR --to nir OUT.nir")
        bin_us = int(meta["bin_us"])
        return SourceModel(model, None, bin_us, tuple(int(v) for v in meta["sensor_size"]),  # type: ignore[arg-type]
                           int(meta.get("duration_us", bin_us * model.T)), None, path)
    if not (path / "config.yaml").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} is neither a finished recipe run (config.yaml, model.safetensors) nor a .nir file; "
                         "omit --model to train one")
    src, (model, cfg) = _frames_of(load_recipe(path / "config.yaml"), path), load_run_model(path)
    src.model, src.subspace = model.eval(), subspace_store_for(cfg).load(cfg.subspace.name, model=model)
    results = path / "results.json"
    src.test_acc = json.loads(results.read_text(encoding="utf-8")).get("final_test_acc") if results.is_file() else None
    return src


def train_source_model(cfg: RecipeConfig, directory: str | Path, *, resume: bool = False) -> SourceModel:
    """``szo.stages.bptt_stage`` in ``directory`` (trajectory, checkpoints, the subspace in the store),
    unless it finished there with this config; then the model."""
    directory = Path(directory)
    _frames_of(cfg, directory)
    if (directory / "model.safetensors").is_file() and subspace_store_for(cfg).exists(cfg.subspace.name):
        check_resume_config(directory, cfg, "bptt")
    else:
        bptt_stage(cfg, directory, device=device_for(cfg), resume=resume)
    return load_source_model(directory)


# ----------------------------------------------------------------------------- the demo
def _stream(cfg: StreamConfig, src: SourceModel, window_us: int,
            log: Callable[[str], None]) -> tuple[EventStream | FileEventStream, dict | None]:
    """The event stream the settings name, checked against the model (sensor size, classes, window geometry)
    and scanned once (bounded memory) before anything is written; a FILE's validation report."""
    if window_us % src.bin_us:
        raise ValueError(f"window ({cfg.window_ms:g} ms) must be a multiple of the model's frame length "
                         f"({src.bin_us / 1000:g} ms)")
    if cfg.source == "synthetic":
        return random_stream(cfg.gestures, seed=cfg.seed, segment_us=src.duration_us, sensor_size=src.sensor_size,
                             shift=cfg.shift), None
    ef = open_event_file(cfg.source)
    sensor = tuple(cfg.sensor_size or ef.sensor_size or src.sensor_size)
    fit = SensorFit(sensor, src.sensor_size, cfg.fit, source=cfg.source)  # type: ignore[arg-type]
    segments = None if cfg.labels_file is None else load_segments(cfg.labels_file)
    n_classes = len(src.classes) if src.classes else int(src.model.num_classes) if src.model is not None else None
    if segments is not None and n_classes is not None and len(segments):
        bad = sorted({int(v) for v in segments["label"] if not 0 <= int(v) < n_classes})
        if bad:
            raise ValueError(f"labels file {cfg.labels_file} holds label(s) {bad[:5]} but the model has {n_classes} "
                             f"classes (0..{n_classes - 1})")
    stream = FileEventStream(ef, sensor, fit, segments)  # type: ignore[arg-type]
    stream.window_starts(window_us)
    rep = stream.report
    log(f"event file {cfg.source}: {rep.n_in} events, sensor {fit.describe()}")
    if rep.n_dropped or rep.n_unsorted:
        log(f"event file: dropped {rep.n_dropped} malformed event(s) of {rep.n_in} ({rep.n_bad_time} bad t, "
            f"{rep.n_bad_polarity} bad polarity); {rep.n_unsorted} out of order")
    return stream, rep.as_dict()


def run_demo(out_dir: str | Path, cfg: StreamConfig | None = None, *, resume: bool = False, print_every: int = 20,
             threads: int | None = 1, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The demo in ``out_dir`` under the run contract (module docstring): config.yaml, then summary.json
    (``"status": "completed"``), windows.json and timeline.png. With ``cfg.compare`` an adapting run is
    followed by a replay of the same stream without adaptation, from the same source weights."""
    cfg, out, t_wall = cfg or StreamConfig(), Path(out_dir), time.perf_counter()
    with run_lock(out):
        if (out / "config.yaml").is_file():
            if not resume:
                raise ValueError(f"{out} already holds a dvs-stream run; pass --resume to continue it, or use another "
                                 f"--out (--model {out / 'source'} replays its source model)")
            resumed_settings(out, {})  # a dvs-stream run's config.yaml, or one line
            check_resume_config(out, cfg.as_written())
        rc = None if cfg.model else load_recipe(cfg.recipe, [f"subspace.root={(out / 'subspaces').resolve()}",
                                                             *cfg.overrides])
        src = load_source_model(cfg.model) if rc is None else _frames_of(rc, out / "source")
        if rc is not None and (out / "source" / "source.json").is_file():  # its trajectory would be continued
            raise ValueError(f"{out / 'source'} holds a source model of an earlier szo (source.json); remove it or "
                             "use another --out")
        if rc is None and src.subspace is None and cfg.adapt != NO_ADAPTATION:
            raise ValueError(f"{cfg.model} is an exported NIR model: it has no subspace to adapt in; run it with "
                             "--adapt none")
        window_us, runs = round(cfg.window_ms * 1000), {}
        stream, report = _stream(cfg, src, window_us, log)  # every input checked before config.yaml and training
        write_config(cfg.as_written(), out / "config.yaml")
        if rc is not None:
            src = train_source_model(rc, out / "source", resume=resume)
        for method in dict.fromkeys([cfg.adapt] + [NO_ADAPTATION] * cfg.compare):  # each from the source weights
            name = method + ("+labels" if cfg.loss == "labels" and method != NO_ADAPTATION else "")
            clf = OnlineClassifier(src.fresh_model(), src.subspace, cfg.replace(adapt=method))
            runs[name] = replay(stream, clf, window_us=window_us, bins=window_us // src.bin_us, threads=threads,
                                classes=src.classes,
                                print_every=print_every, name=name, log=log)
        shift_at_s = None if stream.shift_at is None else stream.shift_at / 1e6
        plot_timeline(out / "timeline.png", runs, shift_at_s=shift_at_s, n_classes=int(src.model.num_classes),
                      class_names=src.classes)
        atomic_write_json(out / "windows.json", {k: v["windows"] for k, v in runs.items()})
        if isinstance(stream, FileEventStream):  # what the fit cropped and what came too late, in the last replay
            report = {**(report or {}), "fit": stream.fit.describe(), "n_cropped": stream.n_cropped,
                      "n_late": stream.n_late}
            if stream.n_cropped:
                log(f"event file: {stream.n_cropped} event(s) outside the --fit crop (dropped)")
            if stream.n_late:
                log(f"event file: {stream.n_late} event(s) too late for their window (the file is not in time order "
                    "across chunks; dropped)")
        summary = {"settings": cfg.to_dict(), "model_dir": str(src.directory), "source_test_acc": src.test_acc,
                   "shift_at_s": shift_at_s, "n_events": stream.n_events, "validation": report,
                   "runs": {k: v["summary"] for k, v in runs.items()},
                   "wall_seconds": round(time.perf_counter() - t_wall, 2), "status": "completed"}
        atomic_write_json(out / "summary.json", summary)
    log(f"wrote {out / 'summary.json'} and {out / 'timeline.png'} ({summary['wall_seconds']:.1f}s)")
    return summary
