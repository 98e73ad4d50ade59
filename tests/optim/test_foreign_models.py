"""SZO on SpikingJelly's own ResNets, whose forward does not reset neuron state.

The whole user path: ``TrajectoryRecorder`` -> ``build_subspace`` -> ``SubspaceStore`` ->
``SZO(model, subspace)``, on ``spiking_resnet18`` (multi-step, ``set_step_mode(model, "m")``)
and ``sew_resnet18`` (single-step, the closure loops over T). The oracle is written without
szo's optimizer: every probe loss is computed on a fresh copy of the model (explicit
``functional.reset_net``, BN statistics as they were before the step), the update is
theta - lr * P g by hand, and the BN statistics are those of one train-mode forward of a
fresh copy at theta_{t+1}.
"""
from __future__ import annotations

import copy

import pytest
import torch
from spikingjelly.activation_based import functional, neuron
from spikingjelly.activation_based.model import sew_resnet, spiking_resnet
from torch import nn

from subspace_store import SubspaceStore, build_subspace
from szo.evaluators import Batch
from szo.functional import zo as F
from szo.optim import SZO
from szo.trajectory import TrajectoryRecorder
from szo.zo import ProbePath
from szo.zo.guard import ProbeGuard

T, N, K, MU, LR = 2, 2, 2, 0.5, 0.5


class SingleStepLoop(nn.Module):
    """A single-step SpikingJelly network run over T steps (what a user's loop does); no reset."""

    def __init__(self, net: nn.Module, T: int):
        super().__init__()
        self.net, self.T = net, T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.net(x) for _ in range(self.T)])


def make(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "spiking_resnet18":
        net = spiking_resnet.spiking_resnet18(spiking_neuron=neuron.LIFNode, tau=2.0, num_classes=10)
        functional.set_step_mode(net, "m")
        return net
    net = sew_resnet.sew_resnet18(spiking_neuron=neuron.LIFNode, tau=2.0, num_classes=10, cnf="ADD")
    return SingleStepLoop(net, T)  # sew_resnet18 stays single-step


def batch(arch: str):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(N, 3, 16, 16, generator=g)
    if arch == "spiking_resnet18":
        x = x.unsqueeze(0).repeat(T, 1, 1, 1, 1)  # [T, N, C, H, W]
    return x, torch.tensor([3, 7])


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.mean(0), y)


