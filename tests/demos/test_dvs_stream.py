"""dvs-stream demo: end to end on a tiny stream, FILE validation, carried state, probe isolation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from szo.demos import dvs_stream as ds
from szo.demos.cli import main

TINY = ds.SourceSettings(width=4, T=10, duration_us=100_000, n_train_per_class=1, n_test_per_class=1,
                         epochs=3, batch_size=16, record_every_steps=1, k=2, seed=0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("dvs") / "source"
    return ds.train_source_model(d, TINY, progress=False, log=lambda s: None)


def test_source_model_cached_and_reloaded(source):
    msgs = []
    again = ds.train_source_model(source.directory, TINY, progress=False, log=msgs.append)
    assert msgs and "reusing" in msgs[0]
    for a, b in zip(source.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    assert again.subspace.basis.shape == (source.model.num_params(), 2)
    assert source.bin_us == 10_000


def test_end_to_end_synthetic_writes_png_and_json(source, tmp_path):
    out = tmp_path / "run"
    ds.run_demo(out, model_dir=str(source.directory), n_gestures=4, shift={"noise_rate_hz": 20.0},
                    stream=ds.StreamSettings(window_ms=20, adapt="szo-cge", lr=0.05, mu=0.5),
                    print_every=0, log=lambda m: None)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "summary.json").read_text())
    assert set(on_disk["runs"]) == {"szo-cge", "none"}
    for run in on_disk["runs"].values():
        assert run["n_windows"] == 20 and run["bins_per_window"] == 2
        assert run["real_time_factor"] > 0
        assert run["accuracy_after_shift"] is not None
    assert on_disk["runs"]["szo-cge"]["forward_passes_adapt"] == 20 * 2 * 2  # 2k probes per window
    assert on_disk["runs"]["none"]["forward_passes_adapt"] == 0
    assert on_disk["shift_at_s"] == pytest.approx(0.2)


def test_cli_file_source_drops_malformed_events(source, tmp_path, capsys):
    rng = np.random.default_rng(0)
    from szo.data.synthetic_events import stream

    events, segments = stream([0, 3], segment_us=100_000, rng=rng)
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
    rc = main(["dvs-stream", "--source", str(tmp_path / "ev.npy"), "--labels-file", str(tmp_path / "seg.npy"),
               "--model", str(source.directory), "--adapt", "szo-rge", "--q", "1", "--labels",
               "--window-ms", "50", "--out", str(tmp_path / "out"), "--print-every", "1"])
    assert rc == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["validation"]["n_dropped"] == 5 and s["validation"]["n_out"] == len(events) + 1
    assert s["validation"]["n_unsorted"] >= 1
    assert s["runs"]["szo-rge+labels"]["n_windows"] == 4
    assert "dropped 5 malformed" in capsys.readouterr().out


def test_bad_inputs_give_one_clear_error(source, tmp_path):
    with pytest.raises(ValueError, match="multiple of the model's frame length"):
        ds.run_demo(tmp_path, model_dir=str(source.directory), n_gestures=1, print_every=0,
                    stream=ds.StreamSettings(window_ms=15, adapt="none"), log=lambda m: None)
    with pytest.raises(ValueError, match="adapt must be one of"):
        ds.StreamSettings(adapt="tent")
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="cannot read"):
        ds.load_event_file(tmp_path / "x.npy", (32, 32, 2))
    with pytest.raises(ValueError, match="neither a dvs-stream source"):
        ds.load_source_model(tmp_path)


def _windows(n: int, bins: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(bins, 1, 2, 32, 32, generator=g) < 0.3).float() * 20 for _ in range(n)]


def test_windows_one_by_one_equal_concatenation(source):
    model = source.fresh_model()
    ws = _windows(3)
    with torch.no_grad():
        with model.persistent_state():
            parts = [model(w) for w in ws]
        whole = model(torch.cat(ws))
        # without carried state the second window differs: the check above is not vacuous
        fresh = model(ws[1])
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-5)
    assert not torch.allclose(fresh, parts[1])


@pytest.mark.parametrize("buffer", [1, 2])
def test_probes_start_from_saved_state_and_leave_it(source, buffer):
    model = source.fresh_model()
    clf = ds.OnlineClassifier(model, source.subspace,
                              ds.StreamSettings(adapt="szo-cge", lr=0.5, mu=0.5, buffer=buffer))
    lif = [m for m in model.modules() if isinstance(m, ds.MemoryModule)][0]
    seen: list[torch.Tensor] = []
    ws = [w[:, 0] for w in _windows(3)]
    with model.persistent_state():
        clf.classify(ws[0])
        b0 = ds.snapshot_state(model)
        clf.classify(ws[1])
        clf.adapt(ws[1], b0, label=None)
        b1 = ds.snapshot_state(model)
        clf.classify(ws[2])
        after = ds.snapshot_state(model)
        theta = model.flat_params()
        h = lif.register_forward_pre_hook(lambda m, a: seen.append(torch.as_tensor(m.v).clone()))
        clf.adapt(ws[2], b1, label=None)
        h.remove()
        now = ds.snapshot_state(model)
    assert len(seen) == 2 * 2  # 2k probes
    expect = b1[0]["v"] if buffer == 1 else torch.cat([b0[0]["v"], b1[0]["v"]])
    for v in seen:  # every probe started each buffered window from the state saved before it
        torch.testing.assert_close(v, expect, rtol=0, atol=0)
    for a, b in zip(after, now):  # and the stream's state is untouched by the probes
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
    assert not torch.equal(model.flat_params(), theta)  # the step moved the weights


def test_model_dir_can_be_a_recipe_run(source, tmp_path):
    import shutil

    import yaml

    from subspace_store import SubspaceStore

    run = tmp_path / "recipe-run"
    run.mkdir()
    shutil.copy(source.directory / "model.safetensors", run / "model.safetensors")
    SubspaceStore(tmp_path / "store").save("tiny", source.subspace)
    cfg = {"name": "synthetic-gesture", "kind": "bp",
           "model": {"name": "spike_convnet", "T": 10, "activation": "lif", "kwargs": {"width": 4}},
           "data": {"name": "synthetic-gesture", "kwargs": {"T": 10, "duration_us": 100_000}},
           "subspace": {"name": "tiny", "root": str(tmp_path / "store")}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    loaded = ds.load_source_model(run)
    assert loaded.bin_us == source.bin_us
    torch.testing.assert_close(loaded.subspace.basis, source.subspace.basis)
    assert torch.equal(loaded.fresh_model().flat_params(), source.model.flat_params())
    cfg["data"]["name"] = "digits"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="synthetic-gesture"):
        ds.load_source_model(run)


def test_source_dir_whose_weights_do_not_fit_is_one_clear_error(source, tmp_path):
    import shutil

    d = tmp_path / "src"
    shutil.copytree(source.directory, d)
    meta = json.loads((d / "source.json").read_text())
    meta["model_kwargs"]["width"] = 8
    (d / "source.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="model.safetensors does not fit spike_convnet"):
        ds.load_source_model(d)


def test_exported_nir_model_runs_the_stream_like_the_source(source, tmp_path, capsys):
    pytest.importorskip("nir")
    from szo.cli import main as szo_main

    nir_path = tmp_path / "source.nir"
    assert szo_main(["export", str(source.directory), "--to", "nir", str(nir_path)]) == 0
    runs = {}
    for name, model in (("torch", str(source.directory)), ("nir", str(nir_path))):
        out = tmp_path / name
        ds.run_demo(out, model_dir=model, n_gestures=3, stream=ds.StreamSettings(window_ms=20, adapt="none"),
                    print_every=0, log=lambda m: None)
        recs = json.loads((out / "windows.json").read_text())["none"]
        runs[name] = [(r["window"], r["label"], r["pred"]) for r in recs]  # (timings differ)
    assert len(runs["nir"]) == 15
    assert runs["nir"] == runs["torch"]  # same windows, same predictions (BN folded: same spikes)
    with pytest.raises(ValueError, match="--adapt none"):
        ds.run_demo(tmp_path / "x", model_dir=str(nir_path), n_gestures=1, print_every=0, log=lambda m: None,
                    stream=ds.StreamSettings(window_ms=20, adapt="szo-cge"))


def test_timeline_names_classes_and_keeps_legends_off_the_data(tmp_path, figures):
    from szo.data.synthetic_events import CLASSES

    lab = [0] * 5 + [3] * 5 + [10] * 5
    windows = [{"t_ms": 20.0 * i, "label": c, "pred": c, "running_acc": 1.0} for i, c in enumerate(lab)]
    ds.plot_timeline(tmp_path / "t.png", {"szo-cge": {"windows": windows}, "none": {"windows": windows}},
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
    ds.plot_timeline(tmp_path / "u.png", {"none": {"windows": windows}}, shift_at_s=None, n_classes=12,
                     class_names=CLASSES)
    assert [t.get_text() for t in figures[1].axes[0].get_yticklabels()] == [str(i) for i in range(12)]
