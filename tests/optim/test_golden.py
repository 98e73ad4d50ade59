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


def _run(case: str, run_dir, epochs: int, resume: bool = False):
    g = torch.Generator().manual_seed(SEED)
    train, test = loaders(g)
    model, sub = model_and_subspace()
    net, opt = build(case, model, sub, g)
    fit(net, train, test, opt, epochs=epochs, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
        max_steps_per_epoch=STEPS, plot=False, info={"method": CASES[case][0]}, resume=resume)
    return net, opt


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
    _assert_state(_run(case, tmp_path / "half", epochs=2, resume=True)[0], want, f"{case}, resumed from golden")
    net, opt = _run(case, tmp_path / "full", epochs=2)
    _assert_state(net, want, f"{case}, uninterrupted")
    # the optimizer state is written under the same keys, with the same values: integers, generator
    # states and counters exactly; float coordinates to a few ulps (one momentum formula for every
    # method now: heavy_ball_ rounds fg-subspace's float64 c differently in the last bits)
    _assert_same(opt.state_dict(), torch.load(GOLDEN / case / "final_optimizer.pt", weights_only=True), case)


def _assert_same(got, want, path: str) -> None:
    assert type(got) is type(want) or (isinstance(got, (list, tuple)) and isinstance(want, (list, tuple))), path
    if isinstance(want, dict):
        assert set(got) == set(want), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=path)
        else:
            assert torch.equal(got, want), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
