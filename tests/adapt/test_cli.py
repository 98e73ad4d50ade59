"""The kind: tta recipe stage and ``szo adapt``: source model through the pipeline's BPTT stage."""
from __future__ import annotations

import json

import pytest
import torch

TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "setting=reset", "bptt.epochs=1",
        "bptt.max_steps_per_epoch=2", "subspace.k=2", "tta.n_source=2", "tta.corruptions=[gaussian_noise]",
        "tta.max_batches=1", "tta.finetune.epochs=1", "tta.finetune.samples=2", "tta.finetune.batch_size=256"]


@pytest.fixture(scope="module")
def tta_run(tmp_path_factory):
    from szo.adapt import subspace, tables
    from szo.config import load_recipe
    from szo.pipeline import run_recipe

    root = tmp_path_factory.mktemp("tta")
    cfg = load_recipe("digits-c-tta", TINY + ["method=bn,szo-cge", f"subspace.root={root / 'store'}", "loss.lamb=0.2",
                                              "tta.finetune.weight_decay=0.001"])
    losses = []
    finetune = subspace.finetune_on_dataset

    def spy(*a, **kw):
        losses.append(kw)
        return finetune(*a, **kw)

    written = []
    write_json = tables.atomic_write_json

    def json_spy(path, obj):
        written.append(path.name)
        return write_json(path, obj)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subspace, "finetune_on_dataset", spy)
        mp.setattr(tables, "atomic_write_json", json_spy)
        res = run_recipe(cfg, root / "out")
    res["_finetune_losses"], res["_json_written"] = losses, written
    return root, res


def test_source_is_the_pipeline_bptt_stage(tta_run):
    from szo.build import load_run_model

    root, res = tta_run
    src = root / "out" / "source"
    for f in ("config.yaml", "model.safetensors", "results.json", "checkpoints/last.pt", "trajectory/manifest.json"):
        assert (src / f).is_file(), f
    assert json.loads((src / "results.json").read_text())["steps"] == 2  # bptt.max_steps_per_epoch is honoured
    assert not (root / "store").exists()  # build=False: nothing written to the subspace store
    model, cfg = load_run_model(src)
    assert cfg["kind"] == "tta" and model.num_classes == 10 and model.T == 2
    assert res["results"]["reset"]["szo-cge"]["fp"] == 2 * 2 + 1  # k = 2, one batch


def test_szo_adapt_cli_loads_the_source_run(tta_run, capsys):
    from szo.cli import main

    root, _ = tta_run
    out = root / "cli"
    rc = main(["adapt", "--source", str(root / "out" / "source"), "--method", "none", "--setting", "reset",
               "--max-batches", "1", "--out", str(out)])
    assert rc == 0 and "No adapt." in capsys.readouterr().out
    res = json.loads((out / "tta_results.json").read_text())
    assert res["model"] == "spike_convnet" and len(res["corruptions"]) == 15
    rc = main(["adapt", "--source", str(root / "out" / "source"), "--data", "cifar100-c", "--method", "none",
               "--out", str(root / "bad")])
    assert rc != 0 and "has 10 classes, the data set 'cifar100-c' 100" in capsys.readouterr().err


def test_finetuning_uses_the_recipe_loss(tta_run):
    from szo.losses import tet_loss

    _, res = tta_run
    (kw,) = res["_finetune_losses"]
    loss = kw["loss"]
    assert kw["settings"].weight_decay == 0.001  # tta.finetune.weight_decay reaches the fine-tuning
    out, y = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(0)), torch.arange(5)
    torch.testing.assert_close(loss(out, y), tet_loss(out, y, lamb=0.2, phi=1.0))  # loss.lamb, not TET's default
    assert not torch.allclose(loss(out, y), tet_loss(out, y))


def test_tta_results_written_once_with_the_timings(tta_run):
    root, res = tta_run
    assert res["_json_written"] == ["tta_results.json"]
    on_disk = json.loads((root / "out" / "tta_results.json").read_text())
    assert set(on_disk["timings"]) == {"source_s", "subspace_s", "tta_s", "total_s"}
    assert (root / "out" / "tta_summary.md").is_file() and (root / "out" / "tta_accuracy.png").is_file()
    assert not (root / "out" / "source_model.safetensors").exists()  # the source run holds the weights


