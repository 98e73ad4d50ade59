"""szo.prepare: one function per concern of preparing what a subspace run trains (the run-level
paths -- continual, fixed point, TT, mcu-zo's block selection -- are pinned in tests/test_pipeline.py)."""
import pytest
import torch

from subspace_store.variants import random_subspace
from szo.build import build_model, loaders_for, loss_for
from szo.config import HWConfig, load_recipe
from szo.hw.convert import FixedPointNetwork
from szo.prepare import conversion_check, fixed_point, load_bn_buffers, quantize_basis

TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "data.batch_size=32", "data.test_batch_size=120"]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_recipe("digits-scratch", TINY)
    return cfg, build_model(cfg)


def test_load_bn_buffers_loads_the_buffers_and_no_parameter(tiny):
    cfg, model = tiny
    other = build_model(cfg.replace(seed=1))
    state = {k: v + 1.0 if v.is_floating_point() else v for k, v in other.state_dict().items()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = build_model(cfg)
    load_bn_buffers(fresh, state)
    params = dict(fresh.named_parameters())
    assert all(torch.equal(params[n], before[n]) for n in before)
    buffers = dict(fresh.named_buffers())
    assert any(v.is_floating_point() for v in buffers.values())
    assert all(torch.equal(buffers[n], state[n]) for n in buffers)


def test_conversion_check_takes_each_reset_the_hw_section_names(tiny):
    """hw.reset 'subtract' is not among the four reference conversions: it is converted on its own
    (it once looked itself up among the four first and failed with a KeyError)."""
    cfg, model = tiny
    _, test = loaders_for(cfg, torch.Generator().manual_seed(0))
    test = [next(iter(test))]
    own = conversion_check(model, test, loss_for(cfg), HWConfig())
    assert set(own["arithmetics"]) == {"szo, reset=own", "szo, reset=zero", "loihi, reset=own", "loihi, reset=zero"}
    assert own["fixed_test_acc"] == own["arithmetics"]["szo, reset=own"]["test_acc"]
    sub = conversion_check(model, test, loss_for(cfg), HWConfig(reset="subtract"))
    assert sub["reset"] == "subtract" and 0.0 <= sub["fixed_test_acc"] <= 1.0
    assert sub["arithmetics"] == own["arithmetics"]


def test_fixed_point_and_quantize_basis_read_the_hw_section(tiny):
    _, model = tiny
    hw = HWConfig(weight_bits=6, arithmetic="loihi", basis_bits=4)
    assert isinstance(fixed_point(model, hw), FixedPointNetwork)
    sub = random_subspace(model.flat_params().detach(), 3, seed=0)
    assert quantize_basis(sub, hw.replace(basis_bits=None)) == (sub, None)
    q, err = quantize_basis(sub, hw)  # float learner: the run trains in the quantised subspace
    assert q is not sub and err == q.provenance["basis_quantization"]["rel_frobenius_error"] and err > 0
    same, err_int = quantize_basis(sub, hw.replace(learner="integer"))  # the integer learner quantises it itself
    assert same is sub and err_int == pytest.approx(err)
