"""Loading optimizer state, for every registered method (issue 49, issue 48 item 5):

* a state is bound to the basis (and reference point) it was made on: loaded onto another basis of the
  same k and layout it is refused in one line (its coordinates would move along other directions);
* a load is all or nothing: every section is checked (shapes, dtypes, generator states such as a
  refreshed SZO's ``draw_state``, fingerprints) before anything changes, so a refused load leaves the
  model and the optimizer exactly as they were;
* torch's hook contract: load post hooks see the loaded state (szo's sections included), hooks may keep
  their own entries in ``optimizer.state``, pre hooks may return a new state dict (PyTorch's
  test_optim ``test_state_dict_pre_hook`` / ``..._post_hook`` / ``test_load_state_dict_pre_hook_and_prepend``
  / ``test_load_state_dict_post_hook`` / ``test_load_state_dict_pre_post_hook`` bodies, over the registry).

The cases (every method of ``szo.methods``, the integer learner's, the refreshed SZO's) and the tiny
model are those of tests/optim/test_torch_contract.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.test_torch_contract import (
    CASES,
    REFRESH,
    _integer,
    _method,
    build,
    flat,
    make,
    make_model,
    make_subspace,
    run,
    same,
    saved,
)

SUBSPACE_CASES = [c for c in CASES if _method(c).subspace]


def _other_basis(model, k: int = 3, seed: int = 5):
    sub = make_subspace(model, k)
    g = torch.Generator().manual_seed(seed)
    sub.basis = torch.linalg.qr(torch.randn(sub.basis.shape, generator=g, dtype=torch.float64))[0].float()
    return sub


# ---------------------------------------------------------------------- the basis a state belongs to
@pytest.mark.parametrize("case", SUBSPACE_CASES)
def test_a_state_made_on_another_basis_is_refused(case):
    """Issue 49.2: ``SZO.load_state_dict`` accepted a state saved on another basis with the same k and
    layout. The state carries the basis' fingerprint; the same basis (rounded differently: another
    device, float64 -> float32) loads, another one is refused, and nothing is changed."""
    model, opt = make(case)
    run(model, opt, range(2))
    state = saved(opt.state_dict())
    assert state[next(k for k in state if k not in ("state", "param_groups"))]["fingerprint"]["k"] == 3

    model2 = make_model(case, seed=7)
    opt2 = build(case, model2, _other_basis(make_model(case)))
    before, params = copy.deepcopy(opt2.state_dict()), flat(model2)
    with pytest.raises(ValueError, match=r"^optimizer state does not belong to this \w+'s subspace: it was made on "
                                         r"another basis \(same d = \d+ and k = 3, other directions: its fingerprint "
                                         r"differs by [0-9.e+-]+\); load it into an optimizer built on the subspace"):
        opt2.load_state_dict(state)
    same(opt2.state_dict(), before, case)
    assert torch.equal(flat(model2), params)

    sub = make_subspace(make_model(case))
    sub.basis = sub.basis.double().add(1e-7).float()  # the same directions to float rounding
    opt3 = build(case, make_model(case, seed=7), sub)
    opt3.load_state_dict(state)


@pytest.mark.parametrize("case", [c for c in SUBSPACE_CASES if not _integer(c)])
def test_a_state_made_at_another_reference_point_is_refused(case):
    """The reference point theta_0 (``subspace.reference``) is part of what the coordinates mean."""
    model, opt = make(case)
    run(model, opt, range(1))
    state = saved(opt.state_dict())
    sub = make_subspace(make_model(case))
    sub.reference = sub.reference + 0.5
    opt2 = build(case, make_model(case, seed=7), sub)
    with pytest.raises(ValueError, match=r"^optimizer state does not belong to .*: it was made at another reference "
                                         r"point theta_0"):
        opt2.load_state_dict(state)


# ---------------------------------------------------------------------- all or nothing
def _sections(state: dict) -> list[str]:
    return [k for k in state if k not in ("state", "param_groups")]


def _corruptions(case: str, state: dict):
    """``(section, key, bad value, must refuse)`` for every field of every section: a tensor of another
    shape, a generator state that is not one, a value of the wrong type."""
    for sec in _sections(state):
        for key, v in state[sec].items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.uint8:  # a torch.Generator state
                yield sec, key, torch.zeros(7, dtype=torch.uint8), True
            elif isinstance(v, torch.Tensor):
                yield sec, key, torch.zeros(*(n + 1 for n in v.shape), dtype=v.dtype), True
            elif isinstance(v, int) and not isinstance(v, bool):
                yield sec, key, "many", True
            elif key == "refresh":
                yield sec, key, {**v, "draw_state": torch.zeros(7, dtype=torch.uint8)}, True
            elif key == "fingerprint":
                yield sec, key, {**v, "basis": [b + 1.0 for b in v["basis"]]}, True
            elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v):
                yield sec, key, [t[..., :0] for t in v], True
            else:
                yield sec, key, object(), False


@pytest.mark.parametrize("case", CASES)
def test_a_refused_load_changes_nothing(case):
    """Issue 49.6: a refreshed optimizer's state with a corrupt ``draw_state`` raised torch's RuntimeError
    after the parameters and the coordinates had been overwritten. Each field of each section is
    corrupted in turn (in the state of a run two steps ahead, so that a half-applied load would show):
    every one that is refused is refused in one ValueError line, and the optimizer's state dict, the
    model's parameters and buffers are exactly what they were."""
    model, opt = make(case)
    run(model, opt, range(2))
    good = saved(opt.state_dict())
    model2, opt2 = make(case, seed=7)
    run(model2, opt2, range(1))
    before, weights = copy.deepcopy(opt2.state_dict()), copy.deepcopy(model2.state_dict())
    refused = 0
    for sec, key, bad, must in _corruptions(case, good):
        state = copy.deepcopy(good)
        state[sec] = {**state[sec], key: bad}
        first = state["param_groups"][0]["params"][0]
        state["state"][first] = {**state["state"][first], sec: state[sec]}
        try:
            opt2.load_state_dict(state)
        except ValueError as e:
            refused += 1
            assert "\n" not in str(e) and str(e).startswith("optimizer state"), (key, str(e))
            same(opt2.state_dict(), before, f"{case} after a refused {sec}.{key}")
            for name, t in model2.state_dict().items():
                assert torch.equal(t, weights[name]), f"{case}: {name} changed by a refused {sec}.{key}"
            continue
        assert not must, f"{case}: a corrupt {sec}.{key} was loaded"
        opt2.load_state_dict(before)  # accepted (a free-form field): back to where the next try starts
        model2.load_state_dict(weights)
    assert refused or not _sections(good), case
    if case.endswith(REFRESH):  # the case: the generator state the current basis is redrawn from
        state = copy.deepcopy(good)
        state["subspace"]["refresh"]["draw_state"] = torch.zeros(7, dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"^optimizer state: subspace.refresh.draw_state is not a state of a "
                                             r"torch.Generator on cpu"):
            opt2.load_state_dict(state)


