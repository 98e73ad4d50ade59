"""szo.adapt.runner / tables: reset vs continual over corruptions, tables, counts, errors."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from szo.adapt import METHODS, resolve_methods, resolve_settings, run_tta
from szo.adapt.stage import tta_stage
from szo.adapt.tables import corruption_table, summary_table
from szo.config import validate

from .test_methods import random_subspace, state, tiny_model

CORR = ["gaussian_noise", "fog", "jpeg_compression"]


def fake_data(c: str) -> TensorDataset:
    """A small labelled test set per corruption, each shifted differently (a domain shift)."""
    i = CORR.index(c)
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(12, 1, 8, 8, generator=g) * (1.0 + i) + 0.5 * i
    y = torch.randint(0, 10, (12,), generator=g)
    return TensorDataset(x, y)


def run(tmp_path, methods, settings, **kw):
    model = tiny_model()
    kw.setdefault("batch_size", 6)
    kw.setdefault("tent_lr", 0.05)
    kw.setdefault("corruptions", CORR)
    kw.setdefault("scale", "absolute")  # App. G's units: the random subspace has no spread to scale by
    return model, run_tta(model, random_subspace(model), "digits-c", methods, settings, out_dir=tmp_path,
                          get_data=fake_data, progress=False, q=2, seed=3, plot=kw.pop("plot", False), **kw)


def test_run_tta_tables_counts_and_source_untouched(tmp_path):
    model, res = run(tmp_path, "all", "both", plot=True)
    src = state(tiny_model())
    assert all(torch.equal(v, src[k]) for k, v in state(model).items())  # the source model is never adapted
    assert res["methods"] == list(METHODS) and res["settings"] == ["reset", "continual"]
    k, q = 3, 2
    for setting in ("reset", "continual"):
        for m in METHODS:
            r = res["results"][setting][m]
            assert list(r["per_corruption"]) == CORR
            assert r["average"] == pytest.approx(sum(r["per_corruption"].values()) / 3)
            assert r["batches"] == 3 * 2  # 12 samples / batch 6, three corruptions
            fpb = {"none": 1, "bn": 1, "tent": 1, "bp-subspace": 1, "szo-cge": 2 * k + 1, "szo-rge": 2 * q + 1}[m]
            assert (r["fp"], r["bp"]) == (fpb * 6, (6 if m in ("tent", "bp-subspace") else 0))
    # none / bn do not depend on the setting; both settings report the same numbers
    for m in ("none", "bn"):
        assert res["results"]["continual"][m]["per_corruption"] == res["results"]["reset"][m]["per_corruption"]
    # files
    for name in ("tta_results.json", "tta_table_reset.md", "tta_table_continual.md", "tta_summary.md",
                 "tta_accuracy.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "tta_results.json").read_text())["results"]["reset"]["szo-cge"]["fp"] == 7 * 6
    table = (tmp_path / "tta_table_reset.md").read_text()
    assert "| Method | BP | Gauss. | Fog | JPEG | Average Acc. |" in table
    assert "| Tent (BP) | ✓ |" in table and "| SZO-RGE (q=2) | X |" in table


def test_reset_setting_equals_fresh_runs_per_corruption(tmp_path):
    """Reset: each corruption's accuracy equals a run on that corruption alone from the source."""
    _, res = run(tmp_path / "all", ["tent", "szo-cge"], "reset", lr_reset=2.0, tent_lr=0.2)
    for c in CORR:
        _, alone = run(tmp_path / c, ["tent", "szo-cge"], "reset", corruptions=[c], lr_reset=2.0, tent_lr=0.2)
        for m in ("tent", "szo-cge"):
            assert alone["results"]["reset"][m]["per_corruption"][c] == res["results"]["reset"][m]["per_corruption"][c]


def test_reset_is_called_per_corruption_in_reset_and_never_in_continual(tmp_path, monkeypatch):
    from szo.adapt import methods

    calls: list[str] = []
    orig = methods.Adapter.reset

    def counting_reset(self):
        calls.append(self.method)
        orig(self)

    monkeypatch.setattr(methods.Adapter, "reset", counting_reset)
    _, res = run(tmp_path / "r", ["tent", "szo-cge"], "reset")
    assert calls == ["tent"] * (len(CORR) - 1) + ["szo-cge"] * (len(CORR) - 1)
    calls.clear()
    _, res_c = run(tmp_path / "c", ["tent", "szo-cge"], "continual")
    assert calls == []
    for m in ("tent", "szo-cge"):  # same start, same first corruption, same batches
        assert res["results"]["reset"][m]["per_corruption"][CORR[0]] == \
            res_c["results"]["continual"][m]["per_corruption"][CORR[0]]


