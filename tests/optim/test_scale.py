"""szo.scale: mu and lr of the subspace methods in the subspace's own units (szo.zo.scale)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from szo.optim import SZO, build_optimizer
from szo.zo import SubspaceSpace
from szo.zo.scale import SCALES, coordinate_scales, scale_record

from .test_szo import Tiny, data, flat, load, subspace_for


def scaled_subspace(model, k, seed=0):
    sub = subspace_for(model, k, seed)
    lam = torch.logspace(0, -3, k, dtype=torch.float64) * 4.0  # a trajectory's spread: 4 ... 4e-3
    return SimpleNamespace(basis=sub.basis, layout=sub.layout, eigenvalues=lam)


def test_absolute_is_the_identity_and_trajectory_comes_from_the_eigenvalues():
    lam = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)
    assert coordinate_scales(lam, "absolute") is None
    s = coordinate_scales(lam, "trajectory")
    assert s.dtype == torch.float64 and s.shape == (3,)
    assert bool((s > 0).all())
    assert scale_record("absolute", None) == {"rule": "absolute"}
    assert scale_record("trajectory", s)["units"] == [float(v) for v in s]


@pytest.mark.parametrize("lam", [torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")]), torch.tensor([])])
def test_bad_eigenvalues_are_refused_in_one_line(lam):
    with pytest.raises(ValueError, match="eigenvalues"):
        coordinate_scales(lam, "trajectory")


def test_unknown_scale_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="valid: " + ", ".join(SCALES)):
        coordinate_scales(torch.ones(2), "relative")
    model = Tiny().double()
    with pytest.raises(ValueError, match="unknown scale 'relative'"):
        SZO(model, scaled_subspace(model, 3), scale="relative")


def sigma(sub):
    return float(sub.eigenvalues.sum().sqrt())


def step_all(opts_models, x, y, n):
    for _ in range(n):
        for opt, model in opts_models:
            opt.step(lambda model=model: nn.functional.cross_entropy(model(x), y))


def test_first_step_has_length_lr_sigma_then_eq6_with_that_lr():
    """trajectory = absolute SZO-CGE at mu * sigma whose lr makes the first step lr * sigma long:
    lr_abs = lr * sigma**2 / |g_u| with g_u the first estimate in units (= sigma * |g_c|)."""
    torch.manual_seed(0)
    model, ref, start = Tiny().double(), Tiny().double(), Tiny().double()
    ref.load_state_dict(model.state_dict())
    start.load_state_dict(model.state_dict())
    sub = scaled_subspace(model, 4)
    sg = sigma(sub)
    x, y = data()
    x = x.double()
    a = SZO(model, sub, mu=0.3, lr=0.05, momentum=0.0, scale="trajectory", start="current")
    step_all([(a, model)], x, y, 1)
    torch.testing.assert_close(float((flat(model) - flat(start)).norm()), 0.05 * sg, rtol=1e-9, atol=0)
    unit = a.scale_info["gradient_unit"]
    assert a.scale_info["calibration_steps"] == 1 and a.scale_info["units"] == [sg] * 4
    b = SZO(ref, sub, mu=0.3 * sg, lr=0.05 * sg ** 2 / unit, momentum=0.0, scale="absolute", start="current")
    step_all([(b, ref)], x, y, 1)
    torch.testing.assert_close(flat(model), flat(ref), rtol=0, atol=1e-12)
    for opt in (a, b):
        opt.param_groups[0]["momentum"] = 0.9
    step_all([(a, model), (b, ref)], x, y, 4)
    torch.testing.assert_close(flat(model), flat(ref), rtol=0, atol=1e-12)
    assert a.scale_info["gradient_unit"] == unit  # set by the first step, then fixed


@pytest.mark.parametrize("estimator", ["rge", "one-point"])
def test_random_directions_probe_mu_sigma_long_and_calibrate_over_k_over_q_steps(estimator):
    model = Tiny().double()
    sub = scaled_subspace(model, 5)
    opt = SZO(model, sub, mu=0.3, lr=0.05, estimator=estimator, q=2, scale="trajectory", start="current")
    plan = opt.plan()
    assert plan.mu == pytest.approx(0.3 / 5 ** 0.5)  # a probe mu sigma z / sqrt(k): expected length mu sigma
    assert opt.calibration_steps == 3  # ceil(k / q) = ceil(5 / 2)
    assert opt.signal_fraction == pytest.approx((2 / (5 + 2 + 1)) ** 0.5)
    x, y = data()
    x = x.double()
    step_all([(opt, model)], x, y, 1)
    # the first step: the estimate normalised by its own length, times the signal fraction, times lr
    first = float(opt.subspace_state["delta"].norm())
    assert first == pytest.approx(0.05 * opt.signal_fraction, rel=1e-9)
    step_all([(opt, model)], x, y, 4)
    assert opt.scale_info["calibration_steps"] == 3


def test_a_zero_estimate_moves_nothing_and_leaves_the_calibration_open():
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    opt = SZO(model, sub, mu=0.3, lr=0.05, scale="trajectory", start="current")
    before = flat(model)
    opt.step(lambda: torch.tensor(1.0, dtype=torch.float64))  # a constant loss: every difference is 0
    assert torch.equal(flat(model), before)
    assert opt.scale_info["calibration_steps"] == 0 and opt.scale_info["gradient_unit"] == 0.0


def test_calibration_survives_a_checkpoint_and_absolute_state_keeps_its_keys():
    torch.manual_seed(0)
    x, y = data()
    x = x.double()
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    opt = SZO(model, sub, mu=0.3, lr=0.05, scale="trajectory", start="current")
    step_all([(opt, model)], x, y, 2)
    sd = opt.state_dict()
    assert sd["subspace"]["calibration"]["n"] == 1
    twin = Tiny().double()
    twin.load_state_dict(model.state_dict())
    again = SZO(twin, sub, mu=0.3, lr=0.05, scale="trajectory", start="current")
    again.load_state_dict(sd)
    step_all([(opt, model), (again, twin)], x, y, 2)
    assert torch.equal(flat(model), flat(twin))
    plain = SZO(Tiny().double(), sub, mu=1.0, lr=1.0, start="current", scale="absolute")
    assert "calibration" not in plain.state_dict()["subspace"]  # the paper's checkpoint format as it was


def test_absolute_leaves_the_space_bit_for_bit():
    model = Tiny()
    sub = subspace_for(model, 3, dtype=torch.float32)
    plain = SubspaceSpace(list(model.parameters()), sub.basis)
    opt = SZO(model, sub, scale="absolute", start="current")
    assert torch.equal(opt.space.basis_t, plain.basis_t)
    assert opt.units is None and opt.scale_info == {"rule": "absolute"}


def test_build_optimizer_passes_the_scale():
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    for method in ("szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt", "bp-subspace"):
        opt = build_optimizer(method, model, subspace=sub, lr=0.1, scale="trajectory", start="current")
        assert opt.scale == "trajectory", method


def test_tta_learning_rates_under_each_scale():
    """Unset TTA learning rates: App. G's 1.0 / 0.1 in absolute units; under a relative scale the
    method's relative lr for reset and a tenth of it for continual (App. G's ratio: on digits-c the
    reset lr in continual fell 4.7 points below the hand-tuned value, a tenth of it within 0.2)."""
    from szo.adapt.runner import TTAOptions
    from szo.methods import get_method

    rel = get_method("szo-cge").relative["train.lr"]
    o = TTAOptions(batch_size=8, out_dir=".", scale="trajectory")
    assert o.lr_of("szo-cge", "reset") == rel and o.lr_of("szo-cge", "continual") == pytest.approx(rel / 10)
    a = TTAOptions(batch_size=8, out_dir=".", scale="absolute")
    assert (a.lr_of("bp-subspace", "reset"), a.lr_of("bp-subspace", "continual")) == (1.0, 0.1)
    # scale unset: the method's default scale (trajectory for the subspace methods), as a recipe resolves it
    assert TTAOptions(batch_size=8, out_dir=".").lr_of("bp-subspace", "reset") == rel
    assert TTAOptions(batch_size=8, out_dir=".", scale="trajectory", lr_continual=0.5).lr_of("szo-rge", "continual") == 0.5


def test_build_optimizer_without_mu_takes_the_scales_default():
    """mu unset: the method's relative mu under a relative scale, App. G's 1.0 under absolute."""
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    rel = build_optimizer("szo-rge", model, subspace=sub, lr=0.03, scale="trajectory", start="current")
    ab = build_optimizer("szo-rge", model, subspace=sub, lr=0.03, scale="absolute", start="current")
    assert rel.param_groups[0]["mu"] == 0.3 and ab.param_groups[0]["mu"] == 1.0


def test_build_optimizer_with_nothing_set_takes_the_methods_default_scale():
    """scale / mu / lr unset: trajectory (mu 0.3, lr 0.03) for the relative methods, the same optimizer as
    with them spelled out; absolute (App. G) for a method without relative defaults; full-space BP needs lr."""
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    for method in ("szo-cge", "szo-rge", "bp-subspace"):
        opt = build_optimizer(method, model, subspace=sub, start="current")
        assert (opt.scale, opt.param_groups[0]["lr"]) == ("trajectory", 0.03)
        assert opt.scale_info["units"] == build_optimizer(method, model, subspace=sub, start="current", lr=0.03,
                                                           scale="trajectory").scale_info["units"]
    assert build_optimizer("szo-cge", model, subspace=sub, start="current").param_groups[0]["mu"] == 0.3
    zo = build_optimizer("zo-cge", model, subspace=sub)
    assert (zo.param_groups[0]["lr"], zo.param_groups[0]["mu"]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="needs lr= for method 'bp'"):
        build_optimizer("bp", model)
    with pytest.raises(ValueError, match="use scale 'absolute'"):  # a subspace without eigenvalues, e.g. a random one
        build_optimizer("szo-cge", model, subspace=SimpleNamespace(**{**vars(sub), "eigenvalues": torch.zeros(3)}))


def test_a_run_record_given_alone_is_used_as_it_is():
    """build_optimizer(run=RunOptions(...)) with no other keyword keeps the record: the parameters stay where
    they are (start current) and the generator given draws the directions, so an RGE run is reproducible."""
    from szo.optim import OptimizerOptions, RunOptions

    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    sub.reference = flat(model) + 1.0  # start="reference" would move the parameters here
    before = flat(model).clone()
    x, y = data()
    losses = []
    for _ in range(2):
        load(model, before)
        g = torch.Generator().manual_seed(7)
        opt = build_optimizer("szo-rge", model, subspace=sub, run=RunOptions(start="current", generator=g))
        assert torch.equal(flat(model), before) and opt.generator is g
        opt.step(lambda: nn.functional.cross_entropy(model(x.double()), y))
        losses.append(flat(model).clone())
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], before)
    # keywords fill the record that is not given; a keyword of a record that is given is refused
    load(model, before)
    opt = build_optimizer("szo-rge", model, subspace=sub, run=RunOptions(start="current"), mu=0.5)
    assert opt.param_groups[0]["mu"] == 0.5 and torch.equal(flat(model), before)
    with pytest.raises(ValueError, match=r"^build_optimizer got run= and the keyword\(s\) start of that record"):
        build_optimizer("szo-rge", model, subspace=sub, run=RunOptions(), start="current")
    with pytest.raises(ValueError, match=r"^build_optimizer got options= and the keyword\(s\) mu of that record"):
        build_optimizer("szo-rge", model, subspace=sub, options=OptimizerOptions(lr=0.1), mu=0.5, start="current")


@pytest.mark.parametrize("method, extra", [("zo-cge", {}), ("fg", {}), ("np-zo", {}),
                                           ("szo-cge", {"integer": {"basis_bits": 8}})])
@pytest.mark.parametrize("scale", ["trajectory", "whitened"])
def test_a_relative_scale_is_refused_where_the_recipe_refuses_it(method, extra, scale):
    """zo-cge, fg, np-zo (no relative defaults) and the integer learner (its own units) take no relative
    scale at build_optimizer, as the recipe schema refuses szo.scale there; absolute passes."""
    from szo.config import load_recipe

    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    with pytest.raises(ValueError, match=rf"^scale '{scale}' \(mu / lr in units of the subspace\) does not apply "
                                         r"here: .*use scale absolute \(or leave it unset"):
        build_optimizer(method, model, subspace=sub, scale=scale, start="current", **extra)
    if not extra:
        with pytest.raises(ValueError, match=rf"^szo.scale '{scale}' .* does not apply here"):
            load_recipe("digits-scratch", [f"method={method}", f"szo.scale={scale}"])
        build_optimizer(method, model, subspace=sub, scale="absolute")  # the paper's units: taken
