"""One rule book per learner, called by every door: a recipe (``szo.config``) and
``szo.optim.build_optimizer`` refuse the same combination with the same message (the rule's one home
is the method's record, ``szo.methods``), and the schema itself loads no torch."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from szo.config import load_recipe
from szo.optim import build_optimizer
from tests.optim.test_scale import Tiny, scaled_subspace


def _spelled_as_keywords(recipe_message: str) -> str:
    """A recipe's spelling of a rule's keys as build_optimizer's keywords spell them."""
    return (recipe_message.replace("szo.scale", "scale").replace("szo.refresh", "refresh")
            .replace("hw.learner integer", "integer=").replace("leave it null", "leave it unset")
            .replace(" null", " None"))


def _message(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


CASES = [
    # the integer learner keeps its quantised basis: no refresh
    ("digits-fixed", "szo-cge", ["method=szo-cge", "hw.learner=integer", "szo.refresh=10"], {"integer": {}, "refresh": 10}),
    # the integer learner trains only the methods whose record says so
    ("digits-fixed", "szo-1pt", ["method=szo-1pt", "hw.learner=integer"], {"integer": {}}),
    # a relative scale where the method has no relative defaults
    ("digits-scratch", "zo-cge", ["method=zo-cge", "szo.scale=trajectory"], {"scale": "trajectory"}),
    # a relative scale for the integer learner, whose units are its own
    ("digits-fixed", "szo-rge", ["method=szo-rge", "hw.learner=integer", "szo.scale=whitened"], {"integer": {}, "scale": "whitened"}),
]


@pytest.mark.parametrize("recipe_name, method, overrides, keywords", CASES, ids=[c[1] + "-" + c[2][-1] for c in CASES])
def test_a_recipe_and_build_optimizer_refuse_with_one_message(recipe_name, method, overrides, keywords):
    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    recipe = _message(lambda: load_recipe(recipe_name, overrides))
    optimizer = _message(lambda: build_optimizer(method, model, subspace=sub, start="current", **keywords))
    assert _spelled_as_keywords(recipe) == optimizer


def test_the_learner_rules_have_one_home():
    """The messages come from the record's rule, whichever door asked."""
    from szo.methods import get_method

    with pytest.raises(ValueError) as rule:
        get_method("szo-cge").check_learner(integer=True, refresh=10)
    model = Tiny().double()
    with pytest.raises(ValueError) as door:
        build_optimizer("szo-cge", model, subspace=scaled_subspace(model, 3), integer={}, refresh=10)
    assert str(rule.value) == str(door.value)


def test_import_schema_loads_no_torch():
    """``import szo.schema`` (the recipe sections, their checks) loads no torch and no module that does."""
    code = ("import sys, szo.schema, szo.methods, szo.vocab; "
            "print('torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('szo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False"), out


def test_the_schema_checks_a_registry_name_when_it_is_given():
    """The registries (models, data sets, losses) are read when a value is checked: a wrong name is still
    one clear error."""
    with pytest.raises(ValueError, match="invalid loss.name 'l2'; valid: tet, ce"):
        load_recipe("digits-scratch", ["loss.name=l2"])
    with pytest.raises(ValueError, match="invalid data.name 'mnist'; valid: digits"):
        load_recipe("digits-scratch", ["data.name=mnist"])
    with pytest.raises(ValueError, match="invalid model.name: unknown model 'resnet'"):
        load_recipe("digits-scratch", ["model.name=resnet"])
    assert isinstance(nn.Linear(1, 1).weight, torch.Tensor)


# ----------------------------------------------------------------------------- one default per setting
def _subspace(model):
    """A subspace with eigenvalues (the default scale's units) and a reference point (the default start)."""
    sub = scaled_subspace(model, 3)
    sub.reference = torch.nn.utils.parameters_to_vector(model.parameters()).detach() + 0.01
    return sub


def _first_step(make, seed=3):
    torch.manual_seed(0)
    model = Tiny().double()
    sub = _subspace(model)
    opt = make(model, sub, torch.Generator().manual_seed(seed))
    start = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(2))
    opt.step(lambda: nn.functional.cross_entropy(model(x), y))
    after = torch.nn.utils.parameters_to_vector(model.parameters())
    assert not torch.equal(after, start)  # a step was taken
    return opt, after