def test_adaptation_subspace_from_both_trajectories(tta_run):
    from subspace_store import SubspaceStore
    from szo.build import load_run_model

    root, _ = tta_run
    model, _ = load_run_model(root / "out" / "source")
    sub = SubspaceStore(root / "out" / "subspaces").load("adapt", model=model)
    assert sub.k == 2 and torch.equal(sub.reference, model.flat_params())  # starts at the source model
    p = sub.provenance
    assert p["adapt_corruption"] == "gaussian_noise" and p["adapt_severity"] == 5 and p["n_source"] == 2
    assert p["source_trajectory"] == str((root / "out" / "source" / "trajectory").resolve())
    assert p["adapt_trajectory"] == str((root / "out" / "finetune" / "trajectory").resolve())


def test_szo_adapt_flags_are_the_schemas_keys(tmp_path):
    """Each flag is a schema key: one not given takes the schema's default -- except --q, whose
    test-time default is run_tta's and the *-tta recipes' 10 (App. G), not the training default 1 --
    one given lands in the config, and the help names the key and its default."""
    import argparse

    from szo.adapt import cli
    from szo.config import TTAConfig

    parser = argparse.ArgumentParser().add_subparsers().add_parser("adapt")
    cli.add_arguments(parser)
    args = parser.parse_args(["--source", str(tmp_path), "--out", str(tmp_path / "o"), "--mu", "0.3"])
    cfg = cli.flags_config(args)
    assert cfg.szo.q == 10 and cfg.szo.mu == 0.3 and cfg.tta.lr_reset == TTAConfig().lr_reset
    assert cfg.method == "all" and cfg.setting == "both" and cfg.tta.source_run == str(tmp_path)
    assert cli.flags_config(parser.parse_args(["--source", "x", "--out", "y", "--q", "3"])).szo.q == 3
    text = " ".join(parser.format_help().split())  # argparse wraps the help
    assert "(szo.q; default 10)" in text and "(tta.lr_continual; default null)" in text
    args = parser.parse_args(["--source", "x", "--out", "y", "--lr-reset", "0.5", "--scale", "trajectory"])
    assert args.lr_reset == 0.5 and args.scale == "trajectory"  # X | None keys parse as X
    with pytest.raises(SystemExit):
        parser.parse_args(["--source", "x", "--out", "y", "--predict", "never"])  # a Literal's choices


def test_every_tta_door_adapts_with_the_same_q_and_units(tmp_path):
    """szo adapt, run_tta and the *-tta recipes without the setting: SZO-RGE at q = 10 (App. G) in the
    subspace methods' default units (trajectory: mu 0.3, lr 0.03 reset / 0.003 continual); the recipes
    that pin the paper's units (cifar*-tta, imagenetc-tta) say so, and run_tta takes them as given."""
    import argparse

    from szo.adapt import cli
    from szo.adapt.runner import TTAOptions
    from szo.config import load_recipe

    parser = argparse.ArgumentParser().add_subparsers().add_parser("adapt")
    cli.add_arguments(parser)
    flags = cli.flags_config(parser.parse_args(["--source", "x", "--out", "y"]))
    o = TTAOptions(out_dir=str(tmp_path)).resolved(["none", "bn", "bp-subspace", "szo-cge", "szo-rge"])
    recipes = [load_recipe(n) for n in ("digits-c-tta", "fmnist-c-tta", "mnist5k-c-tta")]
    for c in [flags, *recipes]:
        assert (c.szo.q, c.szo.scale, c.szo.mu) == (o.q, o.scale, o.mu) == (10, "trajectory", 0.3), c.name
    assert (o.lr_of("szo-rge", "reset"), o.lr_of("szo-rge", "continual")) == pytest.approx((0.03, 0.003))
    for n in ("cifar10c-tta", "cifar100c-tta", "imagenetc-tta"):
        c = load_recipe(n)
        assert (c.szo.q, c.szo.scale, c.szo.mu) == (10, "absolute", 1.0), n
    a = TTAOptions(out_dir=str(tmp_path), scale="absolute").resolved(["szo-rge"])
    assert (a.mu, a.lr_of("szo-rge", "reset")) == (1.0, 1.0)


def test_the_library_never_imports_a_command_module():
    """Commands sit above the library: no module of the package imports a ``cli`` module or
    ``szo.commands`` (the command modules themselves and the ``szo`` entry point excepted)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in list((root / "szo").rglob("*.py")) + list((root / "subspace_store").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name in ("cli.py", "__main__.py") or "/commands/" in rel:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and node.level and node.module in ("cli", None):
                names = [f".{a.name}" for a in node.names] if node.module is None else [".cli"]
            offenders += [f"{rel}: {n}" for n in names if n.endswith(".cli") or n == ".cli" or ".commands" in n]
    assert offenders == []
