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
import pickle
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
REFRESH = "/refresh"  # the method in a random subspace redrawn every 2 steps (szo.refresh, Refreshed)
CASES = (list(list_methods()) + [m + INTEGER for m in list_methods(integer_learner=True, integer=False)]
         + [m + REFRESH for m in ("szo-cge", "szo-rge")])
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
    if case.endswith(REFRESH):
        kw["refresh"] = 2
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
    # szo's optimizers copy what they load, so the steps after it leave the dict as it was too (a second
    # resume from it); torch's own (bp: SGD's momentum buffer) keeps the loaded tensors and moves them
    if _method(case).forward_only or _method(case).subspace:
        same(state, kept, "the loaded state dict after the resumed steps")


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


# ---------------------------------------------------------------------- copies
def _copy(how: str, obj):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()  # torch.save of the objects themselves: only ever loaded from a file one wrote
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("case", CASES)
def test_a_copy_of_model_and_optimizer_continues_as_the_original(case, how):
    """test_optim's test_deepcopy_copies_all_public_attrs, and the optimizer "should be serializable":
    a copy of (model, optimizer) made after a step steps on exactly as the original does."""
    model, opt = make(case)
    run(model, opt, range(1))
    if how != "deepcopy" and case == "tt-zo":  # torch refuses to pickle a parametrised module (the TT model)
        with pytest.raises(RuntimeError, match="Serialization of parametrized modules is only supported through "
                                               "state_dict"):
            _copy(how, (model, opt))
        return
    model2, opt2 = _copy(how, (model, opt))
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert {k for k in vars(opt2) if not k.startswith("_")} == public
    assert run(model2, opt2, range(1, 3)) == run(model, opt, range(1, 3))
    assert torch.equal(flat(model2), flat(model))
    same(opt2.state_dict(), opt.state_dict(), case)


