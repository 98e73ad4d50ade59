"""szo.zo.guard: model-first API, start point, unknown-module guard, recompute BN update, bad input."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import szo.models as M
from szo.optim import SZO, BPSubspace, FullSpaceZO, HybridZO, LayerwiseZO, build_optimizer
from szo.zo import ProbePath


class Net(nn.Module):
    def __init__(self, bn: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6) if bn else nn.Identity()
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def sub_for(model, k=3, reference=True):
    d = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, k, generator=g))[0]
    ref = torch.randn(d, generator=g) if reference else None
    return SimpleNamespace(basis=basis, layout=[(n, tuple(p.shape)) for n, p in model.named_parameters()],
                           reference=ref)


def flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def batch(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_model_first_starts_at_the_reference_params_form_where_it_is():
    torch.manual_seed(0)
    model = Net()
    sub = sub_for(model)
    here = flat(model)
    SZO(model.parameters(), sub, model=model, scale="absolute")
    assert torch.equal(flat(model), here)  # params form: start="current"
    SZO(model, sub, start="current", scale="absolute")
    assert torch.equal(flat(model), here)
    SZO(model, sub, scale="absolute")
    assert torch.equal(flat(model), sub.reference)
    model2 = Net()
    BPSubspace(model2, sub, scale="absolute")
    assert torch.equal(flat(model2), sub.reference)
    model3 = Net()
    build_optimizer("szo-rge", model3, subspace=sub, lr=1.0, scale="absolute")
    assert torch.equal(flat(model3), sub.reference)


def make_opt(make: str, model: nn.Module, **kw):
    """One forward-only optimizer of each kind on ``model`` (the probes move it noticeably)."""
    if make == "szo":
        return SZO(model, sub_for(model), mu=0.3, lr=0.2, estimator="rge", q=2, probes=ProbePath(**kw), scale="absolute")
    if make == "zo":
        return FullSpaceZO(model, estimator="rge", q=2, mu=0.1, lr=0.1, **kw)
    if make == "hybrid":  # the signRGE phase (seed 000): centre + sign_q probes
        return HybridZO(model, sign_q=3, sign_mu=0.3, sign_lr=0.05, **kw)
    if make == "hybrid-cge":  # the CGE phase from the first step, central differences
        return HybridZO(model, switch_step=0, coords_per_step=2, mu=0.1, lr=0.1, cge="central", **kw)
    if make == "hybrid-cge1":  # the same, one-sided (seed 000's eq. 2, the default): the centre first
        return HybridZO(model, switch_step=0, coords_per_step=2, mu=0.1, lr=0.1, **kw)
    return LayerwiseZO(model, perturbation=make, q=2, mu=0.3, lr=0.1, **kw)  # node / weight (seed 004)


# probes per step: SZO/ZO-RGE 2q, signRGE sign_q + 1, CGE 2 per coordinate (one-sided: 1 + 1 per
# coordinate), layer-wise 1 + q L (L = 2 here)
PROBES = {"szo": 4, "zo": 4, "hybrid": 4, "hybrid-cge": 4, "hybrid-cge1": 3, "node": 5, "weight": 5}


@pytest.mark.parametrize("make", list(PROBES))
def test_recompute_stats_equal_an_unperturbed_forward_of_the_new_parameters(make):
    torch.manual_seed(0)
    model = Net().train()
    x, y = batch()
    opt = make_opt(make, model)
    before = copy.deepcopy(model.state_dict())  # after the start point was set
    loss = opt.step(lambda: nn.functional.cross_entropy(model(x), y, reduction=opt.loss_reduction))
    assert opt.forward_passes == opt.forwards_per_step == PROBES[make] + 1
    oracle = Net().train()
    oracle.load_state_dict(before)
    torch.nn.utils.vector_to_parameters(flat(model), oracle.parameters())
    with torch.no_grad():
        ref_loss = nn.functional.cross_entropy(oracle(x), y)
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(model.state_dict()[k], oracle.state_dict()[k]), k
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6)  # step returns the unperturbed loss
    assert opt.last_outputs_unperturbed


@pytest.mark.parametrize("bn_update", ["probe-mean", "recompute"])
@pytest.mark.parametrize("make", list(PROBES))
def test_every_probe_starts_from_the_steps_bn_stats_and_the_step_updates_them_once(make, bn_update):
    """The same BN convention for every forward-only optimizer: the closure calls of a step
    (probes, the signRGE centre, the layer-wise clean forward, the BN forward) all start from the
    statistics the step started with; afterwards the statistics advanced by one update: the mean
    of what the probes produced (probe-mean) or exactly what the last call, the BN forward of
    theta_{t+1}, produced (recompute)."""
    torch.manual_seed(0)
    model = Net().train()
    x, y = batch()
    bn = model.bn
    opt = make_opt(make, model, bn_update=bn_update)
    rm0, rv0, n0 = bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)
    seen, after = [], []

    def closure():
        seen.append((bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)))
        out = nn.functional.cross_entropy(model(x), y, reduction=opt.loss_reduction)
        after.append((bn.running_mean.clone(), bn.running_var.clone()))
        return out

    loss = opt.step(closure)
    recompute = bn_update == "recompute"
    assert len(seen) == opt.forward_passes == opt.forwards_per_step == PROBES[make] + recompute
    for rm, rv, n in seen:
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0) and n == n0
    assert int(bn.num_batches_tracked) == n0 + 1
    assert opt.last_outputs_unperturbed is recompute
    assert opt.last_losses is not None and opt.last_losses.numel() == PROBES[make]  # at theta_t: the probes
    if recompute:
        assert torch.equal(bn.running_mean, after[-1][0]) and torch.equal(bn.running_var, after[-1][1])
    else:
        torch.testing.assert_close(bn.running_mean, torch.stack([a[0] for a in after]).mean(0))
        torch.testing.assert_close(bn.running_var, torch.stack([a[1] for a in after]).mean(0))
        # step returns a loss at theta_t: the mean probe loss, or the clean / centre forward's
        expect = (float(opt.last_losses.mean()) if make in ("szo", "zo", "hybrid-cge")
                  else float(opt.last_losses[0]))
        assert float(loss) == pytest.approx(expect, rel=1e-6)
    assert not torch.equal(bn.running_mean, rm0)


@pytest.mark.parametrize("make", ["szo-cge"] + list(PROBES))
def test_recompute_costs_nothing_without_train_mode_bn(make):
    x, y = batch()
    for model in (Net(bn=False), Net().eval()):
        opt = SZO(model, sub_for(model), estimator="cge", scale="absolute") if make == "szo-cge" else make_opt(make, model)
        calls = []
        opt.step(lambda: calls.append(1) or nn.functional.cross_entropy(model(x), y, reduction=opt.loss_reduction))
        assert len(calls) == opt.forward_passes == opt.forwards_per_step == PROBES.get(make, 6)
        assert not opt.last_outputs_unperturbed


def test_params_form_without_model_is_fine_for_a_stateless_bn_free_closure_and_refuses_bn():
    x, y = batch()
    plain = Net(bn=False)
    SZO(plain.parameters(), sub_for(plain), scale="absolute").step(lambda: nn.functional.cross_entropy(plain(x), y))
    model = Net().train()
    with pytest.raises(ValueError, match="runs BatchNorm1d, a train-mode BatchNorm layer .* given no model"):
        FullSpaceZO(model.parameters()).step(lambda: nn.functional.cross_entropy(model(x), y))
    other = Net().train()
    opt = SZO(model, sub_for(model), scale="absolute")
    with pytest.raises(ValueError, match="not part of model= \\(Net\\)"):
        opt.step(lambda: nn.functional.cross_entropy(other(x), y))


def test_bad_input_one_clear_error_each():
    model = Net()
    sub = sub_for(model)
    with pytest.raises(ValueError, match="the model \\(Identity\\) has no parameters to train"):
        SZO(nn.Identity(), sub, scale="absolute")
    with pytest.raises(ValueError, match="has no parameters to train"):
        build_optimizer("szo-cge", nn.Identity(), subspace=sub, lr=1.0)
    convnet = M.create("spike_convnet", T=2)
    with pytest.raises(ValueError, match="the subspace does not fit these parameters"):
        SZO(convnet, sub, scale="absolute")
    with pytest.raises(ValueError, match="needs subspace.reference"):
        SZO(model, sub_for(model, reference=False), scale="absolute")
    with pytest.raises(ValueError, match="unknown start 'best'; valid: reference"):
        SZO(model, sub, start="best", scale="absolute")
    with pytest.raises(ValueError, match="unknown bn_update 'mean'; valid: recompute, probe-mean"):
        SZO(model, sub, probes=ProbePath(bn_update="mean"), scale="absolute")
    with pytest.raises(ValueError, match="unknown bn_update 'mean'"):
        FullSpaceZO(model, bn_update="mean")
    with pytest.raises(ValueError, match="unknown bn_update 'mean'; valid: recompute, probe-mean"):
        HybridZO(model, bn_update="mean")
    with pytest.raises(ValueError, match="unknown bn_update 'mean'; valid: recompute, probe-mean"):
        LayerwiseZO(model, bn_update="mean")
    with pytest.raises(ValueError, match="bn_update 'mean'; valid: recompute, probe-mean"):
        build_optimizer("np-zo", model, lr=0.1, bn_update="mean")  # the options record: the recipe's check
    # one check (szo.zo.guard.check_hparams) for every optimizer's hyperparameters
    for cls in (FullSpaceZO, HybridZO, LayerwiseZO):  # FullSpaceZO / HybridZO took a negative lr before
        with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
            cls(model, lr=-1)
    with pytest.raises(ValueError, match="q must be an integer >= 1, got True"):
        SZO(model, sub, estimator="rge", q=True, scale="absolute")
    with pytest.raises(ValueError, match="momentum must be in \\[0, 1\\), got 1.0"):
        FullSpaceZO(model, momentum=1.0)
    with pytest.raises(ValueError, match="give the model once"):
        SZO(model, sub, model=Net(), scale="absolute")
    with pytest.raises(ValueError, match="not all parameters of model="):
        SZO(Net().parameters(), sub, model=model, scale="absolute")
