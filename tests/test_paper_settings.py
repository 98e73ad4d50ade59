"""The seed methods at their published settings (issue 32): one named recipe each, and the settings
that make them (block selection, a recipe's clean BPTT source) refused where they do not apply."""
from __future__ import annotations

import pytest

from szo.config import SOURCE_SECTIONS, load_recipe, source_config


def test_mcu_recipe_is_the_papers_setting():
    """Seed 004 Sec. 4.1: Q = 100 per layer, initial lr 0.01 with cosine decay, no momentum or weight
    decay, batch 100, BP-free selection among four blocks with one epoch of test training each,
    adapting the pretrained int8 model to corrupted data; its length: "a training dataset with 1000
    images" for 50 epochs, 50 x 10 = 500 steps."""
    c = load_recipe("digits-c-mcu")
    assert (c.method, c.backend, c.bn_stats, c.hw.learner, c.mode) == ("mcu-zo", "fixed", "deployed", "integer",
                                                                       "continual")
    assert (c.szo.q, c.train.lr, c.train.scheduler, c.train.momentum, c.train.weight_decay, c.data.batch_size) == \
        (100, 0.01, "cosine", 0.0, 0.0, 100)
    assert (c.hw.blocks, c.hw.select_epochs, c.hw.heldout, c.szo.layers) == (4, 1, 0.1, None)
    assert c.data.name == "digits-c" and c.data.kwargs == {"corruption": "gaussian_noise", "severity": 5, "limit": 1000}
    assert (c.train.epochs, c.train.max_steps_per_epoch, c.train.t_max) == (50, None, None)
    import torch

    from szo.build import loaders_for

    train, test = loaders_for(c, torch.Generator())
    assert (len(train.dataset), len(train), len(test.dataset)) == (1000, 10, 360)  # 10 steps an epoch, all 360 tested
    # its pretrained model comes from clean digits: the source's BPTT stage, with this recipe's model and entry
    src = source_config(c)
    assert (src.name, src.data.name, src.subspace.name, src.subspace.reference) == \
        ("digits-continual", "digits", c.subspace.name, "last")
    assert src.model == c.model and src.bptt == c.bptt
    assert source_config(load_recipe("digits-c-mcu", ["bptt.epochs=1", "model.T=2"])).bptt.epochs == 1
    assert "data" not in SOURCE_SECTIONS and "loss" not in SOURCE_SECTIONS


def test_digits_fixed_keeps_its_tuned_from_scratch_values():
    c = load_recipe("digits-fixed", ["method=mcu-zo"])
    assert (c.szo.q, c.train.lr, c.hw.blocks, c.source) == (10, 0.1, None, None)


def test_block_selection_and_source_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match=r"^hw.blocks \(seed 004's BP-free block selection\) applies to method "
                                         r"mcu-zo .*method 'qzo-subspace' does not select blocks: leave hw.blocks null"):
        load_recipe("digits-fixed", ["method=qzo-subspace", "hw.blocks=4"])
    with pytest.raises(ValueError, match=r"^hw.blocks selects the trained layers itself .* leave szo.layers null"):
        load_recipe("digits-c-mcu", ["szo.layers=[fc]"])
    with pytest.raises(ValueError, match=r"'hw.blocks' must be >= 1, got 0"):
        load_recipe("digits-c-mcu", ["hw.blocks=0"])
    with pytest.raises(ValueError, match=r"'hw.heldout' must be < 1.0, got 1.0"):
        load_recipe("digits-c-mcu", ["hw.heldout=1.0"])
    with pytest.raises(ValueError, match=r"'source' names this recipe itself \('digits-c-mcu'\)"):
        load_recipe("digits-c-mcu", ["source=digits-c-mcu"])
    with pytest.raises(ValueError, match=r"^source 'nope': unknown recipe 'nope'; valid recipes: "):
        load_recipe("digits-c-mcu", ["source=nope"])
    with pytest.raises(ValueError, match=r"^source 'digits-c-tta' must be a recipe with its own BPTT stage .* kind: tta"):
        load_recipe("digits-c-mcu", ["source=digits-c-tta"])
    with pytest.raises(ValueError, match=r"'source' names the recipe .* this recipe is kind: bp \(leave source null\)"):
        load_recipe("digits-bp", ["source=digits-continual"])


def test_baffle_recipe_is_the_papers_configuration():
    """Seed 002's experiments: server Adam with betas (0.9, 0.99) at lr 0.01, EMA 0.995 of the global
    model, GroupNorm (its own BPTT subspace); the default stays heavy ball, no EMA, BatchNorm."""
    from szo.federated.server import ADAM_BETAS

    p, d = load_recipe("digits-baffle"), load_recipe("digits-scratch")
    assert (p.federated.server_optimizer, p.federated.lr, p.federated.ema) == ("adam", 0.01, 0.995)
    assert ADAM_BETAS == (0.9, 0.99)
    assert p.model.kwargs == {"width": 16, "norm": "group"} and p.subspace.name != d.subspace.name
    assert (d.federated.server_optimizer, d.federated.ema, d.model.kwargs.get("norm", "batch")) == ("sgd", 0.0, "batch")


def test_tt_zo_paper_variant_beside_the_tuned_recipe():
    """Seed 000: one-sided CGE over all d coordinates (d + 1 forwards) at mu 0.01, lr 1e-3 for both
    phases, signRGE with N = 10 at mu 0.1; digits-scratch keeps its tuned sparse CGE."""
    p, t = load_recipe("digits-tt-paper"), load_recipe("digits-scratch", ["method=tt-zo"])
    assert p.method == "tt-zo"
    assert (p.szo.coords_per_step, p.szo.mu, p.train.lr, p.train.momentum) == (None, 0.01, 0.001, 0.9)
    assert (p.tt.sign_lr, p.tt.sign_q, p.tt.sign_mu, p.tt.cge, p.tt.cores) == (0.001, 10, 0.1, "one-sided", 4)
    assert (t.szo.coords_per_step, t.szo.mu, t.train.lr, t.tt.sign_lr) == (20, 0.1, 0.3, 0.01)
    assert (p.model, p.subspace, p.train.epochs) == (t.model, t.subspace, t.train.epochs)


def test_resume_of_a_run_stopped_in_its_source_stage_continues_the_recipe(tmp_path):
    """A recipe with a source stopped during that source's BPTT stage holds only DIR/bptt/config.yaml
    (the source's): --resume continues the recipe (whose BPTT stage then checks that file), not the
    source recipe; a directory whose own config.yaml is another recipe's is still refused."""
    from szo.config import write_config
    from szo.rundir import ResumeMismatchError, resumed_config

    cfg = load_recipe("digits-c-mcu", ["train.epochs=3"])
    (tmp_path / "bptt").mkdir()
    write_config(source_config(cfg), tmp_path / "bptt" / "config.yaml")
    assert resumed_config(tmp_path, cfg, ["train.epochs=3"]) is cfg
    write_config(load_recipe("digits-continual"), tmp_path / "config.yaml")
    with pytest.raises(ResumeMismatchError, match=r"holds a run of recipe 'digits-continual', not 'digits-c-mcu'"):
        resumed_config(tmp_path, cfg, [])
