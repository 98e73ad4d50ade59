"""Spiking ResNets (tdBN style, SpikingJelly multi-step layers).

BasicBlock: ``out = sn2(bn2(conv2(sn1(bn1(conv1(x))))) + shortcut(x))``; Bottleneck is the
1x1-3x3-1x1 analogue. The residual add is explicit in ``forward`` so a fixed-point
converter can map it to an integer current sum. Head: global average pool -> flatten ->
Linear, giving ``[T, N, num_classes]``.
"""

from __future__ import annotations

import torch
from spikingjelly.activation_based import layer
from torch import nn

from szo.models.base import SpikingModel, positive_int
from szo.models.neurons import make_neuron
from szo.models.registry import register_model
from szo.models.streaming import BatchNorm2d


def conv_bn(in_ch: int, out_ch: int, kernel_size: int, stride: int = 1) -> nn.Sequential:
    """Multi-step ``Conv2d(bias=False) -> BatchNorm2d`` with 'same' padding."""
    return nn.Sequential(
        layer.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2,
                     bias=False, step_mode="m"),
        BatchNorm2d(out_ch, step_mode="m"),
    )


def kaiming_init_convs(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU gain) weights for every Conv2d of ``model`` (torchvision's ResNet / VGG init)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual current added before the second neuron."""

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int, activation: str) -> None:
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = conv_bn(in_ch, planes, 3, stride)
        self.sn1 = make_neuron(activation)
        self.conv2 = conv_bn(planes, out_ch, 3)
        self.shortcut: nn.Module = (
            conv_bn(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else nn.Identity()
        )
        self.sn2 = make_neuron(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.sn1(self.conv1(x)))
        out = out + self.shortcut(x)  # residual: integer current sum in fixed point
        return self.sn2(out)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride) -> 1x1 expand, residual added before the last neuron."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int, activation: str) -> None:
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = conv_bn(in_ch, planes, 1)
        self.sn1 = make_neuron(activation)
        self.conv2 = conv_bn(planes, planes, 3, stride)
        self.sn2 = make_neuron(activation)
        self.conv3 = conv_bn(planes, out_ch, 1)
        self.shortcut: nn.Module = (
            conv_bn(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else nn.Identity()
        )
        self.sn3 = make_neuron(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv3(self.sn2(self.conv2(self.sn1(self.conv1(x)))))
        out = out + self.shortcut(x)  # residual: integer current sum in fixed point
        return self.sn3(out)


class SpikeResNet(SpikingModel):
    """Spiking ResNet; ``stem="cifar"`` (3x3 s1, no pool), ``"mnist"`` (3x3 s2, no pool: 28x28 -> 14x14)
    or ``"imagenet"`` (7x7 s2 + maxpool)."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, ...],
        widths: tuple[int, ...],
        *,
        stem: str,
        num_classes: int,
        T: int,
        in_channels: int = 3,
        activation: str = "lif",
        model_name: str = "spike_resnet",
    ) -> None:
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        self.cpu_channels_last = block is BasicBlock  # Bottleneck (ResNet50): channels-last not faster on CPU
        if len(layers) != len(widths) or not layers:
            raise ValueError(f"layers {layers} and widths {widths} must be non-empty and equal length")
        in_channels = positive_int("in_channels", in_channels)
        if stem in ("cifar", "mnist"):
            self.stem = nn.Sequential(conv_bn(in_channels, widths[0], 3, 1 if stem == "cifar" else 2),
                                      make_neuron(activation))
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                conv_bn(in_channels, widths[0], 7, 2),
                make_neuron(activation),
                layer.MaxPool2d(3, stride=2, padding=1, step_mode="m"),
            )
        else:
            raise ValueError(f"unknown stem {stem!r}; valid: ['cifar', 'mnist', 'imagenet']")
        stages: list[nn.Module] = []
        in_ch = widths[0]
        for i, (n, w) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_ch, w, stride, activation))
                in_ch = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = layer.AdaptiveAvgPool2d((1, 1), step_mode="m")
        self.flatten = layer.Flatten(step_mode="m")
        self.fc = layer.Linear(in_ch, num_classes, step_mode="m")
        kaiming_init_convs(self)

    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x_seq))
        return self.fc(self.flatten(self.pool(x)))


@register_model
def spike_resnet20(num_classes: int = 10, T: int = 4, activation: str = "lif",
                   in_channels: int = 3, bn_time: str = "shared") -> SpikeResNet:
    """CIFAR ResNet20 (3x3 BasicBlocks, 16-32-64), ~0.27M params."""
    model = SpikeResNet(BasicBlock, (3, 3, 3), (16, 32, 64), stem="cifar", num_classes=num_classes,
                        T=T, in_channels=in_channels, activation=activation, model_name="spike_resnet20")
    return model.set_bn_time(bn_time)


@register_model
def spike_resnet8(num_classes: int = 10, T: int = 4, activation: str = "lif",
                  in_channels: int = 1, bn_time: str = "shared") -> SpikeResNet:
    """ResNet8 for 28x28 MNIST (mnist5k): 3x3 s2 stem, one BasicBlock per stage (16-32-64,
    14 -> 7 -> 4 pixels), 77,754 params; small enough for SZO runs on 2 CPU cores."""
    model = SpikeResNet(BasicBlock, (1, 1, 1), (16, 32, 64), stem="mnist", num_classes=num_classes,
                        T=T, in_channels=in_channels, activation=activation, model_name="spike_resnet8")
    return model.set_bn_time(bn_time)


@register_model
def spike_resnet18(num_classes: int = 100, T: int = 4, activation: str = "lif",
                   in_channels: int = 3, bn_time: str = "shared") -> SpikeResNet:
    """CIFAR-style ResNet18 (3x3 stem, no maxpool, 64-128-256-512), ~11.22M params."""
    model = SpikeResNet(BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512), stem="cifar",
                        num_classes=num_classes, T=T, in_channels=in_channels,
                        activation=activation, model_name="spike_resnet18")
    return model.set_bn_time(bn_time)


@register_model
def spike_resnet50(num_classes: int = 1000, T: int = 4, activation: str = "lif",
                   in_channels: int = 3, bn_time: str = "shared") -> SpikeResNet:
    """ImageNet ResNet50 (7x7 s2 stem + maxpool, Bottleneck 3-4-6-3), ~25.56M params."""
    model = SpikeResNet(Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512), stem="imagenet",
                        num_classes=num_classes, T=T, in_channels=in_channels,
                        activation=activation, model_name="spike_resnet50")
    return model.set_bn_time(bn_time)