@pytest.mark.parametrize("case", CASES)
def test_a_state_dict_that_is_not_one_is_refused_in_one_line(case):
    model, opt = make(case)
    if not (_method(case).forward_only or _method(case).subspace):
        pytest.skip("torch's own optimizer (SGD): torch's messages")
    for bad in ([1, 2], {"state": {}}):
        with pytest.raises(ValueError, match=r"^(\w+.load_state_dict takes a state dict|optimizer state dict lacks)"):
            opt.load_state_dict(bad)


# ---------------------------------------------------------------------- torch's hook contract (issue 48.5)
def _state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer, state_dict):
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _load_state_dict_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer, state_dict):
    my_state_dict = copy.deepcopy(state_dict)
    my_state_dict["param_groups"][0]["lr"] = 0.003
    return my_state_dict


def _load_state_dict_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("case", CASES)
def test_torch_state_dict_hook_bodies(case):
    """PyTorch's test_optim hook bodies: they ended in ``AttributeError: 'int' object has no attribute
    'items'`` for every forward-only method (a hook's own entry in ``optimizer.state``)."""
    model, opt = make(case)
    opt.register_state_dict_pre_hook(_state_dict_pre_hook)
    assert opt.state_dict()["state"]["test"] == 1
    model, opt = make(case)
    opt.register_state_dict_post_hook(_state_dict_post_hook)
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False
    model, opt = make(case)
    opt.register_state_dict_pre_hook(_state_dict_pre_hook)
    opt.register_state_dict_post_hook(_state_dict_post_hook)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    opt.load_state_dict(sd)  # the live state keeps the hook's own entry "test": 1
    run(model, opt, range(1))

    model, opt = make(case)
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002

    for pre in (False, True):
        model, opt = make(case)
        if pre:
            opt.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
        opt.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"] is pre
        assert opt.state["ran_load_state_dict_post_hook"] is True
        run(model, opt, range(1))
        opt.load_state_dict(opt.state_dict())  # a state holding the hooks' entries loads again


@pytest.mark.parametrize("case", CASES)
def test_load_post_hooks_see_the_loaded_state(case):
    """Issue 48.5: the post hooks ran before szo's own sections were decoded and saw the old state."""
    model, opt = make(case)
    run(model, opt, range(2))
    state = saved(opt.state_dict())
    model2, opt2 = make(case, seed=7)
    seen = {}
    opt2.register_load_state_dict_post_hook(lambda o: seen.update(state=copy.deepcopy(o.state_dict()),
                                                                  params=flat(model2)))
    opt2.load_state_dict(state)
    same(seen["state"], opt2.state_dict(), case)
    same(seen["state"], opt.state_dict(), case)
    assert torch.equal(seen["params"], flat(model2))


@pytest.mark.parametrize("method", ["zo-cge", "zo-rge", "fg", "bp-subspace", "fg-subspace"])
def test_a_refreshed_subspace_for_a_method_that_does_not_redraw_is_one_line(method):
    """Issue 49.7: ``build_optimizer("zo-cge", model, subspace=Refreshed(...))`` raised an AttributeError."""
    from szo.optim import Refreshed, build_optimizer

    model = make_model("szo-cge")
    with pytest.raises(ValueError, match=r"^a Refreshed subspace \(a basis redrawn every few steps\) is trained by the "
                                         rf"float learner of szo-cge, .*; method '{method}' does not redraw a basis: "
                                         r"pass Refreshed\(...\).subspace"):
        build_optimizer(method, model, subspace=Refreshed(make_subspace(model), 3), lr=0.1, mu=0.1, scale="absolute")
