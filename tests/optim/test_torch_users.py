"""What a PyTorch user does with an optimizer, pinned where szo's did otherwise (issue 48, items 3, 4, 6,
7, 9, 10, 11): per-group steps of tt-zo's sign phase, ``parametrize.cached()``, named parameters, a
tensor lr, sparse gradients and sparse parameters, all-frozen parameters and per-parameter state,
FullSpaceZO's added groups and its default coordinates with frozen parameters."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.utils.parametrize as P
from torch import nn

from szo.optim import SZO, BPSubspace, ForwardGradient, FullSpaceZO, HybridZO, build_optimizer

from .test_torch_contract import CASES, _method, flat, make, run
from .torch_infos import random_subspace


def _quadratic(model: nn.Module, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, model.in_features, generator=g)
    return lambda: model(x).pow(2).mean()


def _linear(seed: int = 0, n_in: int = 5, n_out: int = 3) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


# ---------------------------------------------------------------------- (3) tt-zo: each group's own lr
def _sign_opt(model, **kw) -> HybridZO:
    kw = {"lr": 1e-3, "sign_lr": 1e-3, "sign_q": 4, "sign_mu": 1e-2, "window": 1000, "momentum": 0.0,
          "generator": torch.Generator().manual_seed(0), **kw}
    return HybridZO(model.parameters() if "groups" not in kw else kw.pop("groups"), model=model, **kw)


def test_tt_sign_steps_follow_one_cycle_without_exceeding_sign_lr():
    """Under OneCycleLR (max_lr = the lr it was built with) the sign step rises to sign_lr and never past it;
    it was lr / initial_lr = 25 x sign_lr at the peak (OneCycleLR's initial_lr is max_lr / 25)."""
    model = _linear()
    opt = _sign_opt(model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=12)
    closure, steps = _quadratic(model), []
    for _ in range(12):
        before = flat(model)
        opt.step(closure)
        steps.append(float((flat(model) - before).abs().max()))
        sched.step()
    assert max(steps) <= 1e-3 * (1 + 1e-4)
    assert max(steps) >= 0.9e-3 and min(steps) < 0.2e-3  # it follows the cycle


def test_tt_a_group_at_lr_zero_does_not_move_and_others_keep_their_step():
    model = nn.Sequential(_linear(), nn.Linear(3, 2))
    opt = _sign_opt(model, groups=[{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.0}])
    x = torch.randn(8, 5)
    closure = lambda: model(x).pow(2).mean()  # noqa: E731
    frozen = [p.detach().clone() for p in model[1].parameters()]
    before = [p.detach().clone() for p in model[0].parameters()]
    opt.step(closure)
    assert all(torch.equal(p, q) for p, q in zip(model[1].parameters(), frozen))
    moved = max(float((p - q).abs().max()) for p, q in zip(model[0].parameters(), before))
    assert moved == pytest.approx(1e-3, rel=1e-4)
    opt.param_groups[0]["lr"] = 0.5e-3  # this group's lr alone halves this group's step
    before = [p.detach().clone() for p in model[0].parameters()]
    opt.step(closure)
    moved = max(float((p - q).abs().max()) for p, q in zip(model[0].parameters(), before))
    assert moved == pytest.approx(0.5e-3, rel=1e-4)
    assert all(torch.equal(p, q) for p, q in zip(model[1].parameters(), frozen))


def test_tt_the_tiny_default_lr_param_group_pattern_stays_finite():
    """torch's test_param_groups_lr builds ``opt([dict(params=[w, b], lr=1e-3), dict(params=[irrelevant])],
    lr=1e-28)``: the sign step of the trained group was sign_lr * 1e-3 / 1e-28 and the loss went to inf. Each
    group now steps by its own sign_lr at its own lr: the trained group by sign_lr, and the loss descends."""
    torch.manual_seed(0)
    weight, bias = nn.Parameter(torch.randn(10, 5)), nn.Parameter(torch.randn(10))
    irrelevant = nn.Parameter(torch.randn(2))
    inpt = torch.randn(5)
    opt = HybridZO([dict(params=[weight, bias], lr=1e-3), dict(params=[irrelevant])], lr=1e-28, sign_lr=1e-3,
                   sign_q=8, window=1000, momentum=0.0, generator=torch.Generator().manual_seed(0))
    loss = lambda: (weight.mv(inpt) + bias).pow(2).sum()  # noqa: E731
    initial = float(loss())
    for _ in range(20):
        w0 = weight.detach().clone()
        opt.step(loss)
        assert float((weight - w0).abs().max()) == pytest.approx(1e-3, rel=1e-4)
    assert torch.isfinite(weight).all() and float(loss()) < initial


def test_tt_a_state_of_before_per_group_sign_steps_loads():
    """A state dict without the groups' sign_lr / sign_lr_at (written before them) loads and steps."""
    model = _linear()
    opt = _sign_opt(model)
    opt.step(_quadratic(model))
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["sign_lr"], g["sign_lr_at"]
    opt2 = _sign_opt(model)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["sign_lr"] == 1e-3 and opt2.param_groups[0]["sign_lr_at"] == 1e-3
    opt2.step(_quadratic(model))


# ---------------------------------------------------------------------- (4) parametrize.cached()
class _Scaled(nn.Module):
    def forward(self, w):
        return 2.0 * w


def _parametrized():
    model = _linear()
    P.register_parametrization(model, "weight", _Scaled())
    return model


@pytest.mark.parametrize("method", ["szo-cge", "zo-rge"])
def test_a_step_inside_parametrize_cached_is_refused(method):
    """The cache would give every probe the weight of before the probe moved it (every estimate 0): refused
    in one line; ``cached()`` inside the closure is fine and trains."""
    model = _parametrized()
    kw = dict(lr=1e-2, mu=1e-2, generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(method, model, subspace=random_subspace(model) if method == "szo-cge" else None,
                          **({"scale": "absolute"} if method == "szo-cge" else {}), **kw)
    closure = _quadratic(model)
    before = flat(model)
    with P.cached(), pytest.raises(ValueError, match=r"^\w+\.step was called inside torch\.nn\.utils\.parametrize\."
                                                      r"cached\(\)[^\n]+outside cached\(\)"):
        opt.step(closure)
    assert torch.equal(flat(model), before)

    def cached_closure():
        with P.cached():
            return closure()
    opt.step(cached_closure)
    assert not torch.equal(flat(model), before)


def test_parametrize_cached_around_a_model_without_parametrizations_is_not_refused():
    model = _linear()
    opt = SZO(model, random_subspace(model), lr=1e-2, mu=1e-2)
    with P.cached():
        opt.step(_quadratic(model))


# ---------------------------------------------------------------------- (6) named parameters
def _build_named(cls, model, named: bool):
    params = model.named_parameters() if named else model.parameters()
    if cls in (SZO, BPSubspace):
        return cls(params, random_subspace(model), model=model, lr=1e-2, **({"mu": 1e-2} if cls is SZO else {}))
    if cls is ForwardGradient:
        return cls(params, model=model, lr=1e-3)
    return cls(params, model=model, lr=1e-3, mu=1e-3)


def _closure(opt, model):
    loss = _quadratic(model)
    if getattr(opt, "forward_only", False):
        return loss

    def backprop():
        opt.zero_grad()
        value = loss()
        value.backward()
        return value
    return backprop


@pytest.mark.parametrize("cls", [SZO, BPSubspace, FullSpaceZO, HybridZO, ForwardGradient])
def test_named_parameters_are_accepted_as_torch_accepts_them(cls):
    """``Optimizer(model.named_parameters(), ...)`` (torch >= 2.6): the groups keep ``param_names``, the
    state dict carries them, and the run equals the one over ``model.parameters()``; a state dict of either
    loads into the other."""
    model, model_u = _linear(), _linear()
    opt, opt_u = _build_named(cls, model, True), _build_named(cls, model_u, False)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    for _ in range(2):
        opt.step(_closure(opt, model))
        opt_u.step(_closure(opt_u, model_u))
    assert torch.equal(flat(model), flat(model_u))
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["weight", "bias"]
    opt_u.load_state_dict(copy.deepcopy(sd))
    opt.load_state_dict(copy.deepcopy(opt_u.state_dict()))
    opt.step(_closure(opt, model))
    opt_u.step(_closure(opt_u, model_u))
    assert torch.equal(flat(model), flat(model_u))


def test_named_parameters_mixed_with_plain_ones_are_refused_in_one_line():
    model = _linear()
    with pytest.raises(ValueError, match=r"^optimizer params must be all tensors or all \(name, tensor\) pairs"):
        SZO([("weight", model.weight), model.bias], random_subspace(model), model=model)


def test_named_parameters_leave_frozen_ones_out_with_their_names():
    model = _linear()
    model.weight.requires_grad_(False)
    opt = SZO(model.named_parameters(), random_subspace(model), model=model, lr=1e-2, mu=1e-2)
    assert opt.param_groups[0]["param_names"] == ["bias"]
    fz = FullSpaceZO(model.named_parameters(), model=model)
    assert fz.param_groups[0]["param_names"] == ["bias"]


# ---------------------------------------------------------------------- (7) a tensor lr
FLOAT_CASES = [c for c in CASES if "/integer" not in c and not _method(c).integer and c != "bp"]


@pytest.mark.parametrize("case", FLOAT_CASES)
def test_a_one_element_tensor_lr_steps_as_the_float(case):
    """``param_groups[i]["lr"]`` a tensor of shape [1] (a tensor-LR scheduler's, or the constructor's):
    the steps equal the float lr's; it crashed at the first step."""
    model, opt = make(case)
    model_t, opt_t = make(case)
    for g in opt_t.param_groups:  # float64: the same number as the float (a float32 tensor rounds 0.05)
        g["lr"] = torch.tensor([float(g["lr"])], dtype=torch.float64)
    assert run(model_t, opt_t, range(2)) == run(model, opt, range(2))
    assert torch.equal(flat(model_t), flat(model))


@pytest.mark.parametrize("cls", [SZO, FullSpaceZO, HybridZO])
def test_a_tensor_lr_in_the_constructor(cls):
    model, model_f = _linear(), _linear()
    kw = dict(mu=1e-2, generator=torch.Generator().manual_seed(0))
    sub = random_subspace(model)
    lr = torch.tensor([1e-2], dtype=torch.float64)
    opt = cls(model, sub, lr=lr, **kw) if cls is SZO else cls(model.parameters(), model=model, lr=lr, **kw)
    kw["generator"] = torch.Generator().manual_seed(0)
    opt_f = (cls(model_f, sub, lr=1e-2, **kw) if cls is SZO
             else cls(model_f.parameters(), model=model_f, lr=1e-2, **kw))
    for _ in range(2):
        opt.step(_quadratic(model))
        opt_f.step(_quadratic(model_f))
    assert torch.equal(flat(model), flat(model_f))
    with pytest.raises(ValueError, match=r"^lr as a tensor must be one floating-point element"):
        FullSpaceZO(model.parameters(), model=model, lr=torch.tensor([1e-2, 1e-2]))


def test_build_optimizer_refuses_a_tensor_lr_in_one_line():
    """The recipe settings are numbers: build_optimizer says so in one line (the classes take the tensor)."""
    model = _linear()
    with pytest.raises(ValueError, match=r"^'lr' must be float/int"):
        build_optimizer("zo-cge", model, lr=torch.tensor([0.01]))


# ---------------------------------------------------------------------- (9) sparse gradients, sparse parameters
def test_bp_subspace_takes_sparse_gradients_as_sgd_does():
    """``nn.Embedding(sparse=True)`` gives a sparse gradient: BPSubspace projects it as its dense values, the
    run equals the dense embedding's."""
    torch.manual_seed(0)
    sparse, dense = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3)
    dense.load_state_dict(sparse.state_dict())
    sub = random_subspace(sparse)
    opts = [BPSubspace(m, sub, lr=0.1, momentum=0.5) for m in (sparse, dense)]
    idx = torch.tensor([1, 2, 2, 7])
    for _ in range(3):
        for m, o in zip((sparse, dense), opts):
            o.zero_grad()
            m(idx).pow(2).sum().backward()
            o.step()
    assert sparse.weight.grad.is_sparse
    torch.testing.assert_close(sparse.weight, dense.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(sparse.weight, sub.reference.view(10, 3))


@pytest.mark.parametrize("cls", [SZO, BPSubspace, FullSpaceZO])
def test_sparse_layout_parameters_are_refused_in_one_line(cls):
    p = nn.Parameter(torch.randn(4, 3).to_sparse())
    sub = SimpleNamespace(basis=torch.linalg.qr(torch.randn(12, 2))[0], reference=None, layout=None,
                          eigenvalues=torch.ones(2))
    with pytest.raises(ValueError, match=r"^\w+: parameters of sparse_coo layout are not supported: [^\n]+$"):
        cls([p], sub) if cls is not FullSpaceZO else cls([p])


# ---------------------------------------------------------------------- (10) all frozen; per-parameter state
@pytest.mark.parametrize("cls", [SZO, BPSubspace, FullSpaceZO, HybridZO])
def test_an_all_frozen_optimizer_is_built_and_its_step_moves_nothing(cls):
    """torch's rule (three of its hook bodies build exactly this): the step runs the closure and moves nothing."""
    params = [torch.tensor([1.0, 1.0]), torch.tensor([2.0])]
    sub = SimpleNamespace(basis=torch.eye(3)[:, :2], reference=None, layout=None, eigenvalues=torch.ones(2))
    opt = cls(params, sub) if cls in (SZO, BPSubspace) else cls(params)
    calls = []
    loss = opt.step(lambda: calls.append(1) or torch.tensor(3.0))
    assert float(loss) == 3.0 and len(calls) == 1
    assert torch.equal(params[0], torch.tensor([1.0, 1.0])) and torch.equal(params[1], torch.tensor([2.0]))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


@pytest.mark.parametrize("case", [c for c in CASES if c != "bp"])
def test_optimizer_state_holds_a_step_count_for_every_trained_parameter(case):
    """``optimizer.state[p]`` after a step: an entry for every parameter the optimizer trains, none empty
    (torch's test_non_empty_state), with torch's per-parameter ``step`` count; it stays the same through a
    state dict."""
    model, opt = make(case)
    run(model, opt, range(2))
    trained = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    assert all(len(st) > 0 for st in opt.state.values())
    assert all(float(opt.state[p]["step"]) == 2.0 for p in trained)
    model2, opt2 = make(case)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(float(opt2.state[p]["step"]) == 2.0 for g in opt2.param_groups for p in g["params"] if p.requires_grad)


# ---------------------------------------------------------------------- (11) FullSpaceZO groups and frozen coords
@pytest.mark.parametrize("estimator", ["cge", "rge"])
def test_fullspace_add_param_group_trains_the_new_group(estimator):
    model = nn.Sequential(_linear(), nn.Linear(3, 2))
    x = torch.randn(8, 5)
    opt = FullSpaceZO(model[0].parameters(), model=model, lr=0.1, mu=1e-3, estimator=estimator, q=2, momentum=0.5)
    opt.step(lambda: model(x).pow(2).mean())
    opt.add_param_group({"params": model[1].parameters(), "lr": 0.05})
    before = [p.detach().clone() for p in model[1].parameters()]
    for _ in range(2):
        opt.step(lambda: model(x).pow(2).mean())
    assert all(not torch.equal(p, q) for p, q in zip(model[1].parameters(), before))
    assert opt.d == sum(p.numel() for p in model.parameters())


def test_zo_cge_default_coordinates_fit_the_trained_parameters():
    """``build_optimizer("zo-cge", model, subspace=sub)`` perturbs k coordinates a step -- at most the trained
    ones: with most parameters frozen, k > d was refused."""
    model = _linear()
    model.weight.requires_grad_(False)  # 3 trained coordinates, a subspace of k = 4 over all 18
    opt = build_optimizer("zo-cge", model, subspace=random_subspace(model, k=4), lr=0.1, mu=1e-3)
    assert opt.coords_per_step == 3 and opt.d == 3
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    opt.step(_quadratic(model))
    assert torch.equal(model.weight, w) and not torch.equal(model.bias, b)
