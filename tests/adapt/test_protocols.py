"""Adaptation-subspace protocols (paper / train / loco) and run_tta with one subspace per corruption."""
from __future__ import annotations

import json

import pytest
import torch

from szo.adapt import run_tta
from szo.adapt.subspace import LABEL_LEAK, finetune_dataset
from szo.config import validate
from szo.data import CORRUPTIONS

from .test_methods import random_subspace, tiny_model
from .test_runner import CORR, fake_data


# --------------------------------------------------------------------------- resolution and errors
def _cfg(**tta):
    return {"name": "t", "kind": "tta", "method": "all", "setting": "both", "tta": tta}


def resolve_tta(cfg):
    """The kind: tta config through the one schema (szo.config)."""
    return validate({"name": "t", "kind": "tta", **cfg})


def test_protocol_resolution_and_errors():
    assert resolve_tta(_cfg())["tta"]["protocol"] == "train"  # the default: honest, as before
    assert resolve_tta(_cfg())["tta"]["finetune"]["images"] is None
    for p in ("paper", "train", "loco"):
        assert resolve_tta(_cfg(protocol=p))["tta"]["protocol"] == p
    with pytest.raises(ValueError, match="invalid tta.protocol 'honest'; valid: paper, train, loco"):
        resolve_tta(_cfg(protocol="honest"))
    with pytest.raises(ValueError, match="'tta.finetune.images' must be >= 1, got 0"):
        resolve_tta(_cfg(finetune={"images": 0}))
    with pytest.raises(ValueError, match="loco .* reset setting only.*use setting=reset"):
        resolve_tta({**_cfg(protocol="loco"), "setting": "continual"})
    with pytest.raises(ValueError, match="loco .* cannot use one given tta.finetune.trajectory"):
        resolve_tta(_cfg(protocol="loco", finetune={"trajectory": "somewhere"}))
    with pytest.raises(ValueError, match="loco .* cannot use one subspace store entry subspace.name"):
        resolve_tta({**_cfg(protocol="loco"), "subspace": {"name": "adapt"}})
    # without a subspace method the protocol builds nothing: continual is fine
    assert resolve_tta({"method": "none,tent", "setting": "continual", "tta": {"protocol": "loco"}})


def test_finetune_data_of_each_protocol(tmp_path):
    kw = {"cache_dir": str(tmp_path), "limit": 40}
    paper, d = finetune_dataset("mnist5k-c", "paper", "gaussian_noise", 5, images=6, dataset_kwargs=kw)
    assert len(paper) == 6 and d["finetune_split"] == "test" and d["label_leak"] is True
    test_images = torch.stack([paper[i][0] for i in range(6)])
    import szo.data as D

    assert torch.equal(test_images, D.get_dataset("mnist5k-c", "test", corruption="gaussian_noise", **kw).images[:6])
    train, d = finetune_dataset("mnist5k-c", "train", "gaussian_noise", 5, images=6, dataset_kwargs=kw)
    assert len(train) == 6 and d["finetune_split"] == "train" and d["label_leak"] is False
    assert not torch.equal(torch.stack([train[i][0] for i in range(6)]), test_images)
    whole, d = finetune_dataset("mnist5k-c", "train", "fog", 5, dataset_kwargs=kw)  # images null = whole split
    assert len(whole) == 40 and d["finetune_images"] == 40
    # loco, glass_blur held out (the others need no numba compile of glass_blur in this process)
    loco, d = finetune_dataset("mnist5k-c", "loco", "glass_blur", 5, images=30, dataset_kwargs=kw)
    counts = d["finetune_corruptions"]
    assert list(counts) == [c for c in CORRUPTIONS if c != "glass_blur"] and d["held_out"] == "glass_blur"
    assert sum(counts.values()) == 30 == len(loco) and set(counts.values()) == {2, 3}  # 30 // 14, +1 for two
    assert counts["gaussian_noise"] == counts["shot_noise"] == 3 and not d["label_leak"]
    # corruption j (table order) takes train positions j*m, j*m+1, ... with m = ceil(30 / 14) = 3, whichever
    # corruption is held out: motion_blur (j = 5) fills rows 10-11 (after 3 + 3 + 2 + 2) with positions 15, 16
    ref = D.get_dataset("mnist5k-c", "train", corruption="motion_blur", indices=[15, 16], **kw)
    assert torch.equal(torch.stack([loco[i][0] for i in (10, 11)]), ref.images)
    assert [loco[i][1] for i in (10, 11)] == ref.targets.tolist()
    assert [loco[i][1] for i in range(3)] == D.get_dataset("mnist5k", "train", limit=3).targets.tolist()


