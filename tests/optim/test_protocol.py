"""Every forward-only method, built as the pipeline builds it, satisfies the one optimizer protocol
(szo.zo.ForwardOnlyOptimizer) and reports each step in a StepInfo the trainer can rely on."""
from __future__ import annotations

import gc
import re
from types import SimpleNamespace

import pytest
import torch

from szo.evaluators import Batch, batch_closure
from szo.hw import to_fixed
from szo.hw.optim.onchip import OnChipSZO
from szo.losses import tet_loss
from szo.methods import BACKPROP_METHODS, FORWARD_ONLY_METHODS, QZO_METHODS, get_method
from szo.models import create
from szo.models.tt import tt_parametrize
from szo.optim import build_optimizer
from szo.precision import precision_policy
from szo.zo import PROTOCOL_MEMBERS, ForwardOnlyOptimizer, StepInfo, get_estimator, is_forward_only

BUILT = [m for m in FORWARD_ONLY_METHODS if m not in QZO_METHODS]  # the integer learners: below
ONCHIP = {"onchip-cge": dict(estimator="cge"), "onchip-rademacher": dict(estimator="rademacher", q=2),
          "qzo-subspace": dict(estimator="rademacher", rule="eq8", q=2)}


def _model_and_subspace(k: int = 3, device: torch.device = torch.device("cpu")):
    torch.manual_seed(0)
    model = create("spike_convnet", num_classes=10, T=2, width=4).train().to(device)  # the digits ConvNet
    d = model.num_params()
    basis = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(1)))[0]
    return model, SimpleNamespace(basis=basis, layout=model.param_layout(), reference=model.flat_params())


def _build(name: str, device: torch.device = torch.device("cpu")):
    model, sub = _model_and_subspace(device=device)
    if name in ONCHIP:
        net = to_fixed(model, weight_bits=8)
        return net, OnChipSZO(net, sub, lr=0.5, mu_lsb=1 << 11, **ONCHIP[name])
    if name == "mcu-zo":  # seed 004's learner on the int8 weights, built as the pipeline builds it
        net = to_fixed(model.eval(), weight_bits=8)
        return net, build_optimizer(name, net, lr=0.05, q=2, momentum=0.0)
    if name == "tt-zo":
        tt_parametrize(model, 2, cores=2, min_params=100)
    kw = dict(lr=0.01, momentum=0.0 if name.startswith("asyncfgd") or name == "lozo" else 0.9, mu=0.01, q=2,
              scale="absolute")
    return model, build_optimizer(name, model, subspace=sub, generator=torch.Generator().manual_seed(2), **kw)


def _batch(device: torch.device = torch.device("cpu")):
    g = torch.Generator().manual_seed(3)
    return torch.rand(8, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (8,), generator=g).to(device)


