"""Fully connected spiking networks for channel data such as SHD's 700 input units: a feed-forward
LIF network (``snn_mlp``) and a recurrent one (``snn_rlif``: each hidden layer also receives its own
spikes of the previous time step through a learned weight matrix, the SHD baseline of Cramer et al.).

Each frame (``[C, H, W]``, e.g. SHD's ``[1, 1, 700]``) is flattened to ``in_features`` inputs.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from spikingjelly.activation_based import base, layer
from torch import nn

from szo.models.base import SpikingModel, positive_int
from szo.models.neurons import make_neuron
from szo.models.registry import register_model


class RecurrentSpikingLayer(base.MemoryModule):
    """``s_t = neuron(W x_t + V s_{t-1})`` over ``[T, N, in]``; ``s_{t-1}`` is kept as neuron state
    (reset with the network, carried inside ``persistent_state()``)."""

    def __init__(self, in_features: int, out_features: int, activation: str) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.rec = nn.Linear(out_features, out_features, bias=False)
        self.sn = make_neuron(activation, step_mode="s") if activation == "lif" else make_neuron(activation)
        self.register_memory("spikes", 0.0)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        drive = self.fc(x_seq)  # [T, N, out], all steps at once
        if not isinstance(self.spikes, torch.Tensor):
            self.spikes = torch.zeros_like(drive[0])
        out = []
        for t in range(drive.shape[0]):
            self.spikes = self.sn(drive[t] + self.rec(self.spikes))
            out.append(self.spikes)
        return torch.stack(out)


class SpikeMLP(SpikingModel):
    """flatten -> (Linear -> LIF) x ``layers`` (recurrent: ``RecurrentSpikingLayer``) -> Linear readout."""

    def __init__(self, *, num_classes: int, T: int, in_features: int, hidden: int, layers: int, recurrent: bool,
                 activation: str, model_name: str) -> None:
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        positive_int("in_features", in_features)
        positive_int("hidden", hidden)
        positive_int("layers", layers)
        self.in_features = in_features
        self.flatten = layer.Flatten(start_dim=1, step_mode="m")
        blocks: list[nn.Module] = []
        width = in_features
        for _ in range(layers):
            if recurrent:
                blocks.append(RecurrentSpikingLayer(width, hidden, activation))
            else:
                blocks += [layer.Linear(width, hidden, step_mode="m"), make_neuron(activation)]
            width = hidden
        self.hidden = nn.Sequential(*blocks)
        self.fc = layer.Linear(hidden, num_classes, step_mode="m")

    def forward(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        """``SpikingModel.forward``, after checking that a frame holds ``in_features`` values."""
        if isinstance(x, torch.Tensor) and x.dim() in (4, 5) and math.prod(x.shape[-3:]) != self.in_features:
            raise ValueError(f"{self.model_name} takes frames of {self.in_features} values, got input "
                             f"{tuple(x.shape)} ({math.prod(x.shape[-3:])} per frame); set model.kwargs.in_features")
        return super().forward(x, **kw)

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        return self.fc(self.hidden(self.flatten(x_seq)))


def _check_bn(name: str, bn_time: str) -> None:
    if bn_time != "shared":
        raise ValueError(f"{name} has no BatchNorm: bn_time must be 'shared', got {bn_time!r}")


@register_model
def snn_mlp(num_classes: int = 20, T: int = 100, activation: str = "lif", in_channels: int = 1,
            in_features: int = 700, hidden: int = 128, layers: int = 1, bn_time: str = "shared") -> SpikeMLP:
    """Feed-forward LIF network on flattened frames (SHD: 700 inputs, 20 classes). ``in_channels`` is
    accepted for the recipes' data-set default and not used: ``in_features`` is the flattened frame."""
    _check_bn("snn_mlp", bn_time)
    return SpikeMLP(num_classes=num_classes, T=T, in_features=in_features, hidden=hidden, layers=layers,
                    recurrent=False, activation=activation, model_name="snn_mlp")


@register_model
def snn_rlif(num_classes: int = 20, T: int = 100, activation: str = "lif", in_channels: int = 1,
             in_features: int = 700, hidden: int = 128, layers: int = 1, bn_time: str = "shared") -> SpikeMLP:
    """Recurrent LIF network (each hidden layer fed back its previous spikes) on flattened frames."""
    _check_bn("snn_rlif", bn_time)
    return SpikeMLP(num_classes=num_classes, T=T, in_features=in_features, hidden=hidden, layers=layers,
                    recurrent=True, activation=activation, model_name="snn_rlif")
