"""PyTorch's generic optimizer bodies over every trainable method of the registry (issue 48).

PyTorch tests each ``torch.optim`` optimizer with the generic bodies of ``TestOptimRenewed`` in its
``test/test_optim.py``, each driven by an ``OptimizerInfo`` (read from PyTorch's repository in the
version with the named-parameter bodies, torch >= 2.6; torch 2.14.1 is installed here). This file runs
the same bodies -- the same names, parameters, losses and assertions, written for pytest; the
Rosenbrock body runs 300 of its 1800 steps -- over the ``OptimizerInfo`` records of
``tests/optim/torch_infos.py``: one per method of ``szo.methods``, built with ``build_optimizer``. Where PyTorch's body computes a gradient with
``backward``, a forward-only method gets the same loss without it (its step probes the loss); the
assertions are unchanged. ``bp`` (``torch.optim.SGD``) runs every body as the control.

Every (body, method) pair a forward-only or subspace optimizer cannot run is in
:data:`NOT_APPLICABLE`, with the reason, and reported as a skip; no pair is dropped silently.
The PyTorch bodies that only exist for CUDA, for the foreach / fused kernels or for LBFGS's
tolerances are listed in :data:`TORCH_ONLY` with the reason none of them can apply here.

The bodies are written here, not copied (PyTorch's file is BSD-licensed; this project keeps other
projects' code out of its tree): they follow PyTorch's as published. A body that fails for a method is
a defect of that method (issue 48 lists those fixed), not a changed body. The pairs another change of
issue 48 fixes would be marked xfail in :data:`OWNED_ELSEWHERE` (empty: all of them landed).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from szo.methods import get_method, list_methods

from .torch_infos import INFOS, OptimizerErrorEnum

METHODS = list(INFOS)
FLOAT_PARAMS = ("bp", "bp-subspace", "szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt", "zo-cge", "zo-rge")
"""The methods that train any float tensors given to them (a list of tensors, as the bodies pass)."""
GROUPS = ("bp", "zo-cge", "zo-rge")
"""The methods that take param groups of their own (a subspace method moves one point: one group)."""

_MODEL_FORWARD = ("its step runs the model's own forward ({how}); this body computes its loss from bare tensors "
                  "outside any module")
_WHY_NOT_FLOAT_PARAMS = {
    "fg": _MODEL_FORWARD.format(how="forward-mode AD with dual tensors swapped into the model's parameters"),
    "fg-subspace": _MODEL_FORWARD.format(how="forward-mode AD with dual tensors swapped into the model's parameters"),
    "asyncfgd": _MODEL_FORWARD.format(how="its child modules cut into pipeline stages"),
    "asyncfgd-adam": _MODEL_FORWARD.format(how="its child modules cut into pipeline stages"),
    "np-zo": _MODEL_FORWARD.format(how="hooks on its linear / convolution layers"),
    "wp-zo": _MODEL_FORWARD.format(how="hooks on its linear / convolution layers"),
    "awp-zo": _MODEL_FORWARD.format(how="hooks on its linear / convolution layers"),
    "tt-zo": "it trains the cores of a TT-parameterised model (szo.models.tt); tests/optim/test_torch_users.py "
             "runs this body's param-group pattern on HybridZO itself",
    "qzo-subspace": "the integer on-chip learner trains the fixed-point integers of a to_fixed model",
    "mcu-zo": "seed 004's integer learner trains the int8 weights of a to_fixed model's layers",
}
_WHY_MODULE = {m: why for m, why in _WHY_NOT_FLOAT_PARAMS.items() if m in ("tt-zo", "qzo-subspace", "mcu-zo")}
_ONE_GROUP = ("a subspace method moves one point theta_0 + P c with one lr (param groups are refused in one line: "
              "tests/optim/test_torch_contract.py)")

# (body, method) -> why it cannot apply: the one list of what is not run
NOT_APPLICABLE: dict[tuple[str, str], str] = {}
for _body in ("goes_right_direction", "tensor_lr", "step_is_noop_when_params_have_no_grad",
              "step_is_noop_for_zero_grads", "optimizer_can_be_printed", "state_dict_deterministic",
              "save_load_equality_with_weights_only", "load_nontensor_step", "state_dict_hooks",
              "load_state_dict_hooks", "step_hooks", "deepcopy_copies_all_public_attrs", "errors"):
    for _m, _why in _WHY_NOT_FLOAT_PARAMS.items():
        NOT_APPLICABLE[(_body, _m)] = _why
for _body in ("param_group_with_lrscheduler_goes_right_direction", "param_groups_lr"):
    for _m in METHODS:
        if _m not in GROUPS:
            NOT_APPLICABLE[(_body, _m)] = _WHY_NOT_FLOAT_PARAMS.get(_m, _ONE_GROUP)
for _body in ("can_load_older_state_dict", "can_load_from_to_named_state_dict", "non_empty_state"):
    for _m, _why in _WHY_MODULE.items():
        NOT_APPLICABLE[(_body, _m)] = _why
for _m in METHODS:
    if _m not in ("bp", "bp-subspace"):
        NOT_APPLICABLE[("rosenbrock_sparse", _m)] = (
            "the body's sparse gradients come from backward and drive the step; a forward-only step reads the loss "
            "only" if get_method(_m).forward_only else "it takes no gradient a body could make sparse")
for _m in METHODS:
    NOT_APPLICABLE[("param_groups_weight_decay", _m)] = (
        "the body trains with weight_decay in a group; szo's methods take none (the registry: weight_decay only for "
        "bp), refused in one line" if _m != "bp" else "SGD's own: PyTorch runs it")
    NOT_APPLICABLE[("complex", _m)] = (
        "complex parameters are refused in one line (szo's probes, subspaces and updates are real: "
        "tests/optim/test_torch_contract.py::test_complex_parameters_are_refused_in_one_line)")

NOT_APPLICABLE[("non_empty_state", "asyncfgd")] = NOT_APPLICABLE[("non_empty_state", "asyncfgd-adam")] = (
    "the body's model is one nn.Linear, and AsyncFGD cuts a model's child modules into pipeline stages: a module "
    "without children is refused in one line")

# (body, method) -> the issue-48 item another helper fixes: run, and expected to fail until that fix is merged
# (not strict: they pass once it is)
#: pairs whose fix belongs to other work, run as xfail (not strict); empty since issue 48 item 5 (the
#: load_state_dict hook order) landed: every body runs and must pass
OWNED_ELSEWHERE: dict[tuple[str, str], str] = {}

TORCH_ONLY = {
    "test_optim_infos_do_not_specify_global_cliquey_kwargs": "checks torch's own optim_db entries (no foreach / fused / "
                                                            "differentiable flags in szo's records: asserted below)",
    "test_forloop_goes_right_direction_multigpu": "CUDA, two GPUs",
    "test_complex_2d": "complex parameters, refused (see NOT_APPLICABLE['complex'])",
    "test_foreach_matches_forloop": "no foreach implementation",
    "test_mixed_device_dtype": "CUDA, two GPUs; foreach / fused",
    "test_set_default_dtype_works_with_foreach": "CUDA; foreach",
    "test_foreach_large_tensor": "CUDA; foreach",
    "test_peak_memory_foreach": "CUDA; foreach",
    "test_fused_matches_forloop": "no fused implementation",
    "test_fused_error_on_params_on_meta": "no fused implementation",
    "test_fused_large_tensor": "no fused implementation",
    "test_fused_does_not_step_if_foundinf": "CUDA; fused",
    "test_cpu_load_state_dict": "CUDA; fused / capturable",
    "test_state_dict_with_cuda_params": "CUDA",
    "test_second_order_optims_return_consistent_types": "LBFGS's tolerance_grad",
    "test_fused_cpu_matches_cuda": "CUDA; fused",
    "test_defaults_changed_to_foreach": "CUDA; foreach",
}


def applicable(body: str, method: str, request=None, owned: str | None = None) -> None:
    """Skip a pair of :data:`NOT_APPLICABLE` with its reason; mark a pair of :data:`OWNED_ELSEWHERE` xfail."""
    why = NOT_APPLICABLE.get((body, method))
    if why is not None:
        pytest.skip(f"not applicable to {method}: {why}")
    elsewhere = OWNED_ELSEWHERE.get((owned or body, method))
    if elsewhere is not None and request is not None:
        request.node.add_marker(pytest.mark.xfail(reason=elsewhere, strict=False))


def case(body: str):
    """Parametrize a body over every method (``body``: its key in :data:`NOT_APPLICABLE`)."""
    return pytest.mark.parametrize("method", METHODS)


def info(method: str):
    return INFOS[method]


def closure_for(opt, loss_fn, method: str, sparse: bool = False):
    """The body's closure: ``zero_grad``, ``backward``, the loss (``bp``, ``bp-subspace``), or the loss
    alone (a forward-only step evaluates it at its probes); a per-sample learner gets the per-sample losses."""
    if get_method(method).forward_only:
        if getattr(opt, "loss_reduction", "mean") == "none":
            return lambda: loss_fn(per_sample=True)
        return lambda: loss_fn()

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss
    return closure


def step(opt, closure):
    return opt.step(closure)


def quadratic(weight, bias, inpt):
    def loss(per_sample: bool = False):
        out = (weight.mv(inpt) + bias).pow(2)
        return out if per_sample else out.sum()
    return loss


# ---------------------------------------------------------------------- the bodies
def test_infos_do_not_specify_global_cliquey_kwargs():
    for m, oi in INFOS.items():
        for inp in oi.optim_inputs_func(device="cpu"):
            assert not any(f in inp.kwargs for f in ("foreach", "fused", "differentiable")), m


@case("errors")
def test_errors(method):
    applicable("errors", method)
    oi = info(method)
    for err in oi.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        inp = err.optimizer_error_input
        params = [Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))]
        assert err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
        with pytest.raises(err.error_type, match=err.error_regex):
            oi.optim_cls(params, **inp.kwargs)


def _descends(opt, schedulers, weight, bias, inpt, method):
    """The bodies' check: 20 steps (each scheduler stepped after each, ReduceLROnPlateau with the loss)
    lower the quadratic loss."""
    closure = closure_for(opt, quadratic(weight, bias, inpt), method)
    with torch.no_grad():
        initial = float(quadratic(weight, bias, inpt)())
    for _ in range(20):
        loss = step(opt, closure)
        for s in schedulers:
            s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
    with torch.no_grad():
        assert float(quadratic(weight, bias, inpt)()) < initial


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
@case("goes_right_direction")
def test_forloop_goes_right_direction(method, contiguous, with_lrsched):
    applicable("goes_right_direction", method)
    oi = info(method)
    for scheds in (oi.scheduler_inputs if with_lrsched else [None]):
        for inp in oi.optim_inputs_func(device="cpu"):
            torch.manual_seed(0)
            if contiguous:
                weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
            else:
                weight, bias = Parameter(torch.randn(10, 5, 2)[..., 0]), Parameter(torch.randn(10, 2)[..., 0])
            inpt = torch.randn(5)
            opt = oi.optim_cls([weight, bias], **inp.kwargs)
            _descends(opt, [s(opt) for s in (scheds or [])], weight, bias, inpt, method)


@case("param_group_with_lrscheduler_goes_right_direction")
def test_param_group_with_lrscheduler_goes_right_direction(method):
    applicable("param_group_with_lrscheduler_goes_right_direction", method)
    oi = info(method)
    for scheds in oi.scheduler_inputs:
        torch.manual_seed(0)
        weight, bias, inpt = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)
        opt = oi.optim_cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        _descends(opt, [s(opt) for s in scheds], weight, bias, inpt, method)


@case("tensor_lr")
def test_tensor_lr(method):
    """A one-element tensor lr steps as the same float does (torch's tensor-LR path: the group's lr a
    tensor, as a body's ``lr=torch.tensor(...)`` or a tensor-LR scheduler leaves it)."""
    applicable("tensor_lr", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        torch.manual_seed(0)
        weight, bias, inpt = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)
        weight_c, bias_c = Parameter(weight.detach().clone()), Parameter(bias.detach().clone())
        kwargs = {**inp.kwargs, "lr": 2.0 ** -10}  # exact in float32: the tensor lr is the same number
        opt_r = oi.optim_cls([weight, bias], **kwargs)
        opt = oi.optim_cls([weight_c, bias_c], **kwargs)
        for g in opt.param_groups:
            g["lr"] = torch.tensor([float(g["lr"])])
        for _ in range(5):
            step(opt_r, closure_for(opt_r, quadratic(weight, bias, inpt), method))
            step(opt, closure_for(opt, quadratic(weight_c, bias_c, inpt), method))
            torch.testing.assert_close(weight, weight_c)
            torch.testing.assert_close(bias, bias_c)


def _rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


def _drosenbrock(t):
    x, y = t
    return torch.stack((-400 * x * (y - x ** 2) - 2 * (1 - x), 200 * (y - x ** 2)))


@case("rosenbrock_sparse")
def test_rosenbrock_sparse(method):
    """Cyclic coordinate descent with uncoalesced sparse gradients equals the dense run and gets closer."""
    applicable("rosenbrock_sparse", method)
    oi = info(method)
    params = [Parameter(torch.tensor([1.5, 1.5], dtype=torch.float64))]
    params_c = [Parameter(torch.tensor([1.5, 1.5], dtype=torch.float64))]
    kwargs = {"lr": 1e-4} if method == "bp" else {"lr": 1e-4, "momentum": 0.0}
    opt, opt_c = oi.optim_cls(params, **kwargs), oi.optim_cls(params_c, **kwargs)
    solution = torch.tensor([1.0, 1.0], dtype=torch.float64)
    initial = float(params[0].detach().dist(solution))

    def closure(o, ps, sparse, w):
        o.zero_grad()
        loss = _rosenbrock(ps[0])
        loss.backward()
        grad = _drosenbrock(ps[0].detach())
        if sparse:
            i = torch.tensor([[0, 0]] if w else [[1, 1]])
            v = torch.stack([grad[0] / 4, grad[0] - grad[0] / 4]) if w else torch.stack([grad[1] - grad[1] / 4,
                                                                                         grad[1] / 4])
            g = torch.sparse_coo_tensor(i, v, (2,))
        else:
            g = torch.stack([grad[0], grad[0] * 0]) if w else torch.stack([grad[1] * 0, grad[1]])
        ps[0].grad = g
        return loss

    for i in range(300):
        opt.step(lambda: closure(opt, params, True, i % 2))
        opt_c.step(lambda: closure(opt_c, params_c, False, i % 2))
        torch.testing.assert_close(params[0], params_c[0], atol=5e-6, rtol=5e-6)
    assert float(params[0].detach().dist(solution)) <= initial


@case("param_groups_lr")
def test_param_groups_lr(method):
    """Groups at their own lr: the trained group descends, a group at lr 1e-28 does not move."""
    applicable("param_groups_lr", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        kwargs = dict(inp.kwargs)
        kwargs.setdefault("lr", 1e-3)
        torch.manual_seed(0)
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        irrelevant = Parameter(torch.randn(2))
        irrelevant_clone = irrelevant.detach().clone()
        inpt = torch.randn(5)
        opt = oi.optim_cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28)
        loss_fn = quadratic(weight, bias, inpt)
        with torch.no_grad():
            initial = float(loss_fn())
        for _ in range(20):
            if get_method(method).forward_only:
                opt.step(loss_fn)
            else:
                def closure():
                    opt.zero_grad()
                    loss = loss_fn()
                    loss.backward()
                    irrelevant.grad = torch.rand_like(irrelevant)
                    return loss
                opt.step(closure)
        with torch.no_grad():
            assert float(loss_fn()) < initial
        torch.testing.assert_close(irrelevant, irrelevant_clone)


@case("step_is_noop_when_params_have_no_grad")
def test_step_is_noop_when_params_have_no_grad(method):
    """Every parameter frozen: the optimizer is built and its step moves nothing (torch's rule)."""
    applicable("step_is_noop_when_params_have_no_grad", method)
    oi = info(method)
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old = [p.clone() for p in params]
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(params, **inp.kwargs)
        opt.step(lambda: torch.tensor([1.0]))
        assert all(torch.equal(p, q) for p, q in zip(params, old))


@case("step_is_noop_for_zero_grads")
def test_step_is_noop_for_zero_grads(method):
    """Zero gradients and a constant loss: the step moves nothing (a forward-only step: every probe's loss
    is the same, so the estimate is zero)."""
    applicable("step_is_noop_for_zero_grads", method)
    oi = info(method)
    param = Parameter(torch.randn(5, 1))
    old = param.detach().clone()
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls([param], **inp.kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        assert torch.equal(param, old)


@case("optimizer_can_be_printed")
def test_optimizer_can_be_printed(method):
    applicable("optimizer_can_be_printed", method)
    oi = info(method)
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for inp in oi.optim_inputs_func(device="cpu"):
        assert repr(oi.optim_cls(params, **inp.kwargs))


def _named(params, named: bool):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_names(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def _equal(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _equal(u, v, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, msg=path)
    else:
        assert a == b, path


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
@case("state_dict_deterministic")
def test_state_dict_deterministic(method, named0, named1):
    """A state dict loaded into an optimizer over equal (not identical) parameters continues as the original."""
    applicable("state_dict_deterministic", method)
    oi = info(method)
    torch.manual_seed(0)
    weight, bias, inpt = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(_named([weight, bias], named0), **inp.kwargs)
        closure = closure_for(opt, quadratic(weight, bias, inpt), method)
        for _ in range(10):
            opt.step(closure)
        with torch.no_grad():
            weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
        opt_c = oi.optim_cls(_named([weight_c, bias_c], named1), **inp.kwargs)
        closure_c = closure_for(opt_c, quadratic(weight_c, bias_c, inpt), method)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            opt.step(closure)
            opt_c.step(closure_c)
            torch.testing.assert_close(weight, weight_c)
            torch.testing.assert_close(bias, bias_c)
        _equal(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        opt_c.param_groups.extend(opt_c.param_groups)
        _equal(_without_names(opt.state_dict())["param_groups"][-1],
               _without_names(opt_c.state_dict())["param_groups"][-1])


def _conv_bn():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(4, 2, 1, stride=2), nn.BatchNorm2d(2, eps=1e-5, momentum=0.1))


def _module_closure(opt, model, inpt, method):
    def loss(per_sample: bool = False):
        out = model(inpt)
        return out.flatten(1).sum(1) if per_sample else out.sum()
    return closure_for(opt, loss, method)


@case("can_load_older_state_dict")
def test_can_load_older_state_dict(method):
    """A state dict without the flags added since (none for szo's records) loads, and the optimizer steps."""
    applicable("can_load_older_state_dict", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        model = _conv_bn()
        inpt = torch.rand(1, 4, 16, 16)
        opt = oi.optim_cls.build_on(model, **inp.kwargs)
        for _ in range(3):
            opt.step(_module_closure(opt, model, inpt, method))
        old = copy.deepcopy(opt.state_dict())
        for g in old["param_groups"]:
            for flag in oi.not_og_supported_flags:
                g.pop(flag, None)
        opt.load_state_dict(old)
        opt.step(_module_closure(opt, model, inpt, method))


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
@case("can_load_from_to_named_state_dict")
def test_can_load_from_to_named_state_dict(method, named0, named1):
    applicable("can_load_from_to_named_state_dict", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        model = _conv_bn()
        inpt = torch.rand(1, 4, 16, 16)
        opt = oi.optim_cls.build_on(model, **inp.kwargs)
        if named0:
            opt.param_groups[0]["param_names"] = [n for n, _ in model.named_parameters()]
        for _ in range(3):
            opt.step(_module_closure(opt, model, inpt, method))
        old = copy.deepcopy(opt.state_dict())
        opt2 = oi.optim_cls.build_on(model, **inp.kwargs)
        if named1:
            opt2.param_groups[0]["param_names"] = [n for n, _ in model.named_parameters()]
        opt2.load_state_dict(old)
        opt2.step(_module_closure(opt2, model, inpt, method))
        if named0 or named1:
            assert opt2.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("named", [True, False])
@case("save_load_equality_with_weights_only")
def test_save_load_equality_with_weights_only(method, named):
    applicable("save_load_equality_with_weights_only", method)
    oi = info(method)
    torch.manual_seed(0)
    weight, bias, inpt = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(_named([weight, bias], named), **inp.kwargs)
        closure = closure_for(opt, quadratic(weight, bias, inpt), method)
        for _ in range(3):
            opt.step(closure)
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        _equal(torch.load(buf, weights_only=True), sd)


@case("load_nontensor_step")
def test_load_nontensor_step(method):
    """A state dict whose per-parameter ``step`` is a number, not a tensor, loads and steps."""
    applicable("load_nontensor_step", method)
    oi = info(method)
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    loss = torch.rand(1)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(params, **inp.kwargs)
        for _ in range(3):
            opt.step(lambda: loss)
        sd = copy.deepcopy(opt.state_dict())
        for st in sd["state"].values():
            if "step" in st and torch.is_tensor(st["step"]):
                st["step"] = st["step"].item()
        opt.load_state_dict(sd)
        opt.step(lambda: loss)


def _sd_pre_hook(opt):
    opt.state["test"] = 1


def _sd_post_hook(opt, sd):
    if "test" in sd["state"]:
        sd["state"].pop("test")
        sd["ran_state_dict_pre_hook"] = True
    else:
        sd["ran_state_dict_pre_hook"] = False
    return sd


@pytest.mark.parametrize("hooks", ["pre", "post", "pre-post"])
@case("state_dict_hooks")
def test_state_dict_hooks(method, hooks):
    applicable("state_dict_hooks", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls([torch.rand(2, 3, requires_grad=True)], **inp.kwargs)
        if "pre" in hooks:
            opt.register_state_dict_pre_hook(_sd_pre_hook)
        if "post" in hooks:
            opt.register_state_dict_post_hook(_sd_post_hook)
        sd = opt.state_dict()
        if hooks == "pre":
            assert sd["state"]["test"] == 1
        elif hooks == "post":
            assert sd["ran_state_dict_pre_hook"] is False
        else:
            assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True


def _load_pre_hook1(opt, sd):
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt, sd):
    sd = copy.deepcopy(sd)
    sd["param_groups"][0]["lr"] = 0.003
    return sd


def _load_post_hook(opt):
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("hooks", ["pre-and-prepend", "post", "pre-post"])
@case("load_state_dict_hooks")
def test_load_state_dict_hooks(method, hooks, request):
    applicable("load_state_dict_hooks", method, request,
               owned="load_state_dict_post_hooks" if "post" in hooks else None)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls([torch.rand(2, 3, requires_grad=True)], **inp.kwargs)
        if hooks == "pre-and-prepend":
            sd = opt.state_dict()
            opt.register_load_state_dict_pre_hook(_load_pre_hook1)
            opt.load_state_dict(sd)
            assert opt.param_groups[0]["lr"] == 0.002
            opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
            opt.load_state_dict(sd)
            assert opt.param_groups[0]["lr"] == 0.002
        else:
            if hooks == "pre-post":
                opt.register_load_state_dict_pre_hook(_load_pre_hook2)
            opt.register_load_state_dict_post_hook(_load_post_hook)
            opt.load_state_dict(opt.state_dict())
            assert opt.state["ran_load_state_dict_pre_hook2"] is (hooks == "pre-post")
            assert opt.state["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("which", ["pre", "post", "all"])
@case("step_hooks")
def test_step_hooks(method, which):
    """Step hooks fire once per step and not after removal, local and global in torch's order, over the
    bodies' ``[torch.tensor([1, 1])]`` -- a parameter without ``requires_grad``: a step that moves nothing."""
    applicable("step_hooks", method)
    oi = info(method)
    params = [torch.tensor([1.0, 1.0])]
    closure = (lambda: 1) if oi.step_requires_closure else None
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(params, **inp.kwargs)
        if which in ("pre", "post"):
            data = [5 if which == "pre" else 2]

            def hook(o, args, kwargs):
                data[0] += 2
            handle = opt.register_step_pre_hook(hook) if which == "pre" else opt.register_step_post_hook(hook)
            opt.step(closure)
            opt.step(closure)
            assert data[0] == (9 if which == "pre" else 6)
            handle.remove()
            opt.step(closure)
            assert data[0] == (9 if which == "pre" else 6)
            continue
        opt2 = torch.optim.SGD(params)
        seen: list[int] = []
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append(0)),
                   register_optimizer_step_post_hook(lambda o, a, k: seen.append(5))]
        try:
            for o in (opt, opt2):
                handles.append(o.register_step_pre_hook(lambda o, a, k: seen.append(1)))
                handles.append(o.register_step_post_hook(lambda o, a, k: seen.append(2)))
            opt.step(closure)
            assert seen == [0, 1, 2, 5]
            opt2.step(closure)
            opt.step(closure)
            assert seen == [0, 1, 2, 5] * 3
        finally:
            for h in handles:
                h.remove()
        opt.step(closure)
        opt2.step(closure)
        assert seen == [0, 1, 2, 5] * 3


@case("deepcopy_copies_all_public_attrs")
def test_deepcopy_copies_all_public_attrs(method):
    applicable("deepcopy_copies_all_public_attrs", method)
    oi = info(method)
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for inp in oi.optim_inputs_func(device="cpu"):
        opt = oi.optim_cls(params, **inp.kwargs)
        for _ in range(3):
            opt.step(lambda: 1)
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}


@case("non_empty_state")
def test_non_empty_state(method):
    """After a step, every entry of ``optimizer.state`` holds something (torch's own suite checks it)."""
    applicable("non_empty_state", method)
    oi = info(method)
    for inp in oi.optim_inputs_func(device="cpu"):
        torch.manual_seed(0)
        model = nn.Linear(5, 5)
        inpt = torch.rand(2, 5)
        opt = oi.optim_cls.build_on(model, **inp.kwargs)

        def loss(per_sample: bool = False):
            out = model(inpt)
            return out.sum(1) if per_sample else out.sum()
        opt.step(closure_for(opt, loss, method))
        assert all(len(st) > 0 for st in opt.state.values())
        if method != "bp":  # SGD without momentum keeps no state; every szo method keeps a step count per parameter
            assert opt.state


def test_every_trainable_method_has_an_info_and_every_skip_a_reason():
    """The records cover the registry; the not-applicable list names only bodies and methods that exist."""
    assert set(INFOS) == set(list_methods())
    bodies = {"goes_right_direction", "tensor_lr", "step_is_noop_when_params_have_no_grad",
              "step_is_noop_for_zero_grads", "optimizer_can_be_printed", "state_dict_deterministic",
              "save_load_equality_with_weights_only", "load_nontensor_step", "state_dict_hooks",
              "load_state_dict_hooks", "step_hooks", "deepcopy_copies_all_public_attrs", "errors",
              "param_group_with_lrscheduler_goes_right_direction", "param_groups_lr", "can_load_older_state_dict",
              "can_load_from_to_named_state_dict", "non_empty_state", "rosenbrock_sparse",
              "param_groups_weight_decay", "complex"}
    assert {b for b, _ in NOT_APPLICABLE} <= bodies and {m for _, m in NOT_APPLICABLE} <= set(METHODS)
    assert {m for _, m in OWNED_ELSEWHERE} <= set(METHODS)
    assert all(isinstance(why, str) and len(why) > 3 for why in [*NOT_APPLICABLE.values(), *TORCH_ONLY.values()])
