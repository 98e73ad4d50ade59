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