@pytest.mark.device
@pytest.mark.parametrize("name", BUILT + ["szo-cge-batched", "mcu-zo"] + list(ONCHIP))
def test_every_forward_only_method_satisfies_the_protocol(name, device):
    """... on the device of the device subset (SZO_TEST_DEVICE), where the step's losses must also
    be those of the same step on the CPU (fp32; the integer learners exactly)."""
    if name == "szo-cge-batched":
        model, sub = _model_and_subspace(device=device)
        opt = build_optimizer("szo-cge", model, subspace=sub, lr=0.5, mu=0.05, engine="batched", scale="absolute")
    else:
        model, opt = _build(name, device)
    assert isinstance(opt, ForwardOnlyOptimizer) and is_forward_only(opt), name
    assert all(hasattr(opt, m) for m in PROTOCOL_MEMBERS)
    assert opt.last_step is None and opt.forward_passes == 0
    assert opt.distributed is None and opt.bytes_communicated == 0
    x, y = _batch(device)
    calls = []
    inner = batch_closure(model, tet_loss, x, y, reduction=opt.loss_reduction)

    def closure():
        calls.append(1)
        return inner()

    with precision_policy("fp32", model, device).scope():
        loss = opt.step(closure, batch=Batch(x, y, tet_loss))  # the batched engine folds over it, the loop calls
    if device.type != "cpu":  # the same step on the CPU: the same probe losses, to float rounding
        cpu_model, cpu_opt = _build(name) if name != "szo-cge-batched" else (None, None)
        if cpu_opt is not None:
            cpu_opt.step(batch_closure(cpu_model, tet_loss, *_batch(), reduction=cpu_opt.loss_reduction))
            torch.testing.assert_close(opt.last_step.losses.cpu(), cpu_opt.last_step.losses, rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: probe losses on {device} vs the CPU")
    info = opt.last_step
    assert isinstance(info, StepInfo)
    with pytest.raises(AttributeError):
        info.forwards = 0  # frozen: the trainer's record of the step
    assert info.forwards == opt.forwards_per_step == opt.forward_passes, name
    # the batched engine folds its probes into one call-free pass; everything else calls the closure per forward
    assert len(calls) == (int(info.unperturbed) if name == "szo-cge-batched" else info.forwards)
    assert info.losses.dtype == torch.float64 and info.losses.numel() >= 1
    assert torch.isfinite(info.losses).all() and info.loss == pytest.approx(float(loss))
    assert info.unperturbed == (info.bn_loss is not None)
    assert isinstance(opt.train_outputs, bool) and (opt.train_outputs or name == "szo-cge-batched")
    assert float(info.reference_loss) == pytest.approx(float(info.losses.mean()))
    # the state round trip: a fresh optimizer loads it and writes the same state back
    sd = opt.state_dict()
    if name == "szo-cge-batched":
        return
    _, fresh = _build(name, device)
    fresh.load_state_dict(sd)
    again = fresh.state_dict()
    assert again.keys() == sd.keys() and fresh.forward_passes == opt.forward_passes


@pytest.mark.parametrize("name", BACKPROP_METHODS)
def test_backprop_methods_are_not_forward_only(name):
    model, sub = _model_and_subspace()
    opt = build_optimizer(name, model, subspace=sub, lr=0.1, scale="absolute")
    assert not isinstance(opt, ForwardOnlyOptimizer) and not is_forward_only(opt)


ESTIMATOR_METHODS = [m for m in FORWARD_ONLY_METHODS if get_method(m).family in ("subspace-zo", "full-space-zo")]


@pytest.mark.parametrize("name", ESTIMATOR_METHODS)
def test_the_registrys_forward_count_is_the_optimizers(name):
    """The registry's count (``MethodSpec.forwards``, e.g. ``2k + 1``: the probes and the BN
    forward) is what the built optimizer says one step costs, and the closure calls of that step
    (k: the subspace's, q, n: the coordinates a full-space CGE step probes); the optimizer's own
    count comes from its estimator record (``szo.zo.get_estimator``)."""
    model, opt = _build(name)
    kind = get_estimator(opt.estimator)
    assert opt.kind is kind
    n = getattr(opt, "coords_per_step", None) or getattr(opt, "d", None)
    values = {"k": getattr(opt, "k", None), "q": opt.q, "n": n}
    formula = re.sub(r"(\d)([a-z])", r"\1*\2", get_method(name).forwards)
    expected = eval(formula, {"__builtins__": {}}, values)  # the registry's prose, read as arithmetic
    x, y = _batch()
    calls = []
    inner = batch_closure(model, tet_loss, x, y, reduction=opt.loss_reduction)

    def closure():
        calls.append(1)
        return inner()

    opt.step(closure)
    assert expected == opt.forwards_per_step == len(calls) == kind.probes(values["k"] or n, opt.q) + 1, name


def _backward_closure(model, opt, x, y, *, enable_grad: bool):
    """torch.optim's closure (``zero_grad(); loss.backward(); return loss``); ``enable_grad``: inside
    ``torch.enable_grad()``, as Lightning's automatic optimization runs it."""
    def closure():
        with torch.enable_grad() if enable_grad else torch.no_grad():
            opt.zero_grad()
            loss = tet_loss(model(x), y, reduction=opt.loss_reduction)
            loss.sum().backward()
            return loss.detach()
    return closure


@pytest.mark.parametrize("enable_grad", [False, True], ids=["no-grad", "enable-grad"])
@pytest.mark.parametrize("name", BUILT + ["mcu-zo"] + list(ONCHIP))
def test_a_closure_that_runs_backward_is_refused_in_one_line(name, enable_grad):
    """Issue 40 item 6: the standard closure gets one line that says the step is forward-only, what the
    closure may do and what to do instead (Lightning: manual optimization), at its first call, before
    any parameter moves."""
    model, opt = _build(name)
    x, y = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        opt.step(_backward_closure(model, opt, x, y, enable_grad=enable_grad))
    msg = str(e.value)
    assert "\n" not in msg and "is forward-only" in msg and "no zero_grad() / backward()" in msg
    assert "self.automatic_optimization = False" in msg
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.forward_passes == 0


@pytest.mark.parametrize("name", BUILT + ["mcu-zo"] + list(ONCHIP))
def test_grad_scaler_is_refused_in_one_line(name):
    """Issue 40 item 14: ``GradScaler.step(opt, closure)`` after ``scaler.scale(...)`` (an AMP loop)
    reads the optimizer's ``_step_supports_amp_scaling``, which refuses in one forward-only line;
    nothing moves. (With nothing scaled yet, GradScaler stops on its own check before any optimizer.)"""
    model, opt = _build(name)
    x, y = _batch()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        scaler.step(opt, batch_closure(model, tet_loss, x, y, reduction=opt.loss_reduction))
    assert "\n" not in str(e.value) and "is forward-only: GradScaler" in str(e.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and opt.forward_passes == 0


@pytest.mark.parametrize("name", ["szo-cge", "szo-rge", "zo-rge"])
def test_a_closure_that_compiles_the_model_is_the_model(name):
    """Issue 48 item 12: ``torch.compile(model)`` called inside the closure (the usual way) wraps the
    very layers of ``model=``; the guard took the wrapper for a foreign train-mode BatchNorm. The step
    runs and gives the eager closure's losses."""
    model, opt = _build(name)
    x, y = _batch()
    # dynamo guards SpikingJelly's reset cache (a WeakKeyDictionary) by key position: models an earlier
    # test left for the garbage collector can vanish between tracing and guarding (IndexError inside torch)
    gc.collect()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    loss = opt.step(lambda: tet_loss(compiled(x), y))
    twin, opt2 = _build(name)
    assert torch.equal(loss, opt2.step(lambda: tet_loss(twin(x), y)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
