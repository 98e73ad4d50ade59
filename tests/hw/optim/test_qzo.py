"""Seed-004 quantized ZO: eq. 8 on hand-computed cases, and OnChipSZO(rule="eq8") through the fixed-point forward."""
import pytest
import torch
from torch import nn

from szo.hw.optim.onchip import OnChipSZO, quantized_zo_update
from szo.hw.xorshift import XorShift32


def test_eq8_hand_computed():
    theta = torch.tensor([10, -5, 127, -128], dtype=torch.int64)
    # N Q / (N Q + d - 1) = 4 / (4 + 5 - 1) = 0.5; lr / s**2 = 0.01 * 64 = 0.64; factor 0.32
    kw = dict(lr=0.01, scale=2.0 ** -3, n=1, q=4, d=5, bits=8)
    g = torch.tensor([10.0, -10.0, 2.0, 3.0])
    # steps round([3.2, -3.2, 0.64, 0.96]) = [3, -3, 1, 1]
    assert quantized_zo_update(theta, g, **kw).tolist() == [7, -2, 126, -128]  # -129 clips to -Q_N = -128
    g = torch.tensor([0.5, -0.25, -3.0, 1.5625])
    # steps round([0.16, -0.08, -0.96, 0.5]) = [0, 0, -1, 0] (0.5 rounds to even: 0); 128 clips to Q_P = 127
    assert quantized_zo_update(theta, g, **kw).tolist() == [10, -5, 127, -128]
    # N Q = 2 * 3 = 6, d = 1: no gradient-norm shrink; lr / s**2 = 1 with s = 1: plain rounded SGD
    out = quantized_zo_update(torch.tensor([0], dtype=torch.int64), torch.tensor([-2.6]), lr=1.0, scale=1.0,
                              n=2, q=3, d=1, bits=4)
    assert out.tolist() == [3]


def test_eq8_bad_input():
    t = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        quantized_zo_update(t.float(), t.float(), lr=1.0, scale=1.0, n=1, q=1, d=2, bits=8)
    with pytest.raises(ValueError, match="q must be"):
        quantized_zo_update(t, t.float(), lr=1.0, scale=1.0, n=1, q=0, d=2, bits=8)


@pytest.mark.parametrize("lr", [1e15, 1e30, 1e200])
def test_eq8_saturates_at_any_lr_and_never_wraps(lr):
    """Eq. 8 transcribed in Python's unbounded integers, against the int64 update: past 2**63 a torch
    float -> int64 conversion wraps to -2**63, so at lr 1e30 six of ten biases used to end at the
    bound opposite to lr 1e15's."""
    g = torch.tensor([3.5, -2.0, 1e-9, -1e-9, 0.0, 7.0, -7.0, 0.25])
    theta = torch.tensor([0, 5, -5, 127, -128, -128, 127, 1], dtype=torch.int64)
    kw = dict(scale=2.0 ** -12, n=1, q=10, d=8, bits=13)
    factor = 10 / (10 + 8 - 1) * lr / 2.0 ** -24
    want = [min(4095, max(-4096, t - round(factor * gi))) for t, gi in zip(theta.tolist(), g.tolist())]
    assert quantized_zo_update(theta, g, lr=lr, **kw).tolist() == want
    assert want[:2] == [-4096, 4095]  # the sign of the step decides the bound, at every lr


def test_eq8_refuses_what_has_no_integer():
    t = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot round NaN"):
        quantized_zo_update(t, torch.tensor([float("nan"), 1.0]), lr=0.1, scale=1.0, n=1, q=1, d=2, bits=8)
    with pytest.raises(ValueError, match="not a finite float: lower the lr"):
        quantized_zo_update(t, torch.ones(2), lr=float("inf"), scale=1.0, n=1, q=1, d=2, bits=8)
    with pytest.raises(ValueError, match=r"bits must be an int in \[2, 61\]"):
        quantized_zo_update(t, torch.ones(2), lr=0.1, scale=1.0, n=1, q=1, d=2, bits=63)


def test_integer_momentum_step_saturates_at_any_lr():
    """The on-chip learner's momentum rule: a step past int64 saturates on its own side too."""
    from szo.zo import integer_heavy_ball

    g = torch.tensor([1.0, -1.0, 0.0])
    delta = torch.zeros(3, dtype=torch.int64)
    for lr in (1e12, 1e30):
        out = integer_heavy_ball(delta, g, lr=lr, frac_bits=16, momentum_int=230, shift=8, bits=32)
        assert out.tolist() == [-(2 ** 31), 2 ** 31 - 1, 0]


class _Quadratic(nn.Module):
    """A 'model' with flat_params / load_flat_params whose loss is a known quadratic."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def flat_params(self):
        return self.w.detach().reshape(-1).clone()

    def load_flat_params(self, v):
        with torch.no_grad():
            self.w.copy_(v.view_as(self.w))


def test_on_chip_eq8_step_equals_eq6_then_eq8_by_hand():
    from subspace_store import Subspace

    d, k, q, seed, frac = 6, 3, 4, 11, 2
    m = _Quadratic(d)
    P = torch.eye(d)[:, :k]
    sub = Subspace(P, torch.zeros(d), torch.zeros(d), torch.ones(k), torch.ones(k) / k)
    target = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 0.0])
    closure = lambda: ((m.w - target) ** 2).sum()  # noqa: E731
    opt = OnChipSZO(m, sub, lr=0.3, estimator="rademacher", rule="eq8", q=q, seed=seed, mu_lsb=1,
                    coord_bits=8, coord_frac=frac, ref_bits=16)
    assert opt.forwards_per_step == 1 + q and "momentum" not in opt.state_bits()
    opt.step(closure)
    # by hand: the step seed is the first XORShift32 draw of `seed`, the q directions follow from it
    g_step = XorShift32(XorShift32(seed).next())
    Z = torch.stack([g_step.rademacher(k) for _ in range(q)])
    s = 2.0 ** -frac
    def loss(c):  # as the model: float32
        return float((((P.double() @ (c.double() * s)).float() - target) ** 2).sum())

    l0 = loss(torch.zeros(k))
    g = sum((loss(z.double()) - l0) / 1.0 * z.double() for z in Z) / q  # eq. 6, mu = 1 LSB
    step = torch.round(q / (q + k - 1) * 0.3 / s ** 2 * g)
    assert opt.c.tolist() == (-step).clamp(-128, 127).to(torch.int64).tolist()
    assert opt.c.abs().sum() > 0 and opt.forward_passes == 1 + q
    # descent on the quadratic: the loss at c is below the loss at 0
    assert loss(opt.c.double()) < l0


def test_on_chip_eq8_rejects_cge():
    from subspace_store import Subspace

    m = _Quadratic(4)
    sub = Subspace(torch.eye(4)[:, :2], torch.zeros(4), torch.zeros(4), torch.ones(2), torch.ones(2) / 2)
    with pytest.raises(ValueError, match="valid estimator for it: 'rademacher'"):
        OnChipSZO(m, sub, estimator="cge", rule="eq8")
    with pytest.raises(ValueError, match="valid: \\['momentum', 'eq8'\\]"):
        OnChipSZO(m, sub, rule="eq9")


def test_qzo_method_config():
    from szo.config import load_recipe

    c = load_recipe("digits-fixed", ["method=qzo-subspace"])
    assert c["method"] == "qzo-subspace" and c["hw"]["learner"] == "integer" and c["backend"] == "fixed"
    with pytest.raises(ValueError, match="qzo-subspace"):
        load_recipe("digits-scratch", ["method=qzo-subspace"])
