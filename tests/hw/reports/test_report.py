from __future__ import annotations

import json

import pytest
import torch

from szo.hw.cli import main
from szo.hw.reports.hw_report import hw_report, to_markdown


@pytest.fixture(scope="module")
def rep():
    return hw_report("spike_convnet", data="digits", batch=8, k=5)


def test_totals_are_sums_of_layers(rep):
    t, rows = rep["totals"], rep["layers"]
    assert t["weight_bytes"] == sum(r["weight_bytes"] for r in rows)
    assert t["neuron_state_bytes"] == sum(r["neuron_state_bytes"] for r in rows)
    assert t["inference_bytes"] == sum(r["bytes"] for r in rows)
    assert t["synops_per_forward"] == pytest.approx(sum(r["synops_per_sample"] for r in rows))
    assert t["total_bytes"] == t["inference_bytes"] + t["learner_bytes"]
    assert t["learner_bytes"] == sum(rep["learner"].values())


def test_szo_step_is_2k_forwards(rep):
    t = rep["totals"]
    assert t["forwards_per_szo_step"] == 2 * rep["k"] == 10
    assert t["synops_per_szo_step"] == pytest.approx(10 * t["synops_per_forward"])
    assert t["energy_per_szo_step_uj"] == pytest.approx(10 * t["energy_per_forward_uj"])


def test_memory_numbers_match_model(rep):
    rows = {r["layer"]: r for r in rep["layers"]}
    assert rows["conv1"]["weights"] == 16 * 9 and rows["conv1"]["weight_bytes"] == 144 + 1
    assert rows["sn1"]["neurons"] == 16 * 64 and rows["sn1"]["neuron_state_bytes"] == 16 * 64 * 6
    assert rep["learner"]["basis_P_bytes"] == rep["d"] * 5  # int8
    # conv1 sees graded pixels: synops = nonzero pixels x exact fan-out (<= 9 taps x 16 channels)
    assert 0 < rows["conv1"]["synops_per_sample"] <= rows["conv1"]["events_per_sample"] * 9 * 16
    assert rep["totals"]["synops_per_forward"] > 0