@pytest.fixture(scope="module", params=["spiking_resnet18", "sew_resnet18"])
def setup(request, tmp_path_factory):
    """(arch, model state, stored subspace): a 4-sample trajectory recorded and built into a k=2 store entry."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    model = make(arch)
    rec = TrajectoryRecorder(tmp / "traj", model, model_name=arch)
    g = torch.Generator().manual_seed(2)
    for i in range(4):  # stand-in for BPTT epochs: the subspace only needs a trajectory
        if i:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g), alpha=0.02)
        rec.record(epoch=i, step=i)
    store = SubspaceStore(tmp / "store")
    store.save("sub", build_subspace(tmp / "traj", K, progress=False))
    fresh = make(arch).train()
    return arch, fresh.state_dict(), store.load("sub", model=fresh)


def reference_step(arch, state, sub, estimator, x, y):
    """theta_{t+1} and the BN buffers after one step, computed probe by probe on fresh copies."""
    base = make(arch)
    base.load_state_dict(state)
    base.train()
    theta = sub.reference.double()
    P = sub.basis.double()

    def loss_at(vec: torch.Tensor) -> tuple[float, nn.Module]:
        net = copy.deepcopy(base)  # BN statistics as before the step
        torch.nn.utils.vector_to_parameters(vec.float(), net.parameters())
        functional.reset_net(net)
        with torch.no_grad():
            return float(loss_fn(net(x), y)), net

    if estimator == "cge":
        dirs = torch.eye(K, dtype=torch.float64)
    else:
        dirs = F.sample_gaussian(1, K, torch.Generator().manual_seed(5), dtype=torch.float64)
    g_c = torch.zeros(K, dtype=torch.float64)
    for u in dirs:
        lp, _ = loss_at(theta + MU * P @ u)
        lm, _ = loss_at(theta - MU * P @ u)
        g_c += (lp - lm) / (2 * MU) * u / (1 if estimator == "cge" else dirs.shape[0])
    new = theta - LR * P @ g_c
    _, after = loss_at(new)  # the unperturbed train-mode forward of theta_{t+1}
    bufs = {k: v for k, v in after.state_dict().items() if "running" in k or "num_batches" in k}
    return new, bufs


def szo_step(arch, state, sub, estimator, engine, x, y):
    model = make(arch)
    model.load_state_dict(state)
    model.train()
    opt = SZO(model, sub, mu=MU, lr=LR, momentum=0.9, estimator=estimator, q=1,
              generator=torch.Generator().manual_seed(5), probes=ProbePath(engine=engine), scale="absolute")
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), sub.reference)  # start = reference
    if engine == "batched":  # the engine folds the probes over the batch: the step gets it, not a closure
        opt.step(batch=Batch(x, y, loss_fn))
    else:
        opt.step(lambda: loss_fn(model(x), y))
    assert opt.forward_passes == opt.forwards_per_step == (2 * K if estimator == "cge" else 2) + 1
    return model, opt


def bn_buffers(model):
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("engine", ["loop", "batched"])
@pytest.mark.parametrize("estimator", ["cge", "rge"])
def test_szo_step_on_spikingjelly_resnets_equals_explicit_resets(setup, estimator, engine):
    arch, state, sub = setup
    x, y = batch(arch)
    new, bufs = reference_step(arch, state, sub, estimator, x, y)
    model, _ = szo_step(arch, state, sub, estimator, engine, x, y)
    got = torch.nn.utils.parameters_to_vector(model.parameters()).double()
    # the batched engine sums in another order (folded convolutions): 1e-5 relative on the losses
    tol = dict(rtol=1e-4, atol=1e-6) if engine == "batched" else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, new, **tol)
    for k, v in bn_buffers(model).items():  # running statistics = one unperturbed forward of theta_{t+1}
        torch.testing.assert_close(v, bufs[k], rtol=1e-5, atol=1e-6, msg=k)


def test_without_resets_the_same_step_is_wrong(setup, monkeypatch):
    """The oracle can tell: with the optimizer's resets switched off the update differs."""
    arch, state, sub = setup
    x, y = batch(arch)
    new, _ = reference_step(arch, state, sub, "cge", x, y)
    monkeypatch.setattr(ProbeGuard, "reset", lambda self: None)
    model, _ = szo_step(arch, state, sub, "cge", "loop", x, y)
    got = torch.nn.utils.parameters_to_vector(model.parameters()).double()
    assert (got - new).norm() > 1e-3 * (new - sub.reference.double()).norm()


def test_params_form_without_model_refuses_bn_and_stateful_neurons(setup):
    arch, state, sub = setup
    model = make(arch)
    model.load_state_dict(state)
    model.train()
    x, y = batch(arch)
    opt = SZO(model.parameters(), sub, mu=MU, lr=LR, scale="absolute")  # no model: cannot freeze BN or reset neurons
    before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    with pytest.raises(ValueError, match="given no model; construct it as SZO\\(model, ...\\)"):
        opt.step(lambda: loss_fn(model(x), y))
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), before)  # restored
    model.eval()  # eval-mode BN needs no freezing, but the LIF neurons still carry state
    with pytest.raises(ValueError, match="stateful SpikingJelly module"):
        opt.step(lambda: loss_fn(model(x), y))


def test_batched_engine_refuses_a_model_it_cannot_fold():
    """Learnable neuron parameters (PLIF's tau) cannot be folded into channel-stacked copies."""
    torch.manual_seed(0)
    net = spiking_resnet.spiking_resnet18(spiking_neuron=neuron.ParametricLIFNode, num_classes=10)
    functional.set_step_mode(net, "m")
    from types import SimpleNamespace

    d = sum(p.numel() for p in net.parameters())
    sub = SimpleNamespace(basis=torch.eye(d, 1), layout=None)
    with pytest.raises(ValueError, match="batched engine: module 'sn1' \\(ParametricLIFNode\\) has parameters"):
        SZO(net, sub, start="current", probes=ProbePath(engine="batched"), scale="absolute")