@pytest.mark.parametrize("method, estimator", [("szo-cge", "cge"), ("szo-rge", "rge"), ("szo-1pt", "one-point")])
def test_szo_and_build_optimizer_take_the_same_default_step(method, estimator):
    """``SZO(model, sub)`` and ``build_optimizer(method, model, subspace=sub)`` default to the same scale, mu
    and lr (the scale-free ones a recipe resolves to) and take the identical first step from one seed."""
    from szo.methods import get_method, step_defaults
    from szo.optim import SZO

    a, pa = _first_step(lambda m, s, g: SZO(m, s, estimator=estimator, generator=g))
    b, pb = _first_step(lambda m, s, g: build_optimizer(method, m, subspace=s, generator=g))
    assert torch.equal(pa, pb)
    group = lambda o: (o.scale, o.param_groups[0]["mu"], o.param_groups[0]["lr"])  # noqa: E731
    spec = get_method(method)
    # one place: the method's record (szo.methods), read by step_defaults for every door
    assert group(a) == group(b) == step_defaults([method]) == ("trajectory", spec.relative["szo.mu"],
                                                                 spec.relative["train.lr"])
    recipe = load_recipe("digits-scratch", [f"method={method}"])
    assert (recipe.szo.scale, recipe.szo.mu, recipe.train.lr) == group(a)


def test_the_papers_absolute_units_are_one_setting_away():
    from szo.optim import SZO, BPSubspace

    a, pa = _first_step(lambda m, s, g: SZO(m, s, generator=g, scale="absolute"))
    b, pb = _first_step(lambda m, s, g: build_optimizer("szo-cge", m, subspace=s, generator=g, scale="absolute"))
    assert (a.scale, a.param_groups[0]["mu"], a.param_groups[0]["lr"]) == ("absolute", 1.0, 1.0)  # App. G
    assert torch.equal(pa, pb)
    model = Tiny().double()
    sub = _subspace(model)
    bp, built = BPSubspace(model, sub), build_optimizer("bp-subspace", model, subspace=sub)
    assert (bp.scale, bp.param_groups[0]["lr"]) == (built.scale, built.param_groups[0]["lr"]) == ("trajectory", 0.03)


def test_a_subspace_without_eigenvalues_is_told_to_use_absolute_units():
    from types import SimpleNamespace

    from szo.optim import SZO

    model = Tiny().double()
    sub = scaled_subspace(model, 3)
    bare = SimpleNamespace(basis=sub.basis, layout=sub.layout)
    with pytest.raises(ValueError, match=r"^scale 'trajectory' \(the default.*needs the subspace's eigenvalues.*"
                                         r"pass scale='absolute'"):
        SZO(model, bare, start="current")
    assert SZO(model, bare, scale="absolute", start="current").param_groups[0]["mu"] == 1.0


# ----------------------------------------------------------------------------- refresh: a policy SZO holds
def test_szo_holds_its_subspace_policy():
    from szo.optim import SZO, Kept, Refreshed

    model = Tiny().double()
    sub = _subspace(model)
    kept = SZO(model, sub)
    assert isinstance(kept.policy, Kept) and kept.policy.subspace is sub and kept.refresh is None
    policy = Refreshed(sub, every=2)
    redrawn = SZO(model, policy)
    assert redrawn.policy is policy and redrawn.refresh == 2
    built = build_optimizer("szo-cge", model, subspace=sub, refresh=2)
    assert isinstance(built.policy, Refreshed) and built.policy.subspace is sub and built.policy.every == 2
    assert [policy.due(step, 0) for step in range(4)] == [False, False, True, True]


def test_q_has_one_default_per_kind_of_run_in_the_schema():
    """``szo.q`` left null: training's 1 (SZO(...), build_optimizer, a training recipe), test-time
    adaptation's 10 (a kind: tta recipe, run_tta, szo adapt's adapters): both from ``DEFAULT_Q``."""
    import inspect

    from szo.adapt.methods import AdaptOptions, SZOAdapt
    from szo.adapt.runner import TTAOptions
    from szo.optim import SZO
    from szo.schema import DEFAULT_Q, SZOConfig

    assert SZOConfig().q is None and DEFAULT_Q == {"train": 1, "tta": 10}
    assert load_recipe("digits-scratch", ["method=szo-rge"]).szo.q == DEFAULT_Q["train"]
    assert load_recipe("digits-c-tta", ["szo.q=null"]).szo.q == DEFAULT_Q["tta"]
    assert TTAOptions.q == AdaptOptions.q == inspect.signature(SZOAdapt).parameters["q"].default == DEFAULT_Q["tta"]
    assert inspect.signature(SZO).parameters["q"].default == DEFAULT_Q["train"]
    model = Tiny().double()
    assert build_optimizer("szo-rge", model, subspace=_subspace(model)).q == DEFAULT_Q["train"]


def test_szo_takes_at_most_twelve_settings():
    """The refresh is a policy passed as the subspace, not another keyword: SZO's constructor stays small."""
    import inspect

    from szo.optim import SZO

    assert len(inspect.signature(SZO.__init__).parameters) - 1 <= 12  # without self
