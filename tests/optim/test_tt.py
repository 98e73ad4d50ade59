"""HybridZO (seed 000's signRGE-then-CGE) and method tt-zo."""
import copy

import pytest
import torch

import szo.models as M
from szo.functional import zo as F
from szo.models.tt import tt_parametrize
from szo.optim import HybridZO, build_optimizer

from .test_szo import Tiny, data, flat


def _closure(model, x, y):
    return lambda: torch.nn.functional.cross_entropy(model(x), y)


def test_sign_rge_step_is_the_papers_update():
    torch.manual_seed(0)
    model = Tiny().double()
    x, y = data()
    x = x.double()
    theta0 = flat(model)
    q, mu, slr = 4, 0.1, 0.01
    opt = HybridZO(model.parameters(), model=model, sign_lr=slr, sign_q=q, sign_mu=mu,
                   generator=torch.Generator().manual_seed(5))
    loss_at = lambda t: float(torch.nn.functional.cross_entropy(_at(model, t, x), y))  # noqa: E731
    l0 = loss_at(theta0)
    xi = F.sample_gaussian(q, theta0.numel(), torch.Generator().manual_seed(5), dtype=torch.float64)
    g = torch.stack([(loss_at(theta0 + mu * xi[j]) - l0) / mu * xi[j] for j in range(q)]).mean(0)
    out = opt.step(_closure(model, x, y))
    assert abs(float(out) - l0) < 1e-6  # returned as a float32 tensor, like the other optimizers
    assert torch.allclose(flat(model), theta0 - slr * torch.sign(g), atol=1e-12)
    assert opt.forward_passes == q + 1 and opt.phase == "sign-rge"


def _at(model, theta, x):
    m = copy.deepcopy(model)
    off = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(theta[off : off + p.numel()].view_as(p))
            off += p.numel()
    return m(x)


def test_switches_to_cge_at_switch_step_and_on_a_plateau():
    model = Tiny()
    x, y = data()
    opt = HybridZO(model.parameters(), model=model, switch_step=2, coords_per_step=3, sign_q=2, cge="central")
    for _ in range(2):
        opt.step(_closure(model, x, y))
    assert opt.phase == "cge" and opt.hybrid_state["switched_at"] == 2 and opt.forwards_per_step == 6
    fp = opt.forward_passes
    opt.step(_closure(model, x, y))
    assert opt.forward_passes - fp == 6  # central CGE: 2 per coordinate
    one_sided = HybridZO(model.parameters(), model=model, switch_step=0, coords_per_step=3)
    assert one_sided.forwards_per_step == 3 + 1  # seed 000's eq. (2): the centre and one per coordinate
    # plateau: with sign_lr = 0 the loss never improves -> switch after the second window
    plateau = HybridZO(model.parameters(), model=model, sign_lr=0.0, window=3, tol=0.01)
    for i in range(6):
        assert plateau.phase == "sign-rge", i
        plateau.step(_closure(model, x, y))
    assert plateau.phase == "cge" and plateau.hybrid_state["switched_at"] == 6


def test_state_dict_keeps_the_phase():
    model = Tiny()
    x, y = data()
    opt = HybridZO(model.parameters(), model=model, switch_step=1)
    opt.step(_closure(model, x, y))
    other = HybridZO(model.parameters(), model=model)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.phase == "cge" and other.hybrid_state["steps"] == 1
    with pytest.raises(ValueError, match="sign_q"):
        HybridZO(model.parameters(), model=model, sign_q=0)


def test_build_optimizer_tt_zo_trains_the_tt_cores():
    model = M.create("spike_convnet", num_classes=10, T=2)
    with pytest.raises(ValueError, match="TT-parameterise the model first"):
        build_optimizer("tt-zo", model, lr=0.1)
    rep = tt_parametrize(model, 2)
    opt = build_optimizer("tt-zo", model, lr=0.1, mu=0.01, tt={"sign_q": 3, "switch_step": None})
    assert isinstance(opt, HybridZO) and opt.d == rep["d_tt"] < rep["d_dense"]
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    from szo.losses import tet_loss

    before = flat(model)
    with torch.no_grad():
        opt.step(lambda: tet_loss(model(x), y))
    # sign_q + 1 probes and the unperturbed BN forward (bn_update="recompute", BN in train mode)
    assert not torch.equal(flat(model), before) and opt.forward_passes == opt.forwards_per_step == 3 + 1 + 1