def test_finetune_data_errors(tmp_path):
    kw = {"cache_dir": str(tmp_path), "limit": 10}
    with pytest.raises(ValueError, match="images=11 exceeds the 10 images of the test split.*valid: 1..10"):
        finetune_dataset("mnist5k-c", "paper", "fog", 5, images=11, dataset_kwargs=kw)
    with pytest.raises(ValueError, match="loco' needs finetune images >= 14"):
        finetune_dataset("mnist5k-c", "loco", "fog", 5, images=13, dataset_kwargs=kw)
    with pytest.raises(ValueError, match="takes 11 images from each other corruption.*valid: up to 140"):
        finetune_dataset("mnist5k-c", "loco", "fog", 5, images=141, dataset_kwargs=kw)
    with pytest.raises(ValueError, match="fine-tunes on the train split.*'cifar10-c' has only \\['test'\\].*'paper'"):
        finetune_dataset("cifar10-c", "train", "fog", 5)
    with pytest.raises(ValueError, match="unknown protocol 'both'"):
        finetune_dataset("mnist5k-c", "both", "fog", 5)
    assert not list(tmp_path.rglob("*.npy"))


# --------------------------------------------------------------------------- run_tta with a mapping
def _run(tmp_path, subspace, settings="reset", corruptions=CORR, methods=("bn", "szo-cge", "szo-rge")):
    return run_tta(tiny_model(), subspace, "digits-c", list(methods), settings, out_dir=tmp_path, batch_size=6,
                   get_data=fake_data, progress=False, q=2, seed=3, corruptions=corruptions, lr_reset=2.0, scale="absolute",
                   plot=False)


