"""A small spiking ConvNet sized for 8x8 scikit-learn digits (trains in seconds on CPU)."""

from __future__ import annotations

import torch
from spikingjelly.activation_based import layer

from szo.models.base import SpikingModel, positive_int
from szo.models.neurons import make_neuron
from szo.models.pooling import AdaptiveAvgPool2d
from szo.models.registry import register_model
from szo.models.streaming import BatchNorm2d

NORMS = ("batch", "group")
"""spike_convnet's normalisation: BatchNorm (running statistics) or GroupNorm (none: nothing but the
weights describes the model, e.g. for federated clients -- BAFFLE's guideline)."""


def _norm(norm: str, width: int, groups: int):
    if norm == "batch":
        return BatchNorm2d(width, step_mode="m")
    return layer.GroupNorm(groups, width, step_mode="m")


class SpikeConvNet(SpikingModel):
    """(conv3x3-norm-neuron) x2 -> 2x2 avgpool -> flatten -> Linear; norm BatchNorm or GroupNorm.

    The classifier input is fixed by an adaptive pool to 4x4, so any input >= 4x4 works.
    Width 16 with 10 classes: 5,082 parameters (either norm: both have a scale and a shift per channel).
    """

    def __init__(self, *, num_classes: int, T: int, in_channels: int, width: int,
                 activation: str, model_name: str, norm: str = "batch", groups: int = 4) -> None:
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        positive_int("in_channels", in_channels)
        positive_int("width", width)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if norm == "group" and (positive_int("groups", groups) and width % groups):
            raise ValueError(f"GroupNorm needs width ({width}) divisible by groups ({groups})")
        self.conv1 = layer.Conv2d(in_channels, width, 3, padding=1, bias=False, step_mode="m")
        self.bn1 = _norm(norm, width, groups)
        self.sn1 = make_neuron(activation)
        self.conv2 = layer.Conv2d(width, width, 3, padding=1, bias=False, step_mode="m")
        self.bn2 = _norm(norm, width, groups)
        self.sn2 = make_neuron(activation)
        self.pool = AdaptiveAvgPool2d((4, 4), step_mode="m")  # its 2x2 windows as slices (szo.models.pooling)
        self.flatten = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(width * 16, num_classes, step_mode="m")

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        x = self.sn1(self.bn1(self.conv1(x_seq)))
        x = self.sn2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))


@register_model
def spike_convnet(num_classes: int = 10, T: int = 4, activation: str = "lif",
                  in_channels: int = 1, width: int = 16, bn_time: str = "shared", norm: str = "batch",
                  groups: int = 4) -> SpikeConvNet:
    """Small spiking ConvNet for 8x8 digits (~5k params at width 16); ``bn_time``: ``SpikingModel.set_bn_time``;
    ``norm="group"``: GroupNorm with ``groups`` groups instead of BatchNorm (no running statistics)."""
    if norm == "group" and bn_time != "shared":
        raise ValueError(f"bn_time={bn_time!r} applies to BatchNorm; spike_convnet with norm='group' has none")
    model = SpikeConvNet(num_classes=num_classes, T=T, in_channels=in_channels, width=width,
                         activation=activation, model_name="spike_convnet", norm=norm, groups=groups)
    return model.set_bn_time(bn_time)
