"""Spiking VGG11 for DVS frames (2 polarity channels)."""

from __future__ import annotations

import torch
from spikingjelly.activation_based import layer
from torch import nn

from szo.models.base import SpikingModel, positive_int
from szo.models.neurons import make_neuron
from szo.models.registry import register_model
from szo.models.spike_resnet import kaiming_init_convs
from szo.models.streaming import BatchNorm2d

VGG11_CFG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class SpikeVGG(SpikingModel):
    """VGG features (conv3x3-BN-neuron, 'M' = 2x2 maxpool) -> adaptive avgpool 7x7 -> Linear.

    The 7x7 adaptive pool (torchvision VGG style) fixes the classifier size for any input,
    so 32x32 / 64x64 demos and 128x128 DVS frames share one parameter layout; with 11
    classes VGG11 has 9.499M parameters (paper Table 1: 9.50M).
    """

    cpu_channels_last = True  # measured faster on the CPU (SpikingModel.set_memory_format)

    def __init__(self, cfg: tuple[int | str, ...], *, num_classes: int, T: int,
                 in_channels: int, activation: str, model_name: str) -> None:
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        in_ch = positive_int("in_channels", in_channels)
        feats: list[nn.Module] = []
        for v in cfg:
            if v == "M":
                feats.append(layer.MaxPool2d(2, 2, step_mode="m"))
            elif isinstance(v, int) and v > 0:
                feats += [
                    layer.Conv2d(in_ch, v, 3, padding=1, bias=False, step_mode="m"),
                    BatchNorm2d(v, step_mode="m"),
                    make_neuron(activation),
                ]
                in_ch = v
            else:
                raise ValueError(f"bad VGG cfg entry {v!r}; valid: positive int or 'M'")
        self.features = nn.Sequential(*feats)
        self.pool = layer.AdaptiveAvgPool2d((7, 7), step_mode="m")
        self.flatten = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(in_ch * 7 * 7, num_classes, step_mode="m")
        kaiming_init_convs(self)

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.features(x_seq))))


@register_model
def spike_vgg11(num_classes: int = 11, T: int = 20, activation: str = "lif",
                in_channels: int = 2, bn_time: str = "shared") -> SpikeVGG:
    """VGG11 (BN) for 2-channel 128x128 DVS-Gesture frames, ~9.50M params."""
    model = SpikeVGG(VGG11_CFG, num_classes=num_classes, T=T, in_channels=in_channels,
                     activation=activation, model_name="spike_vgg11")
    return model.set_bn_time(bn_time)