def test_one_subspace_per_corruption_equals_separate_runs(tmp_path, monkeypatch):
    from szo.adapt import runner

    model = tiny_model()
    subs = {c: random_subspace(model, seed=i) for i, c in enumerate(CORR)}
    built = []
    build = runner.build_adapter

    def spy(method, model, *, subspace=None, **kw):
        built.append((method, next((c for c, s in subs.items() if s is subspace), None)))
        return build(method, model, subspace=subspace, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(runner, "build_adapter", spy)
        res = _run(tmp_path / "map", subs)
    # each corruption adapted in its own subspace (a fresh adapter after the reset); bn needs none
    assert [c for m, c in built if m == "szo-cge"] == CORR and [c for m, c in built if m == "szo-rge"] == CORR
    assert [m for m, _ in built].count("bn") == 1
    assert res["config"]["subspace_per_corruption"] is True and res["config"]["k"] == 3
    for i, c in enumerate(CORR):
        alone = _run(tmp_path / c, subs[c], corruptions=[c])
        for m in ("bn", "szo-cge"):  # szo-rge draws from one generator stream across corruptions
            assert res["results"]["reset"][m]["per_corruption"][c] == alone["results"]["reset"][m]["per_corruption"][c]
    for m, fpb in (("bn", 1), ("szo-cge", 7), ("szo-rge", 5)):  # counts summed over the per-corruption adapters
        r = res["results"]["reset"][m]
        assert (r["batches"], r["fp"]) == (6, 6 * fpb) and set(r["time_per_corruption_s"]) == set(CORR)


def test_subspace_mapping_errors(tmp_path):
    model = tiny_model()
    subs = {c: random_subspace(model, seed=i) for i, c in enumerate(CORR)}
    with pytest.raises(ValueError, match="reset setting only"):
        _run(tmp_path, subs, settings="both")
    with pytest.raises(ValueError, match=r"no subspace for corruption\(s\) \['jpeg_compression'\]"):
        _run(tmp_path, {c: subs[c] for c in CORR[:2]})
    with pytest.raises(ValueError, match=r"different k \[2, 3\]"):
        _run(tmp_path, {**subs, "fog": random_subspace(model, k=2)})
    # methods without a subspace run in continual with a mapping given
    assert _run(tmp_path, subs, settings="continual", methods=["bn"])["results"]["continual"]["bn"]


def test_tables_name_the_protocol_and_flag_the_leak(tmp_path):
    from szo.adapt.tables import write_tables

    res = _run(tmp_path, random_subspace(tiny_model()), methods=["bn"])
    res["protocol"] = {"name": "paper", "label_leak": True, "warning": LABEL_LEAK, "description": "test split"}
    res["notes"] = ["a note"]
    write_tables(res, tmp_path, plot=False)
    for f in ("tta_summary.md", "tta_table_reset.md"):
        text = (tmp_path / f).read_text()
        assert "protocol **paper**" in text and f"**Label leak: {LABEL_LEAK}**" in text and "Note: a note." in text
    res["protocol"] = {"name": "train", "label_leak": False}
    write_tables(res, tmp_path, plot=False)
    assert "Label leak" not in (tmp_path / "tta_summary.md").read_text()
    assert json.loads((tmp_path / "tta_results.json").read_text())["protocol"]["name"] == "train"


# --------------------------------------------------------------------------- the recipe, end to end (tiny)
def _tiny(tmp_path) -> list[str]:
    return ["model.T=2", "progress=false", "data.kwargs={limit: 128}", "data.test_batch_size=128", "bptt.epochs=1",
            "bptt.max_steps_per_epoch=2", "trajectory.every=1", "subspace.k=2", "tta.n_source=2",
            "tta.corruptions=[gaussian_noise, fog]", "tta.max_batches=1", "tta.batch_size=10",
            f"tta.kwargs={{limit: 30, cache_dir: {tmp_path / 'cache'}}}", "tta.finetune.images=14",
            "tta.finetune.epochs=1", "tta.finetune.samples=2", "tta.finetune.batch_size=7", "method=bn,szo-cge"]


@pytest.fixture(scope="module")
def loco_run(tmp_path_factory):
    from szo.cli import main

    root = tmp_path_factory.mktemp("loco")
    args = ["recipe", "mnist5k-c-tta", "--out", str(root / "out")]
    for s in _tiny(root) + ["tta.protocol=loco"]:  # setting: both, the recipe's
        args += ["--set", s]
    assert main(args) == 0
    return root


def test_loco_recipe_builds_one_subspace_per_corruption_reset_only(loco_run, capsys):
    from subspace_store import SubspaceStore
    from szo.build import load_run_model

    out = loco_run / "out"
    res = json.loads((out / "tta_results.json").read_text())
    assert res["settings"] == ["reset"] and res["config"]["subspace_per_corruption"] is True
    assert any("loco" in n and "reset setting only" in n for n in res["notes"])
    p = res["protocol"]
    assert (p["name"], p["split"], p["label_leak"], p["images"]) == ("loco", "train", False, 14)
    assert set(p["finetune_corruptions"]) == {"gaussian_noise", "fog"}
    assert "fog" not in p["finetune_corruptions"]["fog"] and len(p["finetune_corruptions"]["fog"]) == 14
    model, _ = load_run_model(out / "source")
    store = SubspaceStore(out / "subspaces")
    for c in ("gaussian_noise", "fog"):
        sub = store.load(f"adapt-loco-{c}", model=model)
        assert sub.k == 2 and sub.provenance["adapt_held_out"] == c and c not in sub.provenance["adapt_corruptions"]
        assert (out / "finetune" / f"loco-{c}" / "trajectory" / "manifest.json").is_file()
    assert not (out / "finetune" / "trajectory").exists()
    summary = (out / "tta_summary.md").read_text()
    assert "protocol **loco**" in summary and "Label leak" not in summary and "Note: protocol loco" in summary


def test_paper_recipe_flags_the_label_leak_everywhere(loco_run, capsys):
    from subspace_store import SubspaceStore
    from szo.build import load_run_model
    from szo.config import load_recipe
    from szo.pipeline import run_recipe

    out = loco_run / "paper"
    cfg = load_recipe("mnist5k-c-tta", _tiny(loco_run) + ["tta.protocol=paper", "setting=both",
                                                         f"tta.source_run={loco_run / 'out' / 'source'}"])
    res = run_recipe(cfg, out)
    assert f"[tta] NOTE protocol paper: {LABEL_LEAK}" in capsys.readouterr().err
    assert res["settings"] == ["reset", "continual"] and "notes" not in res
    on_disk = json.loads((out / "tta_results.json").read_text())["protocol"]
    assert (on_disk["name"], on_disk["split"], on_disk["label_leak"], on_disk["warning"]) == (
        "paper", "test", True, LABEL_LEAK)
    for f in ("tta_summary.md", "tta_table_reset.md", "tta_table_continual.md"):
        assert f"**Label leak: {LABEL_LEAK}**" in (out / f).read_text(), f
    model, _ = load_run_model(loco_run / "out" / "source")
    prov = SubspaceStore(out / "subspaces").load("adapt", model=model).provenance
    assert prov["adapt_split"] == "test" and prov["warning"] == LABEL_LEAK and prov["adapt_images"] == 14
