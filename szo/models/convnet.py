"""A small spiking ConvNet sized for 8x8 scikit-learn digits (trains in seconds on CPU)."""

from __future__ import annotations

import torch
from spikingjelly.activation_based import layer

from szo.models.base import SpikingModel, positive_int
from szo.models.neurons import make_neuron
from szo.models.registry import register_model
from szo.models.streaming import BatchNorm2d


class SpikeConvNet(SpikingModel):
    """(conv3x3-BN-neuron) x2 -> 2x2 avgpool -> flatten -> Linear.

    The classifier input is fixed by an adaptive pool to 4x4, so any input >= 4x4 works.
    Width 16 with 10 classes: 5,082 parameters.
    """

    def __init__(self, *, num_classes: int, T: int, in_channels: int, width: int,
                 activation: str, model_name: str) -> None:
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        positive_int("in_channels", in_channels)
        positive_int("width", width)
        self.conv1 = layer.Conv2d(in_channels, width, 3, padding=1, bias=False, step_mode="m")
        self.bn1 = BatchNorm2d(width, step_mode="m")
        self.sn1 = make_neuron(activation)
        self.conv2 = layer.Conv2d(width, width, 3, padding=1, bias=False, step_mode="m")
        self.bn2 = BatchNorm2d(width, step_mode="m")
        self.sn2 = make_neuron(activation)
        self.pool = layer.AdaptiveAvgPool2d((4, 4), step_mode="m")
        self.flatten = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(width * 16, num_classes, step_mode="m")

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        x = self.sn1(self.bn1(self.conv1(x_seq)))
        x = self.sn2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


@register_model
def spike_convnet(num_classes: int = 10, T: int = 4, activation: str = "lif",
                  in_channels: int = 1, width: int = 16, bn_time: str = "shared") -> SpikeConvNet:
    """Small spiking ConvNet for 8x8 digits (~5k params at width 16); ``bn_time``: ``SpikingModel.set_bn_time``."""
    model = SpikeConvNet(num_classes=num_classes, T=T, in_channels=in_channels, width=width,
                         activation=activation, model_name="spike_convnet")
    return model.set_bn_time(bn_time)
