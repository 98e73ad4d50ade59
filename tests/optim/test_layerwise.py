"""Layer-wise node / weight perturbation (seed 004) against autograd on a smooth toy."""
import pytest
import torch
from torch import nn

from szo.optim import build_optimizer
from szo.optim.layerwise import LayerwiseZO, trainable_layers


def _toy(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    return model, lambda reduction="mean": _reduce(((model(x) - y) ** 2).mean(1), reduction)


def _reduce(per_sample, reduction):
    return per_sample if reduction == "none" else per_sample.mean()


def _for(opt, loss):
    """The closure ``szo.train.fit`` gives ``opt``: per-sample losses where it asks for them."""
    return lambda: loss(opt.loss_reduction)


def _estimate(perturbation, q, mu=1e-5):
    """One step with lr 1, momentum 0: the parameter change is minus the estimate."""
    model, closure = _toy()
    with torch.enable_grad():
        model.zero_grad()
        closure().backward()
    true = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = LayerwiseZO(model, perturbation=perturbation, mu=mu, lr=1.0, momentum=0.0, q=q,
                      generator=torch.Generator().manual_seed(1))
    opt.step(_for(opt, closure))
    est = before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return est, true, opt


@pytest.mark.parametrize("perturbation", ["node", "weight"])
def test_estimate_points_along_the_autograd_gradient(perturbation):
    est, true, _ = _estimate(perturbation, q=400)
    cos = float(torch.nn.functional.cosine_similarity(est, true, dim=0))
    assert cos > 0.85, cos


def test_more_probes_point_closer():
    for pert in ("node", "weight"):
        cos = [float(torch.nn.functional.cosine_similarity(*_estimate(pert, q=q)[:2], dim=0)) for q in (10, 400)]
        assert cos[0] < cos[1], (pert, cos)


def test_forward_count_and_sparse_layers():
    model, closure = _toy()
    first = model[0].weight.detach().clone()
    opt = LayerwiseZO(model, layers=["2"], q=3, generator=torch.Generator().manual_seed(0))
    opt.step(_for(opt, closure))
    assert opt.forward_passes == opt.forwards_per_step == 1 + 3
    assert torch.equal(model[0].weight, first)  # not in `layers`: untouched
    opt2 = LayerwiseZO(_toy()[0], q=2)
    assert opt2.forwards_per_step == 1 + 2 * 2


def test_adaptive_picks_the_smaller_dimension():
    model, closure = _toy()
    opt = LayerwiseZO(model, perturbation="adaptive", q=1)
    opt.step(_for(opt, closure))
    # layer 0: 5 nodes per sample < 35 weights -> node; layer 2: 3 nodes < 18 weights -> node
    assert opt.modes == {"0": "node", "2": "node"}
    big_out = nn.Sequential(nn.Linear(2, 40)).double()
    opt = LayerwiseZO(big_out, perturbation="adaptive", q=1)
    opt.step(lambda: big_out(torch.ones(4, 2, dtype=torch.float64)).pow(2).mean(1))
    assert opt.modes == {"0": "node"}  # 40 nodes < 120 weights
    tiny = nn.Sequential(nn.Linear(1, 3, bias=False)).double()
    opt = LayerwiseZO(tiny, perturbation="adaptive", q=1)
    opt.step(lambda: tiny(torch.ones(4, 1, dtype=torch.float64)).pow(2).mean(1))
    assert opt.modes == {"0": "node"}  # a tie, 3 weights and 3 nodes: NP (Sec. 3.2.2: WP only if d_w < d_a)
    conv = nn.Sequential(nn.Conv1d(1, 1, 1, bias=False)).double()
    opt = LayerwiseZO(conv, perturbation="adaptive", q=1)
    opt.step(lambda: conv(torch.ones(4, 1, 5, dtype=torch.float64)).pow(2).mean((1, 2)))
    assert opt.modes == {"0": "weight"}  # 1 weight < 5 nodes


def test_adaptive_compares_the_dimension_each_node_estimate_has():
    """Per-sample node losses (Algorithm 1): one sample's nodes per loss difference, so the rule
    compares the per-sample node count with the weights (Sec. 3.2.2). Batch-mean losses: one
    difference is shared by the nodes of all N samples, so the node side counts N times as many."""
    net = nn.Sequential(nn.Linear(2, 40)).double()
    x = torch.ones(4, 2, dtype=torch.float64)
    opt = LayerwiseZO(net, perturbation="adaptive", q=1, per_sample=False)
    opt.step(lambda: net(x).pow(2).mean())
    assert opt.modes == {"0": "weight"}  # 4 samples x 40 nodes = 160 > 120 weights


def test_spiking_model_step_and_state_dict_round_trip():
    from szo.models import create

    torch.manual_seed(0)
    model = create("spike_convnet", T=2, width=4)
    x, y = torch.rand(6, 1, 8, 8), torch.randint(0, 10, (6,))
    closure = lambda: nn.functional.cross_entropy(model(x).mean(0), y, reduction="none")  # noqa: E731
    opt = build_optimizer("np-zo", model, lr=0.1, mu=0.01, q=2)
    before = model.flat_params().clone()
    opt.step(closure)
    assert opt.forward_passes == 1 + 2 * 3 + 1  # conv1, conv2, fc; the BN forward (bn_update="recompute")
    assert not torch.equal(before, model.flat_params())
    opt2 = build_optimizer("np-zo", model, lr=0.1, mu=0.01, q=2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.forward_passes == opt.forward_passes and opt2.modes == opt.modes


def test_bad_input():
    model, _ = _toy()
    with pytest.raises(ValueError, match="valid: node, weight, adaptive"):
        LayerwiseZO(model, perturbation="nodes")
    with pytest.raises(ValueError, match="unknown layer"):
        LayerwiseZO(model, layers=["fc"])
    with pytest.raises(ValueError, match="q must be"):
        LayerwiseZO(model, q=0)
    with pytest.raises(ValueError, match="no nn.Linear"):
        trainable_layers(nn.Sequential(nn.Tanh()))
    with pytest.raises(ValueError, match="unknown method"):
        build_optimizer("np_zo", model, lr=0.1)


def test_weight_probes_keep_parameter_storage():
    model, closure = _toy()
    ptrs = [p.data_ptr() for p in model.parameters()]
    opt = LayerwiseZO(model, perturbation="weight", q=2)
    opt.step(_for(opt, closure))
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # updated in place, not re-pointed


def test_the_adaptive_rule_has_one_home_and_takes_node_perturbation_on_a_tie():
    """Seed 004 Sec. 3.2.2: WP if d_w < d_a, otherwise NP; the float learner (LayerwiseZO) once took
    WP on a tie while the integer one (MCUZO) took NP. Both now call szo.zo.adaptive_perturbation."""
    import inspect

    from szo.hw.optim import mcu
    from szo.optim import layerwise
    from szo.zo import adaptive_perturbation

    assert adaptive_perturbation(4, 5) == "weight"
    assert adaptive_perturbation(5, 5) == "node" and adaptive_perturbation(6, 5) == "node"
    for module in (layerwise, mcu):
        src = inspect.getsource(module)
        assert "adaptive_perturbation(" in src and '"weight" if' not in src and '"node" if' not in src
