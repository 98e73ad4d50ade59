"""Checkpoints written before the forward-only core (golden/, see golden_cases.py) load and continue
bit-exactly, and today's code reproduces the same 4-step run uninterrupted."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from szo.losses import tet_loss
from szo.train import fit
from tests.optim.golden_cases import CASES, GOLDEN, SEED, STEPS, build, loaders, model_and_subspace


def _run(case: str, run_dir, epochs: int, resume: bool = False) -> torch.nn.Module:
    g = torch.Generator().manual_seed(SEED)
    train, test = loaders(g)
    model, sub = model_and_subspace()
    net, opt = build(case, model, sub, g)
    fit(net, train, test, opt, epochs=epochs, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
        max_steps_per_epoch=STEPS, plot=False, info={"method": CASES[case][0]}, resume=resume)
    return net


def _assert_state(net: torch.nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    got = net.state_dict()
    assert set(got) == set(want), what
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs (max |diff| {(got[k].double() - v.double()).abs().max()})"


@pytest.mark.parametrize("case", list(CASES))
def test_golden_checkpoint_continues_bit_exactly(case, tmp_path):
    want = load_file(GOLDEN / case / "final.safetensors")
    init = load_file(GOLDEN / "init.safetensors")
    assert any(not torch.equal(want[k], init[k]) for k in init if k in want), "the golden run did not move"
    (tmp_path / "half" / "checkpoints").mkdir(parents=True)
    for f in ("last.pt", "last.json"):
        shutil.copy(GOLDEN / case / f, tmp_path / "half" / "checkpoints" / f)
    _assert_state(_run(case, tmp_path / "half", epochs=2, resume=True), want, f"{case}, resumed from golden")
    _assert_state(_run(case, tmp_path / "full", epochs=2), want, f"{case}, uninterrupted")
