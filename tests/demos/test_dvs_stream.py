"""dvs-stream demo: the source model through the BPTT stage, the run contract (lock, config.yaml,
refusal, resume), FILE validation, carried state, probe isolation, NIR models, the timeline."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from spikingjelly.activation_based.base import MemoryModule

from szo.demos import dvs_stream as ds
from szo.demos.cli import main
from szo.demos.online import OnlineClassifier, plot_timeline, snapshot_state
from szo.demos.settings import StreamConfig, resumed_settings
from szo.rundir import ResumeMismatchError

# a tiny synthetic-gesture source: 11 train samples (one step per epoch), 100 ms gestures of 10 frames
TINY = ["model.kwargs={width: 4}", "data.kwargs={T: 10, n_per_class: 1, duration_us: 100000}", "bptt.epochs=3",
        "trajectory.every=1", "subspace.k=2", "data.test_batch_size=11", "progress=false"]
QUIET = dict(print_every=0, log=lambda m: None)


def _settings(**kw) -> StreamConfig:
    return StreamConfig(**{"overrides": TINY, "gestures": 4, "window_ms": 20, "shift": {"noise_rate_hz": 20.0},
                              "lr": 0.05, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dvs") / "run"
    torch.manual_seed(1234)  # the tests that resume set another global seed: results come from generators only
    return out, ds.run_demo(out, _settings(), **QUIET)


@pytest.fixture(scope="module")
def source(run):
    return ds.load_source_model(run[0] / "source")


def _windows(out, fields=("label", "pred", "loss")):
    recs = json.loads((out / "windows.json").read_text())
    return {k: [tuple(r[f] for f in fields) for r in v] for k, v in recs.items()}


def test_end_to_end_trains_the_source_through_the_stage(run, source):
    out, summary = run
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["status"] == "completed" and on_disk == json.loads(json.dumps(summary))
    assert set(on_disk["runs"]) == {"szo-cge+labels", "none"}  # synthetic stream: the labels loss (auto)
    for r in on_disk["runs"].values():
        assert r["n_windows"] == 20 and r["bins_per_window"] == 2 and r["real_time_factor"] > 0
        assert r["accuracy_after_shift"] is not None
    assert on_disk["runs"]["szo-cge+labels"]["forward_passes_adapt"] == 20 * 2 * 2  # 2k probes per window
    assert on_disk["runs"]["none"]["forward_passes_adapt"] == 0
    assert on_disk["shift_at_s"] == pytest.approx(0.2)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["demo"] == "dvs-stream" and cfg["loss"] == "labels" and cfg["lr"] == 0.05 and cfg["overrides"] == TINY
    # the source is a synthetic-gesture recipe run: config.yaml, checksummed checkpoint, trajectory, subspace
    src = out / "source"
    assert yaml.safe_load((src / "config.yaml").read_text())["name"] == "synthetic-gesture"
    assert (src / "checkpoints" / "last.json").is_file() and (src / "trajectory" / "manifest.json").is_file()
    assert json.loads((src / "results.json").read_text())["status"] == "completed"
    assert source.bin_us == 10_000 and source.sensor_size == (32, 32, 2) and len(source.classes) == 11
    assert source.model.num_classes == 11 and source.subspace.basis.shape == (source.model.num_params(), 2)


def test_a_second_run_is_refused_and_resume_replays_the_same(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    with pytest.raises(ValueError, match="already holds a dvs-stream run; pass --resume"):
        ds.run_demo(out, _settings(), **QUIET)
    with pytest.raises(ResumeMismatchError, match="adapt is 'szo-cge' in its config.yaml but 'szo-rge' now"):
        ds.run_demo(out, resumed_settings(out, {"adapt": "szo-rge"}), resume=True, **QUIET)
    metrics = (out / "source" / "metrics.jsonl").read_text()
    torch.manual_seed(99)
    ds.run_demo(out, resumed_settings(out, {}), resume=True, **QUIET)
    assert _windows(out) == _windows(run[0])  # same predictions and SZO losses
    assert (out / "source" / "metrics.jsonl").read_text() == metrics  # the finished source is not trained again


def test_resume_finishes_a_source_stopped_after_its_last_checkpoint(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    for f in ("model.safetensors", "model.json"):  # killed before the model and the subspace were written
        (out / "source" / f).unlink()
    shutil.rmtree(out / "subspaces")
    (out / "summary.json").unlink()
    torch.manual_seed(7)
    assert main(["dvs-stream", "--out", str(out), "--resume", "--print-every", "0"]) == 0
    assert _windows(out) == _windows(run[0])
    a, b = ds.load_source_model(out / "source"), ds.load_source_model(run[0] / "source")
    assert torch.equal(a.model.flat_params(), b.model.flat_params()) and torch.equal(a.subspace.basis, b.subspace.basis)


def test_cli_file_source_refuses_events_outside_the_sensor_then_drops_malformed_ones(run, tmp_path, capsys):
    """Events outside the sensor are refused in one line before anything is written, so the same command
    with a corrected file runs in the same --out; bad t / polarity are dropped and counted, disorder sorted."""
    from szo.data.synthetic_events import stream

    events, segments = stream([0, 3], segment_us=100_000, rng=np.random.default_rng(0))
    bad = np.zeros(6, dtype=[("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)])
    bad["x"] = [40, -1, 3, 3, 3, 3]  # two outside the 32x32 sensor
    bad["y"] = 5
    bad["t"] = [1000, 2000, -5, 3000, 4000, 10]  # one negative t; the last (valid) one is out of order
    bad["p"] = [1, 1, 1, 2, 7, 1]  # two bad polarities
    mixed = np.empty(len(events) + 6, dtype=bad.dtype)
    for f in ("x", "y", "t", "p"):
        mixed[f] = np.concatenate([events[f].astype(bad.dtype[f]), bad[f]])  # appended: also unsorted
    np.save(tmp_path / "ev.npy", mixed)
    np.save(tmp_path / "seg.npy", segments)
    argv = ["dvs-stream", "--source", str(tmp_path / "ev.npy"), "--labels-file", str(tmp_path / "seg.npy"),
            "--model", str(run[0] / "source"), "--adapt", "szo-rge", "--q", "1", "--labels",
            "--window-ms", "50", "--out", str(tmp_path / "out"), "--print-every", "1"]
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "2 of %d events lie outside the 32x32 sensor (x up to 40, y up to 31)" % len(mixed) in err
    assert err.count("\n") == 1 and not (tmp_path / "out" / "config.yaml").exists()
    mixed["x"][-6:-4] = 3  # corrected: the same command in the same --out now runs
    np.save(tmp_path / "ev.npy", mixed)
    assert main(argv) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["validation"]["n_dropped"] == 3 and s["validation"]["n_out"] == len(events) + 3
    assert s["validation"]["n_out_of_sensor"] == 0 and s["validation"]["n_unsorted"] >= 1
    assert s["runs"]["szo-rge+labels"]["n_windows"] == 4
    assert "dropped 3 malformed" in capsys.readouterr().out


def test_nmnist_recording_on_the_gesture_model_is_refused_then_fitted(run, tmp_path, capsys):
    """The real 34x34 N-MNIST recording on the 32x32 gesture model: one line naming both sizes and --fit, no
    config.yaml left behind; then the same --out runs with --fit, every event accounted for."""
    from pathlib import Path
    recording = Path(__file__).parents[1] / "data" / "nmnist" / "sample_nmnist.bin"
    argv = ["dvs-stream", "--source", str(recording), "--model", str(run[0] / "source"), "--adapt", "none",
            "--window-ms", "50", "--out", str(tmp_path / "out"), "--print-every", "0"]
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a 34x34 sensor but the model takes 32x32 input; pass --fit crop" in err
    assert not (tmp_path / "out" / "config.yaml").exists()
    for mode, kept in (("crop", 4325 - 14), ("downsample", 4325)):
        out = tmp_path / mode
        assert main([*argv[:-4], "--out", str(out), "--print-every", "0", "--fit", mode]) == 0
        s = json.loads((out / "summary.json").read_text())
        assert s["n_events"] == 4325 and s["validation"]["n_cropped"] == 4325 - kept
        assert s["validation"]["fit"].startswith("34x34 -> ") and s["runs"]["none"]["n_windows"] == 7
        assert yaml.safe_load((out / "config.yaml").read_text())["fit"] == mode


def test_file_inputs_the_model_cannot_take_leave_no_config(run, tmp_path):
    """Labels outside the model's classes, a file with no valid event, an unknown format: each one line
    before config.yaml, so --out stays reusable."""
    ev = np.zeros(3, dtype=[("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)])
    ev["t"] = [100, 200, 300]
    np.save(tmp_path / "ev.npy", ev)
    seg = np.array([(0, 50_000, 11)], dtype=[("start_us", np.int64), ("end_us", np.int64), ("label", np.int64)])
    np.save(tmp_path / "seg.npy", seg)
    out, model = tmp_path / "out", str(run[0] / "source")
    with pytest.raises(ValueError, match=r"holds label\(s\) \[11\] but the model has 11 classes \(0..10\)"):
        ds.run_demo(out, StreamConfig(source=str(tmp_path / "ev.npy"), labels_file=str(tmp_path / "seg.npy"),
                                      model=model, adapt="none"), **QUIET)
    ev["t"] = -1  # no valid event: no window
    np.save(tmp_path / "ev.npy", ev)
    with pytest.raises(ValueError, match="holds no complete window"):
        ds.run_demo(out, StreamConfig(source=str(tmp_path / "ev.npy"), model=model, adapt="none"), **QUIET)
    (tmp_path / "rec.mat").write_bytes(b"MATLAB")
    with pytest.raises(ValueError, match="unsupported event file format '.mat'; supported: .npy"):
        ds.run_demo(out, StreamConfig(source=str(tmp_path / "rec.mat"), model=model, adapt="none"), **QUIET)
    assert not (out / "config.yaml").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(adapt="tent"), "invalid adapt 'tent'; valid: szo-cge, szo-rge, none"),
    (dict(lr=-1.0), "'lr' must be >= 0.0"),
    (dict(q=0), "'q' must be >= 1"),
    (dict(momentum=1.0), "'momentum' must be < 1.0"),
    (dict(shift={"blur": 1.0}), "unknown shift key"),
    (dict(labels_file="seg.npy"), "labels_file is only for a FILE source"),
    (dict(source="ev.npy", loss="labels"), "needs a labelled stream"),
    (dict(model="somewhere", overrides=["bptt.epochs=2"]), "not for a given model"),
])
def test_bad_settings_are_one_line_each(kw, match):
    with pytest.raises(ValueError, match=match):
        StreamConfig(**kw)


def test_bad_inputs_are_refused_before_config_and_training(run, tmp_path):
    out = tmp_path / "x"
    with pytest.raises(ValueError, match="multiple of the model's frame length"):
        ds.run_demo(out, _settings(window_ms=15), **QUIET)
    with pytest.raises(ValueError, match="needs a BPTT run on synthetic-gesture"):
        ds.run_demo(out, _settings(recipe="digits-bp", overrides=["progress=false"]), **QUIET)
    with pytest.raises(ValueError, match="event file .* does not exist"):
        ds.run_demo(out, _settings(source=str(tmp_path / "none.npy"), shift={}), **QUIET)
    assert not out.exists()  # nothing to resume or refuse: a run refused before its first step leaves no directory
    (out / "source").mkdir(parents=True)
    (out / "source" / "source.json").write_text("{}")  # an earlier szo's source directory: not continued
    with pytest.raises(ValueError, match="source model of an earlier szo"):
        ds.run_demo(out, _settings(), **QUIET)
    with pytest.raises(ValueError, match="neither a finished recipe run"):
        ds.load_source_model(tmp_path)
    with pytest.raises(ValueError, match="not a dvs-stream demo's config"):
        resumed_settings(run[0] / "source", {})
    d = tmp_path / "digits-run"
    shutil.copytree(run[0] / "source", d)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["data"]["name"] = "digits"
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="synthetic-gesture"):
        ds.load_source_model(d)


def _frames(n: int, bins: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(bins, 1, 2, 32, 32, generator=g) < 0.3).float() * 20 for _ in range(n)]


def test_windows_one_by_one_equal_concatenation(source):
    model = source.fresh_model()
    ws = _frames(3)
    with torch.no_grad():
        with model.persistent_state():
            parts = [model(w) for w in ws]
        whole = model(torch.cat(ws))
        fresh = model(ws[1])  # without carried state the second window differs: the check is not vacuous
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-5)
    assert not torch.allclose(fresh, parts[1])


@pytest.mark.parametrize("buffer", [1, 2])
def test_probes_start_from_saved_state_and_leave_it(source, buffer):
    model = source.fresh_model()
    clf = OnlineClassifier(model, source.subspace, StreamConfig(loss="entropy", lr=0.5, mu=0.5, buffer=buffer))
    lif = [m for m in model.modules() if isinstance(m, MemoryModule)][0]
    seen: list[torch.Tensor] = []
    ws = [w[:, 0] for w in _frames(3)]
    with model.persistent_state():
        clf.classify(ws[0])
        b0 = snapshot_state(model)
        clf.classify(ws[1])
        clf.adapt(ws[1], b0, label=-1)
        b1 = snapshot_state(model)
        clf.classify(ws[2])
        after = snapshot_state(model)
        theta = model.flat_params()
        h = lif.register_forward_pre_hook(lambda m, a: seen.append(torch.as_tensor(m.v).clone()))
        clf.adapt(ws[2], b1, label=-1)
        h.remove()
        now = snapshot_state(model)
    assert len(seen) == 2 * 2  # 2k probes
    expect = b1[0]["v"] if buffer == 1 else torch.cat([b0[0]["v"], b1[0]["v"]])
    for v in seen:  # every probe started each buffered window from the state saved before it
        torch.testing.assert_close(v, expect, rtol=0, atol=0)
    for a, b in zip(after, now):  # and the stream's state is untouched by the probes
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
    assert not torch.equal(model.flat_params(), theta)  # the step moved the weights


def test_exported_nir_model_runs_the_stream_like_the_source(run, tmp_path):
    pytest.importorskip("nir")
    from szo.cli import main as szo_main

    nir_path = tmp_path / "source.nir"
    assert szo_main(["export", str(run[0] / "source"), "--to", "nir", str(nir_path)]) == 0
    runs = {}
    for name, model in (("torch", str(run[0] / "source")), ("nir", str(nir_path))):
        ds.run_demo(tmp_path / name, StreamConfig(model=model, gestures=3, window_ms=20, adapt="none"), **QUIET)
        runs[name] = _windows(tmp_path / name, ("window", "label", "pred"))["none"]  # (timings differ)
    assert len(runs["nir"]) == 15
    assert runs["nir"] == runs["torch"]  # same windows, same predictions (BN folded: same spikes)
    with pytest.raises(ValueError, match="--adapt none"):
        ds.run_demo(tmp_path / "x", StreamConfig(model=str(nir_path), window_ms=20), **QUIET)


def test_timeline_names_classes_and_keeps_legends_off_the_data(tmp_path, figures):
    from szo.data.synthetic_events import CLASSES

    lab = [0] * 5 + [3] * 5 + [10] * 5
    windows = [{"t_ms": 20.0 * i, "label": c, "pred": c, "running_acc": 1.0} for i, c in enumerate(lab)]
    plot_timeline(tmp_path / "t.png", {"szo-cge": {"windows": windows}, "none": {"windows": windows}},
                  shift_at_s=0.15, n_classes=11, class_names=CLASSES)
    (fig,) = figures
    top, bottom = fig.axes
    assert [t.get_text() for t in top.get_yticklabels()] == list(CLASSES)
    r = fig.canvas.get_renderer()
    for ax in (top, bottom):
        leg = ax.get_legend()
        assert leg.get_window_extent(r).x0 >= ax.get_window_extent(r).x1  # right of the panel, not over it
    texts = [t.get_text() for t in top.get_legend().get_texts()]
    assert texts == ["true class", "predicted (SZO-CGE)", "predicted (No adapt.)", "domain shift"]  # registry labels
    # a model whose classes are not the named ones keeps numbers
    plot_timeline(tmp_path / "u.png", {"none": {"windows": windows}}, shift_at_s=None, n_classes=12, class_names=CLASSES)
    assert [t.get_text() for t in figures[1].axes[0].get_yticklabels()] == [str(i) for i in range(12)]
