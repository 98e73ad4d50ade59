import math

import pytest
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import functional as sjf

from szo.losses import accuracy, entropy_loss, get_loss, mean_output_ce, tet_loss


def _batch(seed=0, T=4, N=5, C=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, N, C, generator=g) * 2, torch.randint(0, C, (N,), generator=g)


@pytest.mark.parametrize("lamb,phi", [(0.05, 1.0), (0.3, 0.5), (0.0, 1.0)])
def test_tet_matches_spikingjelly_plus_mse(lamb, phi):
    out, y = _batch()
    ref = (1 - lamb) * sjf.temporal_efficient_training_cross_entropy(out, y) + lamb * ((out - phi) ** 2).mean()
    assert torch.allclose(tet_loss(out, y, lamb=lamb, phi=phi), ref, atol=1e-6)


def test_tet_gradients_flow():
    out, y = _batch()
    out.requires_grad_(True)
    tet_loss(out, y).backward()
    assert out.grad is not None and out.grad.abs().sum() > 0


def test_entropy_hand_computed():
    # T=2, N=2, C=2: time-averaged logits [0, 0] (entropy ln 2) and [ln 3, 0] (p = 3/4, 1/4)
    out = torch.tensor([[[0.0, 0.0], [2 * math.log(3), 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    h1 = math.log(2)
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropy_loss(out).item() == pytest.approx((h1 + h2) / 2, abs=1e-6)


def test_mean_output_ce_and_accuracy():
    out, y = _batch(1)
    assert torch.allclose(mean_output_ce(out, y), F.cross_entropy(out.mean(0), y))
    pred = out.mean(0).argmax(1)
    assert accuracy(out, pred) == 1.0
    assert accuracy(out, (pred + 1) % 3) == 0.0


def test_get_loss_names_and_errors():
    out, y = _batch()
    assert torch.allclose(get_loss("tet", lamb=0.1)(out, y), tet_loss(out, y, lamb=0.1))
    assert torch.allclose(get_loss("entropy")(out, y), entropy_loss(out))
    with pytest.raises(ValueError, match="valid: tet, ce, rate-mse, entropy"):
        get_loss("mse")
    with pytest.raises(ValueError, match=r"\[T, N, C\]"):
        tet_loss(out[0], y)
