"""PyTorch's optimizer contract, for every method ``build_optimizer`` builds.

The checks are those of PyTorch's own suite (``test/test_optim.py`` with
``torch/testing/_internal/common_optimizers.py``, ``test/optim/test_lrscheduler.py``,
``test/optim/test_swa_utils.py``) that apply to an optimizer whose ``step`` takes a closure, as
``torch.optim.LBFGS``'s does: a ``state_dict`` round trip that continues bit-exactly (here in both
orders a user or Lightning loads it, and into a fresh model), deepcopy / pickle / ``torch.save``,
param groups, ``zero_grad``, the LR schedulers, step hooks, ``swa_utils``, dtypes, frozen, tied and
meta parameters, the closure's return value. What a forward-only optimizer cannot do it refuses in
one line that says so. ``bp`` (``torch.optim.SGD``) runs the same checks where they apply: a check
that SGD fails is a wrong check.

The model is the digits ConvNet at width 2 (161 parameters; 115 TT-parameterised), T = 2, 4x4
inputs: every case steps in milliseconds.
"""
from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch

from szo.engine import batch_closure
from szo.hw import to_fixed
from szo.losses import tet_loss
from szo.methods import get_method, list_methods
from szo.models import create
from szo.models.tt import tt_parametrize
from szo.optim import build_optimizer
from szo.options import IntegerLearnerOptions

INTEGER = "/integer"  # a method trained by the integer on-chip learner (szo.hw.optim.onchip.OnChipSZO)
CASES = list(list_methods()) + [m + INTEGER for m in list_methods(integer_learner=True, integer=False)]
FORWARD_ONLY = [c for c in CASES if get_method(c.split("/")[0]).forward_only]


def _method(case: str):
    return get_method(case.split("/")[0])


def _integer(case: str) -> bool:
    return case.endswith(INTEGER) or _method(case).integer


def _point_in_state(case: str) -> bool:
    """The optimizer's parameters are a function of its state: a subspace's point, an integer learner's."""
    return _method(case).subspace or _integer(case)


def make_model(case: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = create("spike_convnet", num_classes=3, T=2, width=2).train()
    if case == "tt-zo":
        tt_parametrize(model, 2, cores=2, min_params=20)
    if _integer(case):  # mcu-zo: seed 004's learner folds BN with its running statistics (eval)
        model = to_fixed(model.eval() if case == "mcu-zo" else model, weight_bits=8)
    return model


def make_subspace(model: torch.nn.Module, k: int = 3) -> SimpleNamespace:
    """An orthonormal basis and a reference point off the model's (so that ``start="reference"`` moves it)."""
    d = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0].float()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return SimpleNamespace(basis=basis, layout=None, reference=flat + 0.01 * torch.randn(d, generator=g),
                           eigenvalues=torch.ones(k))


def build(case: str, model: torch.nn.Module, sub=None, **overrides) -> torch.optim.Optimizer:
    """The case's optimizer as ``build_optimizer`` builds it, at small steps."""
    spec = _method(case)
    kw: dict = dict(lr=0.05, mu=0.05, q=2, momentum=0.9 if spec.momentum else 0.0)
    if spec.name in ("fg", "asyncfgd", "asyncfgd-adam", "tt-zo"):
        kw["lr"] = 1e-3
    if spec.name == "bp":
        kw["weight_decay"] = 0.0
    if spec.name == "zo-cge":
        kw["coords_per_step"] = 4
    if spec.name == "mcu-zo":
        kw["mu"] = 1.0
    if _integer(case):
        kw["integer"] = IntegerLearnerOptions()
    else:
        kw["scale"] = "absolute"
    if spec.forward_only:
        kw["generator"] = torch.Generator().manual_seed(2)
    kw.update(overrides)
    if spec.subspace and sub is None:
        sub = make_subspace(model)
    return build_optimizer(spec.name, model, subspace=sub if spec.subspace else None, **kw)


