"""szo.zo.guard under other people's tools (issue 40): torch.compile'd models (item 7) and train-mode
dropout, whose masks every forward of a step must share (item 9)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from spikingjelly.activation_based import layer, neuron
from torch import nn

import szo.zo.guard as guard_module
from szo.evaluators import Batch
from szo.layout import param_layout
from szo.optim import SZO, build_optimizer
from szo.zo import ProbePath

T, N = 2, 6


def _plif(dropout: bool = False, node=neuron.ParametricLIFNode) -> nn.Module:
    """A SeqToANNContainer + ParametricLIFNode network (SpikingJelly's multi-step style); ``dropout``:
    torch's Dropout inside the first container (a new mask per time step) and SpikingJelly's
    layer.Dropout after the neurons (one mask per sequence)."""
    torch.manual_seed(0)
    first = [nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)] + ([nn.Dropout(0.3)] if dropout else [])
    mods = [layer.SeqToANNContainer(*first), node(step_mode="m")]
    if dropout:
        mods.append(layer.Dropout(0.5, step_mode="m"))
    mods.append(layer.SeqToANNContainer(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 10)))
    return nn.Sequential(*mods).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.rand(T, N, 1, 8, 8, generator=g) * 2, torch.randint(0, 10, (N,), generator=g)


def _loss(out, y, reduction="mean"):
    return nn.functional.cross_entropy(out.mean(0), y, reduction=reduction)


def _subspace(model: nn.Module, k: int = 3, layout: bool = False):
    d = sum(p.numel() for p in model.parameters())
    basis = torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(2)))[0]
    ref = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    lay = [{"name": n, "shape": list(s)} for n, s in param_layout(model)] if layout else None
    return SimpleNamespace(basis=basis, layout=lay, reference=ref, eigenvalues=torch.ones(k))


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


# ---------------------------------------------------------------------- torch.compile (item 7)
@pytest.mark.parametrize("layout", [False, True], ids=["in-memory", "with-layout"])
def test_szo_on_a_compiled_model_steps_as_on_the_model(layout):
    """``SZO(torch.compile(model), subspace)``: the first step's watch no longer dies inside dynamo,
    a subspace with the model's layout fits the compiled module (its names are the model's), and the
    steps are the uncompiled model's (eager backend: the same operations)."""
    x, y = _batch()
    plain, compiled_net = _plif(), _plif()
    sub = _subspace(plain, layout=layout)
    compiled = torch.compile(compiled_net, backend="eager")
    a = SZO(plain, sub, mu=0.5, lr=0.5, estimator="rge", q=2, generator=torch.Generator().manual_seed(3), scale="absolute")
    b = SZO(compiled, sub, mu=0.5, lr=0.5, estimator="rge", q=2, generator=torch.Generator().manual_seed(3), scale="absolute")
    for _ in range(2):
        la = a.step(lambda: _loss(plain(x), y))
        lb = b.step(lambda: _loss(compiled(x), y))
        assert float(la) == float(lb)
    assert torch.equal(_flat(plain), _flat(compiled_net)) and not torch.equal(_flat(plain), sub.reference)
    assert b.forward_passes == a.forward_passes == 2 * (2 * 2 + 1)


def test_the_watch_sees_inside_a_compiled_module_it_does_not_know():
    """Without the model the optimizer cannot reset neurons or freeze BN: a closure that runs a
    compiled stateful network (whose submodules run inside dynamo, where no hook sees them) is still
    refused at the compiled module's call."""
    net = _plif()
    compiled = torch.compile(net, backend="eager")
    x, y = _batch()
    opt = SZO(net.parameters(), _subspace(net), scale="absolute")
    before = _flat(net)
    with pytest.raises(ValueError, match="given no model; construct it as SZO\\(model, ...\\)"):
        opt.step(lambda: _loss(compiled(x), y))
    assert torch.equal(_flat(net), before)


# ---------------------------------------------------------------------- dropout (item 9)
def _masks(model: nn.Module, calls: list) -> list:
    """Forward hooks recording, per forward, torch Dropout's zero pattern (after a Conv + BN its input
    has no zeros) and SpikingJelly Dropout's mask."""
    record: list = []

    def torch_drop(_m, _i, out):
        record.append((out == 0).clone())

    def sj_drop(m, _i, _o):
        record.append(m.mask.clone())
        calls.append(list(record))
        record.clear()

    return [next(m for m in model.modules() if isinstance(m, nn.Dropout)).register_forward_hook(torch_drop),
            next(m for m in model.modules() if isinstance(m, layer.Dropout)).register_forward_hook(sj_drop)]


