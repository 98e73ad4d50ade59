"""Seed-004 Table 3 memory model: the paper's identical-layer formulas, and our SNN's dimensions."""
import pytest
import torch
from torch import nn

from szo.hw.reports.memory import LayerDims, layer_dims, training_memory


def test_identical_layers_reduce_to_table3():
    L, d_w, d_a, N, Q = 4, 100, 30, 8, 5
    mem = training_memory([LayerDims(str(i), d_w, d_a) for i in range(L)], n=N, q=Q)
    assert mem == {"inference": N * (2 * d_a + d_w), "weight_perturbation": L * d_w,
                   "weight_perturbation_efficient": L * Q, "node_perturbation": N * L * d_a + L * d_w,
                   "node_perturbation_efficient": N * L * Q + d_w, "backprop": N * L * d_a + L * d_w}
    assert training_memory([LayerDims("a", 1, 1)], n=1, q=1, bytes_per_value=4)["backprop"] == 8


def test_layer_dims_of_spike_convnet_scale_with_T():
    from szo.models import create

    for T in (2, 4):
        torch.manual_seed(0)
        m = create("spike_convnet", T=T, width=16)
        dims = layer_dims(m, torch.rand(3, 1, 8, 8))
        # conv 1->16 3x3 (no bias), conv 16->16 3x3, fc 256->10; outputs 16x8x8, 16x8x8, 10 per step
        assert [(d.name, d.d_w, d.d_a) for d in dims] == [("conv1", 144, T * 1024), ("conv2", 2304, T * 1024),
                                                          ("fc", 2570, T * 10)]
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [(d.d_w, d.d_a) for d in layer_dims(mlp, torch.zeros(5, 3))] == [(16, 4), (10, 2)]


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        training_memory([], n=1, q=1)
    with pytest.raises(ValueError, match="q must be"):
        training_memory([LayerDims("a", 1, 1)], n=1, q=0)