def make(case: str, seed: int = 0, **overrides):
    model = make_model(case, seed)
    return model, build(case, model, make_subspace(make_model(case)), **overrides)


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.rand(6, 1, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def closure(model, opt, i: int = 0):
    """Batch ``i``'s closure as a user writes it: forward-only, or (BP) ``zero_grad``, ``backward``."""
    x, y = batch(i)
    inner = batch_closure(model, tet_loss, x, y, reduction=getattr(opt, "loss_reduction", "mean"))
    if getattr(opt, "forward_only", False):
        return inner

    def backprop():
        opt.zero_grad()
        loss = inner()
        loss.backward()
        return loss
    return backprop


def run(model, opt, steps) -> list[float]:
    return [float(opt.step(closure(model, opt, i)).detach()) for i in steps]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def same(a, b, path: str = "") -> None:
    """Two state dicts (or parts) are equal: the same keys, tensors bitwise."""
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))), path
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            same(u, v, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def saved(state: dict) -> dict:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)`` (a checkpoint file)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------- state_dict round trips
@pytest.mark.parametrize("order", ["weights-first", "optimizer-first"])
@pytest.mark.parametrize("case", CASES)
def test_resume_continues_bit_exactly(case, order):
    """test_optim's test_state_dict_deterministic in the two orders a resume takes: weights loaded
    before the optimizer is built (Lightning, and every SZO user: the constructor moves the
    parameters to the subspace's reference) or after it loaded its state; into a model built from
    another seed. The continued run equals the uninterrupted one bit for bit -- parameters, forward
    count, state -- and loading leaves the checkpoint's dict as it was."""
    model, opt = make(case)
    run(model, opt, range(2))
    weights, state = copy.deepcopy(model.state_dict()), saved(opt.state_dict())
    kept = copy.deepcopy(state)
    fp = getattr(opt, "forward_passes", None)
    losses = run(model, opt, range(2, 4))

    model2 = make_model(case, seed=7)
    if order == "weights-first":
        model2.load_state_dict(weights)
        opt2 = build(case, model2, make_subspace(make_model(case)))
        opt2.load_state_dict(state)
    else:
        opt2 = build(case, model2, make_subspace(make_model(case)))
        opt2.load_state_dict(state)
        model2.load_state_dict(weights)
    same(state, kept, "the loaded state dict")
    fp2 = getattr(opt2, "forward_passes", None)
    assert fp2 == fp
    assert run(model2, opt2, range(2, 4)) == losses
    assert torch.equal(flat(model2), flat(model))
    assert getattr(opt2, "forward_passes", None) == getattr(opt, "forward_passes", None)
    same(opt2.state_dict(), opt.state_dict(), case)


@pytest.mark.parametrize("case", [c for c in CASES if _point_in_state(c)])
def test_state_alone_puts_the_parameters_at_its_point(case):
    """A subspace method's state carries the point its parameters stand at (an integer learner's
    its origin and integers): loading it into a fresh model, without the weights, puts them there."""
    model, opt = make(case)
    run(model, opt, range(2))
    state = saved(opt.state_dict())
    run(model, opt, range(2, 4))
    model2 = make_model(case, seed=7)
    opt2 = build(case, model2, make_subspace(make_model(case)))
    opt2.load_state_dict(state)
    run(model2, opt2, range(2, 4))
    assert torch.equal(flat(model2), flat(model))


@pytest.mark.parametrize("case", [c for c in CASES if _point_in_state(c)])
def test_a_point_of_another_space_is_refused(case):
    """A state whose point (origin) has another dimension than these parameters: one ValueError."""
    model, opt = make(case)
    run(model, opt, range(1))
    state = opt.state_dict()
    cut = {"point": "the point must be a float", "origin": "an origin theta_ref of shape",
           "synapses": "the synapses are"}
    hit = [k for sec in state.values() if isinstance(sec, dict) for k in cut if k in sec]
    assert len(hit) == 1, hit
    for sec in state.values():
        if isinstance(sec, dict) and hit[0] in sec:
            sec[hit[0]] = sec[hit[0]][:-1] if hit[0] != "synapses" else {}
    with pytest.raises(ValueError, match=r"^optimizer state.*" + cut[hit[0]]):
        build(case, make_model(case), make_subspace(make_model(case))).load_state_dict(state)