def test_cli_writes_markdown_and_json(tmp_path, capsys):
    assert main(["hw-report", "spike_convnet", "--batch", "4", "--k", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hw_report.json").read_text())
    assert data["k"] == 3 and data["model"] == "spike_convnet"
    md = (tmp_path / "hw_report.md").read_text()
    assert "| conv1 |" in md and "23.6" in md
    assert to_markdown(data) == md


def test_bad_target_is_clear(tmp_path):
    with pytest.raises(ValueError, match="neither a registered model"):
        hw_report("no_such_model")
    with pytest.raises(ValueError, match="no config.yaml"):
        hw_report(str(tmp_path))
    with pytest.raises(ValueError, match="valid: \\['random', 'digits', 'test'\\]"):
        hw_report("spike_convnet", data="cifar")


@pytest.mark.parametrize("flags, phrase", [
    (["--core-kb", "0"], "memory per core (KB; Loihi 2: 128) must be a finite number > 0, got 0.0"),
    (["--core-kb", "inf"], "memory per core (KB; Loihi 2: 128) must be a finite number > 0, got inf"),
    (["--core-kb", "nan"], "memory per core (KB; Loihi 2: 128) must be a finite number > 0, got nan"),
    (["--energy-pj", "-1"], "energy per synaptic op (pJ; Loihi: 23.6) must be a finite number > 0, got -1.0"),
    (["--cores", "0"], "cores must be an int >= 1 (Loihi 2: 128), got 0"),
    (["--coord-bits", "0"], "'coord_bits' must be >= 8, got 0"),  # the hw section's ranges (LEARNER_WIDTHS)
    (["--basis-bits", "0"], "'basis_bits' must be >= 2, got 0"),
    (["--ref-bits", "64"], "'ref_bits' must be <= 48, got 64"),
    (["--input-size", "0"], "input_size must be a positive int, got 0"),
])
def test_chip_limits_are_checked_before_any_measurement(flags, phrase, tmp_path, capsys, monkeypatch):
    """--core-kb 0 / inf used to be a traceback after the whole measurement, a negative --energy-pj or
    --coord-bits 0 a report saying "fits: True": now one line, exit 2, nothing measured or written."""
    import szo.hw.reports.hw_report as R

    def measured(*a, **k):
        raise AssertionError("the target was loaded: the limits were not checked first")

    from szo.cli import main as szo

    monkeypatch.setattr(R, "load_target", measured)
    assert szo(["hw-report", "spike_convnet", *flags, "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {phrase}"]
    assert not (tmp_path / "rep").exists()


def test_digits_batch_is_standardised_like_training():
    from szo.data import get_dataset
    from szo.hw.reports.hw_report import input_batch
    from szo.models import create

    x, y = input_batch(create("spike_convnet"), "digits", 16, None, 0, None)
    assert y is not None and y.shape == (16,)
    test = get_dataset("digits", "test")
    pool = torch.stack([test[i][0] for i in range(len(test))])
    assert x.shape == (16, 1, 8, 8) and x.min() < 0  # standardised, not pixel / 16 in [0, 1]
    assert all(any(torch.equal(xi, p) for p in pool) for xi in x)  # samples of the test set as the model saw them
    with pytest.raises(ValueError, match="give a run directory"):
        hw_report("spike_convnet", data="test")


@pytest.fixture(scope="module")
def gesture_run(tmp_path_factory):
    """A run directory of the synthetic-gesture recipe (2 input channels, 11 classes, T = 10, width 16)."""
    from szo.build import build_model
    from szo.config import load_recipe, write_config
    from szo.io import atomic_save_safetensors

    d = tmp_path_factory.mktemp("sg-run")
    cfg = load_recipe("synthetic-gesture", ["data.kwargs.n_per_class=2"])
    write_config(cfg, d / "config.yaml")
    atomic_save_safetensors(d / "model.safetensors", build_model(cfg).state_dict())
    return d


def test_run_directory_rebuilds_the_runs_model(gesture_run):
    rep = hw_report(str(gesture_run), batch=2, k=4)  # random input of the run's data shape
    assert rep["model"] == "spike_convnet" and rep["input_shape"] == [2, 32, 32] and rep["T"] == 10
    rows = {r["layer"]: r for r in rep["layers"]}
    assert rows["conv1"]["weights"] == 16 * 2 * 9 and rows["fc"]["weights"] == 11 * 16 * 16
    assert "model.safetensors" in rep["target"]
    seq = hw_report(str(gesture_run), data="test", batch=3, k=4)  # the run's own test set: event frames
    assert seq["batch"] == 3 and seq["T"] == 10 and seq["input_shape"] == [2, 32, 32]
    assert seq["totals"]["neuron_updates_per_forward"] == sum(r["neurons"] for r in seq["layers"]) * 10
    with pytest.raises(ValueError, match="trained on 'synthetic-gesture', not digits"):
        hw_report(str(gesture_run), data="digits")


def test_report_compares_arithmetics_and_lists_loihi2_features(rep):
    cmp = rep["arithmetics"]
    assert set(cmp["runs"]) == {"szo", "loihi", "loihi, reset=zero"}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in cmp["runs"].values())  # digits batch: labelled
    rows = {r["layer"]: r for r in cmp["layers"]}
    assert rows["sn1"]["quantity"] == "spikes" and rows["conv1"]["quantity"] == "synaptic current"
    # conv1 sees the same input in both: every difference is Lava's floor shift, below 2**-6 of a unit
    assert rows["conv1"]["differ_fraction"] == rows["conv1"]["rounding_only_differ_fraction"]
    assert 0 < rows["conv1"]["rounding_only_max_abs_diff"] < 2 ** -6 + 1e-12
    resets = {r["layer"]: r for r in cmp["reset_layers"]}
    assert set(resets) == {"sn1", "sn2"} and all(0.0 <= r["differ_fraction"] <= 1.0 for r in resets.values())
    feats = {f["feature"]: f for f in rep["loihi2_features"]}
    assert feats["soft reset (v -= threshold)"]["layers"] == ["sn1", "sn2"]
    assert not feats["soft reset (v -= threshold)"]["standard_loihi2_lif"]
    assert not feats["sum pooling into a synapse"]["standard_loihi2_lif"]
    assert feats["BatchNorm"]["layers"] == ["bn1", "bn2"] and "residual add" not in feats
    md = to_markdown(rep)
    assert "| soft reset (v -= threshold) | sn1, sn2 | **no** |" in md and "| loihi, reset=zero |" in md


def test_report_loihi_arithmetic_hard_reset_and_resnet_residual():
    r = hw_report("spike_convnet", data="random", batch=2, k=2, arithmetic="loihi", reset="zero")
    assert (r["arithmetic"], r["reset"]) == ("loihi", "zero")
    assert "soft reset (v -= threshold)" not in {f["feature"] for f in r["loihi2_features"]}
    assert "accuracy" not in r["arithmetics"]["runs"]["szo"]  # random input has no labels
    res = hw_report("spike_resnet20", data="random", batch=1, k=2, input_size=8)
    feats = {f["feature"]: f for f in res["loihi2_features"]}
    assert feats["residual add"]["layers"] and not feats["residual add"]["standard_loihi2_lif"]
    with pytest.raises(ValueError, match="valid: \\['szo', 'loihi'\\]"):
        hw_report("spike_convnet", arithmetic="lava")
    with pytest.raises(ValueError, match="unknown reset"):
        hw_report("spike_convnet", reset="hard")


def test_cli_arithmetic_and_reset(tmp_path, capsys):
    assert main(["hw-report", "spike_convnet", "--batch", "2", "--k", "2", "--arithmetic", "loihi",
                 "--reset", "zero", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hw_report.json").read_text())
    assert (data["arithmetic"], data["reset"]) == ("loihi", "zero")
    with pytest.raises(SystemExit):
        main(["hw-report", "spike_convnet", "--arithmetic", "lava"])
    assert "invalid choice: 'lava'" in capsys.readouterr().err


def test_report_of_a_converted_network_keeps_its_arithmetic():
    from szo.hw import to_fixed
    from szo.models import create

    net = to_fixed(create("spike_convnet"), arithmetic="loihi")
    r = hw_report(net, batch=2, k=2, arithmetic="loihi")
    assert r["arithmetic"] == "loihi" and r["arithmetics"] is None
    assert "## What a standard Loihi 2 LIF process runs as is" in to_markdown(r)
    with pytest.raises(ValueError, match="converted with arithmetic='loihi'"):
        hw_report(net, batch=2, k=2)


def test_report_names_a_model_lava_cannot_hold_and_still_reports_szo():
    from szo.models import create

    m = create("spike_convnet")
    m.sn1.tau = 1.0  # full voltage leak: dv = 4096 does not fit Lava's 12-bit register
    r = hw_report(m, data="digits", batch=4, k=2)
    runs = r["arithmetics"]["runs"]
    assert "accuracy" in runs["szo"] and "tau > 1" in runs["loihi"]["error"] and r["arithmetics"]["layers"] == []
    feats = {f["feature"]: f for f in r["loihi2_features"]}
    assert feats["neuron parameters outside Lava's registers"]["layers"][0].startswith("sn1: ")
    assert "not convertible" in to_markdown(r)