@pytest.mark.parametrize("method", ["szo-cge", "szo-rge", "zo-rge", "np-zo", "wp-zo", "fg", "fg-subspace"])
def test_every_forward_of_a_step_draws_the_same_dropout_masks(method):
    """Each probe (and the clean forward of the layer-wise learners, the JVP passes of forward gradients,
    the BN forward) sees the masks of the step; the next step draws new ones."""
    model = _plif(dropout=True)
    x, y = _batch()
    opt = build_optimizer(method, model, subspace=_subspace(model), mu=0.05, lr=0.01, q=2, scale="absolute",
                          node_losses="batch-mean" if method == "np-zo" else "per-sample")
    calls: list = []
    hooks = _masks(model, calls)
    steps = []
    for _ in range(2):
        calls.clear()
        opt.step(lambda: _loss(model(x), y, opt.loss_reduction))
        assert len(calls) == opt.last_step.forwards >= 2
        for other in calls[1:]:
            assert all(torch.equal(a, b) for a, b in zip(calls[0], other)), method
        steps.append(calls[0])
    for h in hooks:
        h.remove()
    assert not all(torch.equal(a, b) for a, b in zip(*steps))  # a new step, new masks
    assert 0 < float(steps[0][1].eq(0).float().mean()) < 1  # the masks drop some units


class _FixedMask(nn.Module):
    """Dropout with given masks (one per forward, in order): the network a probe pair should compare."""

    def __init__(self, masks):
        super().__init__()
        self.masks = masks

    def forward(self, x):
        return x * self.masks[0]


def test_a_dropout_step_is_the_step_of_the_network_with_that_steps_masks():
    """The oracle: with the step's masks fixed (dropout layers replaced by multiplications), the
    deterministic network takes the same SZO-CGE step. Without the replay (every probe its own masks)
    the step differs, so the test can tell."""
    x, y = _batch()

    def szo_step(model):
        opt = SZO(model, _subspace(model), mu=1e-3, lr=0.5, estimator="cge", scale="absolute")
        torch.manual_seed(7)
        opt.step(lambda: _loss(model(x), y))
        return _flat(model)

    dropped = _plif(dropout=True)
    # the masks the step's forwards draw: one forward from the step's random state
    probe = copy.deepcopy(dropped)
    drop_t = next(m for m in probe.modules() if isinstance(m, nn.Dropout))
    drop_s = next(m for m in probe.modules() if isinstance(m, layer.Dropout))
    seen = {}
    drop_t.register_forward_hook(lambda m, i, o: seen.update(t=o / i[0].masked_fill(i[0] == 0, 1)))
    drop_s.register_forward_hook(lambda m, i, o: seen.update(s=m.mask.clone()))
    torch.manual_seed(7)
    with torch.no_grad():
        probe(x)
    fixed = copy.deepcopy(dropped)
    fixed[0][2] = _FixedMask([seen["t"]])
    fixed[2] = _FixedMask([seen["s"]])
    expected = szo_step(fixed)
    assert torch.equal(szo_step(copy.deepcopy(dropped)), expected)

    class NoReplay(guard_module.RandomReplay):
        def restore(self):
            pass

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(guard_module, "RandomReplay", NoReplay)
        without = szo_step(copy.deepcopy(dropped))
    assert (without - expected).norm() > 1e-3 * (expected - _flat(dropped)).norm()


def test_the_batched_engine_refuses_train_mode_dropout_in_one_line():
    model = _plif(dropout=True, node=neuron.IFNode)  # the batched engine folds parameter-free neurons
    x, y = _batch()
    opt = SZO(model, _subspace(model), probes=ProbePath(engine="batched"), scale="absolute")
    with pytest.raises(ValueError, match=r"engine='batched' folds .* train-mode dropout \(0.2, 2\) .* "
                                         r"use engine='loop'") as e:
        opt.step(batch=Batch(x, y, _loss))
    assert "\n" not in str(e.value)
    for m in model.modules():
        if isinstance(m, (nn.Dropout, layer.Dropout)):
            m.eval()
    opt.step(batch=Batch(x, y, _loss))  # dropout off: folds as before