def test_tables_render_paper_layout():
    res = {
        "dataset": "digits-c", "model": "spike_convnet", "severity": 5, "corruptions": CORR,
        "methods": ["none", "szo-cge"], "settings": ["reset"], "config": {"q": 10},
        "results": {"reset": {
            "none": {"per_corruption": {"gaussian_noise": 0.1, "fog": 0.5, "jpeg_compression": 0.75},
                     "average": 0.45, "fp": 3, "bp": 0, "fp_per_batch": 1, "bp_per_batch": 0},
            "szo-cge": {"per_corruption": {"gaussian_noise": 0.2, "fog": 0.6, "jpeg_compression": 0.8},
                        "average": 0.5333333, "fp": 63, "bp": 0, "fp_per_batch": 21, "bp_per_batch": 0}}},
    }
    t = corruption_table(res, "reset")
    assert "| No adapt. | X | 10.00 | 50.00 | 75.00 | 45.00 |" in t
    assert "| SZO-CGE | X | 20.00 | 60.00 | 80.00 | 53.33 |" in t
    s = summary_table(res)
    assert "| Reset | digits-c | spike_convnet | 45.00 | 53.33 |" in s
    assert "| SZO-CGE | 21 | 0 | 63 | 0 |" in s
    with pytest.raises(ValueError, match="valid: reset"):
        corruption_table(res, "continual")


def test_bad_method_and_setting_names(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'szo'; valid: all, none, bn, tent, bp-subspace, szo-cge, szo-rge"):
        resolve_methods("szo")
    with pytest.raises(ValueError, match="unknown setting 'episodic'; valid: both, reset, continual"):
        resolve_settings("episodic")
    assert resolve_methods("szo-cge,none") == ["none", "szo-cge"]
    assert resolve_settings("both") == ["reset", "continual"]
    with pytest.raises(ValueError, match="unknown setting"):
        run(tmp_path, "bn", "online")
    with pytest.raises(ValueError, match="need an adaptation subspace"):
        run_tta(tiny_model(), None, "digits-c", "szo-rge", "reset", batch_size=4, out_dir=tmp_path,
                corruptions=CORR, get_data=fake_data, progress=False)
    with pytest.raises(ValueError, match="unknown key 'tta.lr'; valid keys under 'tta': data, kwargs, source_run"):
        validate({"name": "x", "kind": "tta", "tta": {"lr": 1.0}})


def test_recipe_without_source_gives_clear_error(tmp_path):
    cfg = {"name": "x", "kind": "tta", "method": "bn", "setting": "reset", "model": {"name": "spike_convnet"},
           "tta": {"data": "digits-c"}}
    with pytest.raises(ValueError, match="tta.source_run=RUN_DIR .* or tta.train_source=true"):
        tta_stage(cfg, tmp_path, "cpu")
    with pytest.raises(ValueError, match="unknown method 'tent2'"):
        tta_stage(dict(cfg, method="tent2"), tmp_path, "cpu")


def test_event_sequences_reach_the_model_time_major(tmp_path):
    """Sequence items [T, C, H, W] are batched [T, N, C, H, W] (szo.data.make_loader), as the models take them."""
    from szo.models import create

    model = create("spike_convnet", num_classes=11, T=3, in_channels=2, width=4)
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    g = torch.Generator().manual_seed(0)
    seq = TensorDataset(torch.rand(5, 3, 2, 8, 8, generator=g), torch.randint(0, 11, (5,), generator=g))
    res = run_tta(model, None, "dvs-gesture", "none", "reset", batch_size=4, out_dir=tmp_path,
                  corruptions=["gaussian_noise"], get_data=lambda c: seq, progress=False, plot=False)
    assert seen == [(3, 4, 2, 8, 8), (3, 1, 2, 8, 8)]
    assert res["results"]["reset"]["none"]["samples"] == {"gaussian_noise": 5}