def test_torch_distributed_checkpoint_round_trip():
    """``torch.distributed.checkpoint``'s optimizer state dict keeps only ``state`` and
    ``param_groups`` (by parameter name) and calls ``step(None)`` on an optimizer whose live state is
    empty: every method's sections travel in the first parameter's state, and a fresh optimizer
    loaded from it continues bitwise -- FullSpaceZO's generator and forward count included."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for case in CASES:
        model, opt = make(case)
        run(model, opt, range(2))
        weights = copy.deepcopy(model.state_dict())
        state = copy.deepcopy(get_optimizer_state_dict(model, opt))
        assert set(state) == {"state", "param_groups"} and all(isinstance(k, str) for k in state["state"])
        losses = run(model, opt, range(2, 4))
        model2 = make_model(case, seed=7)
        model2.load_state_dict(weights)
        opt2 = build(case, model2, make_subspace(make_model(case)))
        set_optimizer_state_dict(model2, opt2, state)
        assert run(model2, opt2, range(2, 4)) == losses, case
        assert torch.equal(flat(model2), flat(model)), case
        assert getattr(opt2, "forward_passes", 0) == getattr(opt, "forward_passes", 0), case


@pytest.mark.parametrize("case", FORWARD_ONLY)
def test_sections_load_from_the_first_parameters_state(case):
    """A state dict reduced to ``state`` and ``param_groups`` (what such tools keep) loads as the whole."""
    model, opt = make(case)
    run(model, opt, range(1))
    full = saved(opt.state_dict())
    first = full["param_groups"][0]["params"][0]
    sections = [k for k in full if k not in ("state", "param_groups")]
    assert sections and all(full["state"][first][k] is full[k] for k in sections)  # one object, stored once
    model2, opt2 = make(case)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict({"state": full["state"], "param_groups": full["param_groups"]})
    same(opt2.state_dict(), opt.state_dict(), case)


# ---------------------------------------------------------------------- parameters: frozen, meta, groups
JVP_OR_INTEGER = [c for c in CASES if _method(c).jvp or _integer(c)]  # they move every parameter given


def _freeze_first_block(model: torch.nn.Module) -> list[str]:
    names = [n for n, _ in model.named_parameters() if n.startswith(("conv1.", "bn1."))]
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return names


@pytest.mark.parametrize("case", CASES)
def test_frozen_parameters_are_never_moved(case):
    """torch's rule: an optimizer never changes a parameter with ``requires_grad=False``. Every
    method leaves them out of its probes and updates (a subspace method: their rows of P), or --
    a forward gradient, the integer learners, which move every parameter they are given -- refuses
    in one line that names them."""
    model = make_model(case)
    names = _freeze_first_block(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if case in JVP_OR_INTEGER:
        with pytest.raises(ValueError, match=r"^\w+ [^;]*every [^;]*; conv1\.weight.* requires_grad=False, which an "
                                             r"optimizer never changes: [^\n]+$"):
            build(case, model, make_subspace(make_model(case)))
        return
    opt = build(case, model, make_subspace(make_model(case)), **({"coords_per_step": 40} if case == "zo-cge" else {}))
    run(model, opt, range(3))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in names)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n not in names)
    if _method(case).forward_only:  # only what it trains is in its groups (and state)
        assert all(p.requires_grad for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("case", CASES)
def test_a_meta_model_is_refused_at_construction(case):
    """A model on the ``meta`` device (shapes without values) is refused in one line when the
    optimizer is built, not at its first step (torch's SGD accepts it: it never runs the model)."""
    model = make_model(case).to("meta")
    if case == "bp":
        build(case, model)
        return
    with pytest.raises(ValueError, match=r"^\w+: the parameters are on the meta device [^\n]+materialise it first"):
        build(case, model, make_subspace(make_model(case)))


@pytest.mark.parametrize("case", CASES)
def test_add_param_group_trains_the_group_or_is_refused(case):
    """test_optim's add_param_group: the added group is trained (FullSpaceZO's space grows: zo-cge,
    zo-rge, tt-zo; SGD), or the optimizer refuses in one line -- a group accepted and never trained
    would be silent."""
    grows = case in ("bp", "zo-cge", "zo-rge", "tt-zo")
    model = make_model(case)
    if grows:
        names = _freeze_first_block(model)
    if case == "bp":  # torch's fine-tuning pattern: an SGD over the trainable parameters, a group added later
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    else:
        opt = build(case, model, make_subspace(make_model(case)),
                    **({"coords_per_step": 40} if case == "zo-cge" else {}))
    if not grows:
        with pytest.raises(ValueError, match=r"^\w+ moves [^\n]+: add_param_group cannot add parameters to it; "
                                             r"build a new \w+ over all the parameters to train$"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        return
    added = [p for n, p in model.named_parameters() if n in names]
    before = [p.detach().clone() for p in added]
    for p in added:
        p.requires_grad_(True)
    opt.add_param_group({"params": added, "lr": 0.05 if case != "tt-zo" else 1e-3})
    run(model, opt, range(3))
    assert any(not torch.equal(p, b) for p, b in zip(added, before))


def test_fullspace_param_groups_take_their_own_lr_and_momentum():
    """test_optim's test_param_groups_lr: FullSpaceZO with param groups (a group at lr 0 stays where
    it is, the other moves); its mu is the optimizer's (a group's own is refused in one line)."""
    from szo.optim import FullSpaceZO

    model = make_model("zo-rge")
    head = [model.fc.weight, model.fc.bias]
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = FullSpaceZO([{"params": rest}, {"params": head, "lr": 0.0, "momentum": 0.5}], model=model,
                      estimator="rge", mu=0.05, lr=0.05, q=2, generator=torch.Generator().manual_seed(2))
    before = flat(model)
    fixed = [p.detach().clone() for p in head]
    run(model, opt, range(3))
    assert all(torch.equal(p, f) for p, f in zip(head, fixed)) and not torch.equal(flat(model), before)
    with pytest.raises(ValueError, match=r"^FullSpaceZO probes every coordinate with one mu"):
        FullSpaceZO([{"params": rest}, {"params": head, "mu": 0.1}], model=model, mu=0.05)


@pytest.mark.parametrize("case", [c for c in CASES if _method(c).subspace and not _integer(c)])
def test_subspace_optimizers_refuse_param_groups_in_one_line(case):
    model = make_model(case)
    with pytest.raises(ValueError, match=r"^(subspace optimizers take one flat list of parameters|"
                                         r"\w+ optimizes all of the model's parameters)"):
        type(build(case, make_model(case)))([{"params": list(model.parameters())}], make_subspace(model),
                                             model=model)


# ---------------------------------------------------------------------- hyperparameters and schedulers
def _with_momentum(case: str) -> bool:
    return "momentum" in build(case, make_model(case), make_subspace(make_model(case))).defaults


@pytest.mark.parametrize("key", ["lr", "momentum"])
@pytest.mark.parametrize("case", CASES)
def test_the_step_reads_its_hyperparameters_from_param_groups(case, key):
    """What every LR / momentum scheduler relies on: a value set in ``param_groups`` is the one the
    next step uses -- the run equals one built with that value. (tt-zo's signRGE step is ``sign_lr``
    scaled by lr over the lr it was built with: its lr is checked at 0 below.)"""
    if key == "momentum" and not (_with_momentum(case) and _method(case).momentum) or key == "lr" and case == "tt-zo":
        return
    value = {"lr": 0.02 if case not in ("fg", "asyncfgd", "asyncfgd-adam") else 3e-4, "momentum": 0.5}[key]
    model, opt = make(case)
    for g in opt.param_groups:
        g[key] = value
    model2, opt2 = make(case, **{key: value})
    assert run(model, opt, range(3)) == run(model2, opt2, range(3))
    assert torch.equal(flat(model), flat(model2))


@pytest.mark.parametrize("case", CASES)
def test_lr_zero_in_param_groups_moves_nothing(case):
    """A scheduler that brings lr to 0 stops the parameters (tt-zo's signRGE phase included, issue 40
    item 15): steps at lr 0 leave every parameter bitwise where it was (mcu-zo: where its first step's
    write-back put the float twin of the frozen integers)."""
    model, opt = make(case)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = flat(model)
    run(model, opt, range(1))
    if case == "mcu-zo":
        before = flat(model)
    run(model, opt, range(1, 3))
    assert torch.equal(flat(model), before)


SCHEDULERS = {  # an lr decay, OneCycleLR's lr and momentum cycle, the loss-driven one
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2 * g["lr"] for g in o.param_groups],
                                                                total_steps=4),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("case", CASES)
def test_schedulers_drive_the_step(case, name):
    """test_optim's scheduler runs (test_forloop_goes_right_direction with_lrsched): each scheduler
    steps beside the optimizer (ReduceLROnPlateau on the loss ``step`` returned), and the run equals
    one whose ``param_groups`` were set by hand to the same sequence -- lr and, for OneCycleLR, the
    cycled momentum. An optimizer without momentum refuses OneCycleLR's momentum cycling in torch's
    one line."""
    model, opt = make(case)
    if name == "OneCycleLR" and "momentum" not in opt.defaults:
        with pytest.raises(ValueError, match="optimizer must support momentum"):
            SCHEDULERS[name](opt)
        return
    sched = SCHEDULERS[name](opt)
    if name == "OneCycleLR" and not _method(case).momentum:  # qzo-subspace: eq. 8 has none to cycle
        with pytest.raises(ValueError, match=r"^OnChipSZO rule 'eq8' .* takes no momentum.*cycle_momentum=False"):
            opt.step(closure(model, opt, 0))
        return
    seen = []
    for i in range(3):
        seen.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        loss = opt.step(closure(model, opt, i))
        sched.step(loss) if name == "ReduceLROnPlateau" else sched.step()
    assert len({s[0]["lr"] for s in seen}) > 1 or name == "ReduceLROnPlateau"
    model2, opt2 = make(case)
    for i, values in enumerate(seen):  # the same group values, the scheduler's own keys (initial_lr) included
        for g, v in zip(opt2.param_groups, values):
            g.update(v)
        opt2.step(closure(model2, opt2, i))
    assert torch.equal(flat(model2), flat(model))


# ---------------------------------------------------------------------- hooks
@pytest.mark.parametrize("case", CASES)
def test_step_hooks_fire_once_per_step(case):
    """test_optim's test_step_all_hooks: the global pre / post hooks and the optimizer's own, each once
    per step, in torch's order (an optimizer that steps another inside, AsyncFGD-Adam's Adam, must
    not fire the global ones again: issue 40 item 16)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model, opt = make(case)
    calls: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
               opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))]
    try:
        run(model, opt, range(2))
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global pre", "pre", "post", "global post"] * 2


@pytest.mark.parametrize("case", CASES)
def test_state_dict_hooks_see_the_whole_state(case):
    """test_optim's state_dict / load_state_dict pre and post hooks fire, and a post hook sees the
    whole state dict, the sections included."""
    model, opt = make(case)
    seen = {}

    def saw(o, sd):
        seen["keys"] = set(sd)

    opt.register_state_dict_post_hook(saw)
    opt.register_load_state_dict_post_hook(lambda o: seen.update(loaded=True))
    sd = opt.state_dict()
    assert seen["keys"] == set(sd)
    opt.load_state_dict(sd)
    assert seen["loaded"]


# ---------------------------------------------------------------------- swa_utils, dtypes, tied weights
@pytest.mark.parametrize("case", CASES)
def test_swa_utils(case):
    """test_swa_utils: an AveragedModel updated after every step holds the mean of the iterates, and
    SWALR anneals the lr the steps use."""
    from torch.optim.swa_utils import SWALR, AveragedModel

    model, opt = make(case)
    swa = AveragedModel(model)
    sched = SWALR(opt, swa_lr=opt.param_groups[0]["lr"] / 2, anneal_epochs=2)
    iterates = []
    for i in range(3):
        opt.step(closure(model, opt, i))
        sched.step()
        swa.update_parameters(model)
        iterates.append(flat(model))
    torch.testing.assert_close(flat(swa.module), torch.stack(iterates).mean(0), rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["swa_lr"])


@pytest.mark.parametrize("case", CASES)
def test_float64_parameters_train_in_float64(case):
    """test_optim's dtypes: float64 parameters train and stay float64 (the integer learners' float twin too)."""
    model = make_model(case).double()
    sub = make_subspace(make_model(case))
    sub.basis = sub.basis.double()
    sub.reference = sub.reference.double()
    opt = build(case, model, sub)
    x, y = batch(0)
    inner = batch_closure(model, tet_loss, x.double(), y, reduction=getattr(opt, "loss_reduction", "mean"))
    before = flat(model)
    if _method(case).forward_only:
        opt.step(inner)
    else:
        opt.zero_grad()
        inner().backward()
        opt.step()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert not torch.equal(flat(model), before)


@pytest.mark.parametrize("case", CASES)
def test_tied_parameters_stay_tied(case):
    """A weight shared by two layers is one parameter (``model.parameters()`` lists it once): every
    method moves it once and the layers stay tied; a layer-wise learner, which would estimate and step
    it once per layer, refuses in one line."""
    torch.manual_seed(0)
    model = create("spike_convnet", num_classes=3, T=2, width=2, in_channels=2).train()
    model.conv2.weight = model.conv1.weight
    if case == "tt-zo":  # TT cores per layer would untie the weight: refused, then the shared one left dense
        with pytest.raises(ValueError, match=r"^layers 'conv1' and 'conv2' share one weight; TT-parameterising"):
            tt_parametrize(model, 2, cores=2, min_params=20)
        tt_parametrize(model, 2, cores=2, min_params=50)
    if _integer(case):
        model = to_fixed(model.eval() if case == "mcu-zo" else model, weight_bits=8)
    if _method(case).family == "layer-wise-zo" or case == "mcu-zo":
        with pytest.raises(ValueError, match=r"^\w+: layers 'conv1' and 'conv2' share one parameter, .*untie it"):
            build(case, model, make_subspace(model))
        return
    opt = build(case, model, make_subspace(model))
    x, y = batch(0)
    inner = batch_closure(model, tet_loss, x.expand(-1, 2, -1, -1), y, reduction=getattr(opt, "loss_reduction", "mean"))
    before = flat(model)
    for _ in range(2):
        if _method(case).forward_only:
            opt.step(inner)
        else:
            opt.zero_grad()
            inner().backward()
            opt.step()
    assert model.conv1.weight is model.conv2.weight and not torch.equal(flat(model), before)


# ---------------------------------------------------------------------- the closure
@pytest.mark.parametrize("case", FORWARD_ONLY)
def test_step_returns_the_loss_and_refuses_no_closure(case):
    """LBFGS's contract: ``step(closure)`` returns the loss (a 0-d tensor, no graph; here the one the
    step records); ``step()`` without a closure, and a closure that returns no loss, are refused in
    one line."""
    model, opt = make(case)
    loss = opt.step(closure(model, opt, 0))
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    assert float(loss) == pytest.approx(opt.last_step.loss, rel=1e-6) and torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"^\w+\.step needs a closure that runs a forward pass .*forward-only"):
        opt.step()
    with pytest.raises(ValueError, match=r"^closure \(.*\) must return"):
        opt.step(lambda: None)


@pytest.mark.parametrize("case", FORWARD_ONLY)
def test_zero_grad_leaves_nothing_behind(case):
    """A forward-only step leaves no ``.grad`` on the parameters; ``zero_grad`` (both forms) runs."""
    model, opt = make(case)
    run(model, opt, range(1))
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert repr(opt).startswith(type(opt).__name__)


@pytest.mark.parametrize("case", [c for c in CASES if _method(c).subspace and not _integer(c)])
def test_subspace_methods_start_where_build_optimizer_says(case):
    """Every subspace method built by ``build_optimizer`` starts at ``subspace.reference`` unless
    ``start="current"`` (fg-subspace ignored ``start``, issue 40 item 11)."""
    sub = make_subspace(make_model(case))
    model = make_model(case)
    build(case, model, sub)
    assert torch.equal(flat(model), sub.reference)
    model = make_model(case)
    before = flat(model)
    build(case, model, sub, start="current")
    assert torch.equal(flat(model), before)


class _Phase(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.phase = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x):
        return x * self.phase.abs()


class _Complex(torch.nn.Sequential):
    """A layer, then a module with a complex parameter (torch's optimizers train one as real pairs)."""

    def __init__(self):
        super().__init__(torch.nn.Linear(4, 3), _Phase())


@pytest.mark.parametrize("case", [c for c in CASES if "/" not in c and not _integer(c) and c not in ("bp", "tt-zo")])
def test_complex_parameters_are_refused_in_one_line(case):
    """szo's probes, subspaces and updates are real: a complex parameter's imaginary part would never move.
    Refused at construction by every method that would train it; the layer-wise methods train the layers'
    weights only, and leave it as it is."""
    model = _Complex()
    spec = _method(case)
    sub = SimpleNamespace(basis=torch.linalg.qr(torch.randn(18, 2, dtype=torch.float64))[0].float(), layout=None,
                          reference=None, eigenvalues=torch.ones(2))
    kw = dict(lr=0.1, mu=0.1, momentum=0.9 if spec.momentum else 0.0)
    kw.update(scale="absolute", start="current") if spec.subspace else None
    kw.update(stages=1) if "stages" in spec.options else None
    if spec.family == "layer-wise-zo":
        opt = build_optimizer(case, model, **kw)
        before = model[1].phase.detach().clone()
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y, reduction=opt.loss_reduction))
        assert torch.equal(model[1].phase, before)
        return
    with pytest.raises(ValueError, match=r": parameters of complex dtype \(complex64\) are not supported: its "
                                         r"perturbations, subspaces and updates are real"):
        build_optimizer(case, model, subspace=sub if spec.subspace else None, **kw)
