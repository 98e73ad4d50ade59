"""szo diagnose and szo study subspaces end to end on a tiny digits BPTT run (two seeds)."""
from __future__ import annotations

import json

import pytest
import torch

from szo.build import load_run_model
from szo.cli import main
from szo.config import load_recipe
from szo.pipeline import run_recipe
from szo.study.diagnose import diagnose_model, surrogate_gradient
from szo.study.precision import study_precision
from szo.study.subspaces import first_epochs_window, study_subspaces, subspace_variants

TINY = ["model.T=2", "model.kwargs={width: 2}", "progress=false", "data.batch_size=32", "data.test_batch_size=360",
        "bptt.epochs=2", "bptt.max_steps_per_epoch=4", "trajectory.every=1", "subspace.k=4", "bptt.lr=0.5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    sets = TINY + [f"subspace.root={root / 'subspaces'}"]
    run_recipe(load_recipe("digits-bp", sets), root / "bp")
    run_recipe(load_recipe("digits-bp", sets + ["seed=1", "subspace.name=seed1"]), root / "bp-seed1")
    return root


def test_diagnose_cli_rows_and_model_untouched(runs, capsys):
    model, _ = load_run_model(runs / "bp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = runs / "diag.json"
    assert main(["diagnose", str(runs / "bp"), "--mu", "0.01,0.1", "--q", "1,2", "--repeats", "3", "--batch", "16",
                 "--max-full-cge", "100000", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["subspace"] == "digits-convnet-k20" and res["batch"] == 16
    # 2 models x (subspace + full) x 2 mu x (cge + 2 q)
    assert len(rows) == 2 * 2 * 2 * 3
    assert {r["model"] for r in rows} == {"snn", "relu-twin"}
    sub = [r for r in rows if r["space"] == "subspace"]
    assert all(r["k"] == 4 and 0.0 <= r["projected_fraction"] <= 1.0 + 1e-9 for r in sub)
    assert all(r["variance"] == 0.0 for r in rows if r["estimator"] == "cge")
    assert all(r["variance_closed_form"] > 0 for r in rows if r["estimator"] == "rge")
    # the ReLU twin is smooth: full-space CGE with small mu recovers its true gradient
    twin_cge = [r for r in rows if r["model"] == "relu-twin" and r["space"] == "full" and r["estimator"] == "cge"
                and r["mu"] == 0.01][0]
    assert twin_cge["cosine"] > 0.95
    assert "cos_P" in capsys.readouterr().out
    assert (runs / "diag.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model2, _ = load_run_model(runs / "bp")
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())


def test_surrogate_gradient_restores_bn_and_diagnose_validates(runs):
    model, cfg = load_run_model(runs / "bp")
    from szo.build import loss_for
    from szo.study.diagnose import run_batch

    x, y = run_batch(cfg, 8)
    bufs = {k: v.clone() for k, v in model.named_buffers()}
    g = surrogate_gradient(model, x, y, loss_for(cfg))
    assert g.shape == (model.num_params(),) and torch.isfinite(g).all() and g.abs().sum() > 0
    assert all(torch.equal(bufs[k], v) for k, v in model.named_buffers())
    with pytest.raises(ValueError, match="repeats"):
        diagnose_model(model, x, y, loss_for(cfg), directions=None, mus=[0.1], qs=[1], repeats=1)
    with pytest.raises(ValueError, match="mus"):
        diagnose_model(model, x, y, loss_for(cfg), directions=None, mus=[], qs=[1])
    with pytest.raises(ValueError, match="is not in the store"):
        from szo.study.diagnose import diagnose_run
        diagnose_run(runs / "bp", subspace="nope")


def test_study_subspaces_cli(runs, capsys):
    out = runs / "ss"
    assert main(["study", "subspaces", str(runs / "bp"), "--k", "3", "--prefix", "abl", "--first-epochs", "1",
                 "--other-run", str(runs / "bp-seed1"), "--random-seeds", "0,1", "--out", str(out)]) == 0
    res = json.loads((out / "subspaces.json").read_text())
    rows = {r["variant"]: r for r in res["projection"]}
    assert set(rows) == {"whole", "first1", "seed-bp-seed1", "random0", "random1", "bn-head"}
    assert all(rows[v]["k"] == 3 for v in ("whole", "first1", "seed-bp-seed1", "random0"))
    # theta_BP is the last trajectory sample: with k = N - 1 of the whole trajectory it is inside; here
    # k = 3 < 8, so the whole-trajectory subspace is close but random directions barely see the BP move
    assert rows["whole"]["relative_distance"] < rows["random0"]["relative_distance"]
    assert rows["random0"]["relative_distance"] > 0.9
    assert all(0.0 <= r["projected_test_acc"] <= 1.0 for r in rows.values())
    assert "projected test acc" in capsys.readouterr().out
    # stored under PREFIX-VARIANT, so a scratch recipe can train there (subspace.name=abl-random0)
    from subspace_store import SubspaceStore
    store = SubspaceStore(res["store"])
    assert {"abl-whole", "abl-random0", "abl-bn-head"} <= set(store.list())


def test_variants_share_theta0(runs):
    v = subspace_variants(runs / "bp", 2, random_seeds=[3], bn_head=True)
    ref = v["whole"].reference
    assert all(torch.equal(s.reference, ref) for s in v.values())
    with pytest.raises(ValueError, match="no trajectory"):
        subspace_variants(runs, 2)


def test_study_subspaces_trains_a_scratch_recipe_in_each_variant(runs):
    out = runs / "ss-train"
    sets = [a for s in ["model.T=2", "model.kwargs={width: 2}", "progress=false", "data.batch_size=32",
                        "data.test_batch_size=360", "train.epochs=1", "train.max_steps_per_epoch=2"]
            for a in ("--set", s)]
    assert main(["study", "subspaces", str(runs / "bp"), "--k", "2", "--prefix", "tr", "--random-seeds", "5",
                 "--train", "digits-scratch", "--refresh", "1", "--out", str(out)] + sets) == 0
    res = json.loads((out / "subspaces.json").read_text())
    assert [t["variant"] for t in res["training"]] == ["whole", "random5", "bn-head", "random5-refresh1"]
    for t in res["training"]:
        cfg = json.loads((out / t["variant"] / "results.json").read_text())
        assert 0.0 <= t["best_test_acc"] <= 1.0
        # the BN + classifier coordinates (k in the hundreds) train with BP-Subspace, not 2k forwards a step
        assert (cfg["label"], t["method"]) == (("BP-Subspace", "bp-subspace") if t["variant"] == "bn-head"
                                               else ("SZO-CGE", "szo-cge")), t
    k_bn = next(r["k"] for r in res["projection"] if r["variant"] == "bn-head")
    assert k_bn > 100 and json.loads((out / "bn-head" / "results.json").read_text())["bp"] == 2
    import yaml
    saved = yaml.safe_load((out / "random5" / "config.yaml").read_text())
    # every variant trains in the paper's units (the BN + classifier coordinates have no trajectory spread)
    assert (saved["subspace"]["name"], saved["szo"]["scale"], saved["szo"]["refresh"]) == ("tr-random5", "absolute",
                                                                                             None)
    # the refreshed random variant: the same store entry, its basis redrawn every step
    saved = yaml.safe_load((out / "random5-refresh1" / "config.yaml").read_text())
    assert (saved["subspace"]["name"], saved["szo"]["refresh"]) == ("tr-random5", 1)
    assert json.loads((out / "random5-refresh1" / "results.json").read_text())["status"] == "completed"
    with pytest.raises(ValueError, match="--refresh trains the random variants .* needs --train RECIPE"):
        study_subspaces(runs / "bp", 2, prefix="x", refresh=3)


def test_first_epochs_are_epochs_of_bptt_whatever_the_recording(runs):
    """first{E}: the initial weights and the samples of the first E epochs. The fixture records every step
    (4 steps an epoch): a step sample carries the number of epochs completed before it, so epoch 1's
    steps are labelled 0 and the window is (0, E - 1); an epoch-end sample carries its own epoch."""
    assert first_epochs_window(1, 1) == (0, 0) and first_epochs_window("epoch", 1) == (0, 1)
    v = subspace_variants(runs / "bp", 2, first_epochs=[1], random_seeds=[], bn_head=False)
    assert v["first1"].provenance["steps"] == [0, 1, 2, 3, 4]
    # the random variant carries the whole trajectory's variance evenly: the same trajectory unit
    r = subspace_variants(runs / "bp", 2, random_seeds=[0], bn_head=False)
    torch.testing.assert_close(r["random0"].eigenvalues.sum(), r["whole"].eigenvalues.sum())
    with pytest.raises(ValueError, match="first epochs must be ints >= 1"):
        first_epochs_window(1, 0)


def test_study_q_forwards_per_step_reuse_and_plot(runs, capsys):
    out = runs / "q"
    sets = [a for s in ["model.T=2", "model.kwargs={width: 2}", "progress=false", "data.batch_size=32",
                        "data.test_batch_size=360", "train.epochs=1", "train.max_steps_per_epoch=2", "subspace.k=4",
                        f"subspace.root={runs / 'subspaces'}"]
            for a in ("--set", s)]
    assert main(["study", "q", "digits-scratch", "--q", "3,1", "--out", str(out), "--rge-set", "szo.mu=0.2"] + sets) == 0
    res = json.loads((out / "q.json").read_text())
    rows = {r["run"]: r for r in res["rows"]}
    import yaml
    mus = {n: yaml.safe_load((out / n / "config.yaml").read_text())["szo"]["mu"] for n in rows}
    assert mus["szo-rge-q1"] == mus["szo-rge-q3"] == 0.2 and mus["szo-cge"] != 0.2  # --rge-set: RGE runs only
    assert list(rows) == ["szo-rge-q1", "szo-rge-q3", "szo-cge"]
    # 2q probes (RGE) or 2k (CGE, k = 4) + the recompute-BN forward, per optimizer step
    assert [rows[n]["fp_per_step"] for n in rows] == [3, 7, 9]
    assert all(0.0 <= r["best_test_acc"] <= 1.0 and r["steps"] == 2 for r in rows.values())
    assert (out / "q.png").stat().st_size > 10_000 and "| SZO-RGE | 3 | 7 |" in (out / "q.md").read_text()
    # a second call reuses the completed runs (nothing retrained) ...
    before = (out / "szo-cge" / "metrics.jsonl").read_bytes()
    assert main(["study", "q", "digits-scratch", "--q", "1,3", "--out", str(out), "--rge-set", "szo.mu=0.2"] + sets) == 0
    assert (out / "szo-cge" / "metrics.jsonl").read_bytes() == before
    # ... and refuses one trained differently, in one line
    capsys.readouterr()
    assert main(["study", "q", "digits-scratch", "--q", "1", "--no-cge", "--out", str(out), "--set", "szo.mu=0.5"]
                + sets) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "szo.mu is 0.2" in err[0] and "0.5 now" in err[0]


def test_study_q_rejects_bad_q_and_bp_recipes(tmp_path):
    from szo.study.qsweep import study_q
    with pytest.raises(ValueError, match="positive int"):
        study_q("digits-scratch", [0, 2], out=tmp_path)
    with pytest.raises(ValueError, match="kind 'bp'"):
        study_q("digits-bp", [1], out=tmp_path)


def test_study_shift_cells_protocol_and_outputs(runs, capsys, monkeypatch, tmp_path):
    """szo study shift on the tiny digits run with digits-c: every (N, method) cell, adaptation data
    drawn from the shifted train split only, BN adaptation changes statistics not weights, a
    finished cell is not rerun, and one line for bad settings."""
    import szo.study.shift as shift
    from szo.data import corrupted

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    seen = []
    real = shift.get_dataset

    def spy(name, split, **kw):
        seen.append((name, split))
        return real(name, split, **kw)

    monkeypatch.setattr(shift, "get_dataset", spy)
    out = runs / "shift"
    args = ["study", "shift", str(runs / "bp"), "--data", "digits-c", "--samples", "8,16", "--batch", "8",
            "--eval-images", "40", "--k", "2", "--window", "1-2", "--methods", "none,bn,bp,szo-cge,szo-rge",
            "--q", "2", "--lr", "szo-cge=0.2", "--out", str(out)]
    assert main(args) == 0
    res = json.loads((out / "shift.json").read_text())
    assert sorted(seen) == [("digits-c", "test"), ("digits-c", "train")]  # adapt on train, score on test
    rows = {(r["method"], r["n"]): r for r in res["rows"]}
    assert len(rows) == 10 and res["eval_images"] == 40 and res["subspace"]["k"] == 2
    assert rows[("none", 8)]["test_acc"] == rows[("none", 16)]["test_acc"] and rows[("none", 8)]["fp"] == 0
    assert rows[("szo-cge", 16)]["fp"] == 2 * (2 * 2 + 1) and rows[("szo-cge", 16)]["bp"] == 0  # 2 batches, 2k+1
    assert rows[("szo-rge", 8)]["fp"] == 2 * 2 + 1 and rows[("bp", 16)]["bp"] == 2
    assert res["settings"]["lr"]["szo-cge"] == 0.2 and res["settings"]["lr"]["bp"] == shift.default_lr("bp") == 0.01
    assert (out / "shift.png").read_bytes()[:4] == b"\x89PNG" and "| SZO-CGE |" in (out / "shift.md").read_text()
    # bn: the deployed weights, new statistics
    model, cfg = load_run_model(runs / "bp")
    w = model.flat_params()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    stats = [b.running_mean.clone() for b in bns]
    pool = corrupted.get_digits_c("train", limit=16, cache_dir=tmp_path / "c")
    assert shift.bn_adapt(model, [(pool.images[:8], pool.targets[:8])]) == 1
    assert torch.equal(model.flat_params(), w) and not all(torch.equal(a, b.running_mean) for a, b in zip(stats, bns))
    assert all(b.momentum == 0.1 for b in bns) and not model.training
    # a finished cell is read back, not rerun
    calls = []
    monkeypatch.setattr(shift, "fit", lambda *a, **k: calls.append(1))
    assert main(args) == 0 and calls == []
    capsys.readouterr()
    assert main(["study", "shift", str(runs / "bp"), "--methods", "none,asyncfgd", "--out", str(tmp_path / "x")]) == 2
    assert "neither trains in a subspace nor by backprop" in capsys.readouterr().err
    assert main(["study", "shift", str(runs / "bp"), "--lr", "bp=0.1", "--methods", "none", "--out",
                 str(tmp_path / "x")]) == 2
    assert "lr given for method(s) ['bp']" in capsys.readouterr().err


def test_study_precision_estimates_training_and_outputs(runs, capsys):
    """szo study precision: fp32 is its own reference (cosine 1, no flips), bf16 moves the spikes and
    the estimate a little (cosines in (0, 1]), one run per precision x seed, each recording its precision."""
    out = runs / "precision"
    sets = [a for s in ["model.T=2", "model.kwargs={width: 2}", "progress=false", "data.batch_size=32",
                        "data.test_batch_size=360", "train.epochs=1", "train.max_steps_per_epoch=2", "subspace.k=4",
                        f"subspace.root={runs / 'subspaces'}"]
            for a in ("--set", s)]
    assert main(["study", "precision", "digits-scratch", "--precision", "bf16,fp32", "--mu", "0.1,1", "--q", "2",
                 "--repeats", "2", "--batch", "16", "--seeds", "0,1", "--out", str(out)] + sets) == 0
    res = json.loads((out / "precision.json").read_text())
    est = res["estimates"]
    assert [(r["precision"], r["estimator"], r["mu"]) for r in est][:4] == [
        ("fp32", "cge", 0.1), ("fp32", "rge", 0.1), ("fp32", "cge", 1.0), ("fp32", "rge", 1.0)]  # fp32 first
    fp32 = [r for r in est if r["precision"] == "fp32"]
    bf16 = [r for r in est if r["precision"] == "bf16"]
    assert len(bf16) == len(fp32) == 4
    assert all(r["cosine_to_fp32"] == pytest.approx(1.0) and r["spike_flip_rate"] == 0.0 for r in fp32)
    assert all(0.0 < r["spike_flip_rate"] < 0.5 and -1.0 <= r["cosine_to_fp32"] <= 1.0 for r in bf16)
    assert any(r["cosine_to_fp32"] < 1.0 - 1e-9 for r in bf16)  # the arithmetic moved at least one estimate
    runs_ = {(r["precision"], r["seed"]): r for r in res["training"]}
    assert set(runs_) == {("bf16", 0), ("bf16", 1), ("fp32", 0), ("fp32", 1)}
    for (p, s), r in runs_.items():
        rec = json.loads((out / f"{p}-mu{r['mu']:g}-s{s}" / "results.json").read_text())
        assert rec["precision"]["name"] == p and rec["seed"] == s and r["effective"] == p
    assert {a["precision"]: a["n"] for a in res["accuracy"]} == {"bf16": 2, "fp32": 2}
    assert (out / "precision.png").stat().st_size > 10_000
    md = (out / "precision.md").read_text()
    assert "| bf16 | CGE | 0.1 |" in md and "| fp32 | 0.3 | 2 |" in md  # training: the recipe's default mu (trajectory)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        study_precision("digits-scratch", precisions=["fp8"], out=out / "bad", train=False)


@pytest.mark.parametrize("args, phrase", [
    (["digits-bp"], "szo study precision trains in a subspace: recipe 'digits-bp' is kind 'bp'"),
    (["digits-scratch", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["digits-scratch", "--repeats", "1"], "--repeats 1; valid: an int >= 2"),
    (["digits-scratch", "--mu", "0"], "--mu [0.0]; valid: positive finite numbers"),
    (["digits-scratch", "--set", "train.epochs=0"], "'train.epochs' must be >= 1"),
    (["digits-scratch", "--train-mu", "-1"], "'szo.mu' must be > 0"),
])
def test_a_refused_study_precision_leaves_no_directory(tmp_path, capsys, args, phrase):
    """Everything is checked before --out is created: a refused study is one line and leaves nothing behind."""
    assert main(["study", "precision", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and phrase in err[0], err
    assert not (tmp_path / "o").exists()


def test_study_precision_out_an_existing_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("not a directory")
    assert main(["study", "precision", "digits-scratch", "--no-train", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run directory {f} (or a parent of it) exists and is not a directory" in err[0], err
    assert f.read_text() == "not a directory"
