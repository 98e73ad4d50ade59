"""Networks szo did not write: any SpikingJelly ``nn.Module`` as a :class:`SpikingModel`, unchanged.

``ForeignModel(net, num_classes=..., T=..., output="rate")`` holds ``net`` as its only child and
gives it what szo's recorder, subspace store, optimizers and trainer need: the flat parameter
vector and layout (``net.``-prefixed names), a fingerprint, ``[T, N, C]`` outputs and a neuron
reset after every forward (``functional.reset_net``, what SpikingJelly's tutorials call after
each batch). ``net.forward`` itself runs as written, with its own encoding of the input over
time: ``output="rate"`` for a network that returns ``[N, C]`` (e.g. a firing rate averaged over
T inside ``forward``; szo sees it as ``[1, N, C]``, so the time mean is the rate itself),
``"sequence"`` for one that returns ``[T, N, C]``.

Recipes name one with ``model.name: spikingjelly:<module>.<Class>``, a class of
``spikingjelly.activation_based.examples.<module>``, e.g. ``spikingjelly:conv_fashion_mnist.CSNN``
(SpikingJelly's Fashion-MNIST tutorial network); ``model.T`` and ``model.kwargs`` (``channels``)
go to its constructor. What a szo model has and a foreign one has not -- the time-chunked
(streaming) forward, ``torch.compile`` of the multi-step core, per-step BN, the channels-last
layout -- is refused in one line.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from spikingjelly.activation_based import functional
from torch import nn

from szo.models.base import SpikingModel

__all__ = ["FOREIGN_PREFIX", "ForeignModel", "OUTPUTS", "resolve", "create_foreign"]

FOREIGN_PREFIX = "spikingjelly:"
"""Model names of this form are SpikingJelly example classes: ``spikingjelly:<module>.<Class>``."""
EXAMPLES = "spikingjelly.activation_based.examples"
OUTPUTS = ("rate", "sequence")


class ForeignModel(SpikingModel):
    """A SpikingJelly network ``net`` behind szo's model interface (module docstring)."""

    def __init__(self, net: nn.Module, *, num_classes: int, T: int, model_name: str, output: str = "rate") -> None:
        if not isinstance(net, nn.Module):
            raise ValueError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {list(OUTPUTS)}, got {output!r}")
        super().__init__(num_classes=num_classes, T=T, model_name=model_name)
        self.net = net
        self.output = output

    def forward(self, x: torch.Tensor, *, time_chunk: int | None = None,
                stream_bn: str | None = None) -> torch.Tensor:
        """``net(x)`` as ``[T, N, num_classes]`` (``[1, N, C]`` for a rate output); neurons reset
        afterwards unless inside ``persistent_state()``."""
        if time_chunk is not None or self.time_chunk is not None:
            raise ValueError(f"{self.model_name} is a foreign network: it has no time-chunked (streaming) forward; "
                             "leave time_chunk unset (szo.time_chunk: null)")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"input must be a torch.Tensor, got {type(x).__name__}")
        try:
            out = self.net(x)
        finally:
            if self._persist_depth == 0:
                functional.reset_net(self.net)
        want = 2 if self.output == "rate" else 3
        if not isinstance(out, torch.Tensor) or out.dim() != want or out.shape[-1] != self.num_classes:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            form = "[N, num_classes]" if self.output == "rate" else "[T, N, num_classes]"
            raise ValueError(f"{self.model_name} returned {shape}; output={self.output!r} expects {form} with "
                             f"num_classes = {self.num_classes}")
        return out.unsqueeze(0) if self.output == "rate" else out

    def set_memory_format(self, memory_format: str = "auto") -> SpikingModel:
        if memory_format == "channels_last":
            raise ValueError(f"{self.model_name} is a foreign network: szo does not change its memory layout; "
                             "use model.memory_format auto or contiguous")
        self.memory_format = memory_format
        return self

    def set_bn_time(self, bn_time: str) -> SpikingModel:
        if bn_time != "shared":
            raise ValueError(f"{self.model_name} is a foreign network: its BN layers are its own (SpikingJelly's "
                             "multi-step BN normalises over T*N, i.e. 'shared'); use model.bn_time shared")
        return self

    @property
    def bn_time(self) -> str:
        return "shared"

    def set_compile(self, enabled: bool = True, *, backend: str = "inductor", mode: str | None = None) -> SpikingModel:
        if enabled:
            raise ValueError(f"{self.model_name} is a foreign network: szo compiles only its own models' multi-step "
                             "core; use compile: false")
        self.compile_opts = None
        return self


def resolve(name: str) -> type[nn.Module]:
    """The class a ``spikingjelly:<module>.<Class>`` name stands for; one ValueError otherwise."""
    if not isinstance(name, str) or not name.startswith(FOREIGN_PREFIX):
        raise ValueError(f"a foreign model name has the form {FOREIGN_PREFIX}<module>.<Class>, got {name!r}")
    module, _, cls_name = name[len(FOREIGN_PREFIX):].rpartition(".")
    if not module or not cls_name:
        raise ValueError(f"{name!r}: expected {FOREIGN_PREFIX}<module>.<Class>, a class of {EXAMPLES}.<module> "
                         f"(e.g. {FOREIGN_PREFIX}conv_fashion_mnist.CSNN)")
    try:
        mod = importlib.import_module(f"{EXAMPLES}.{module}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith(f"{EXAMPLES}.{module}"):
            raise ValueError(f"{name!r}: SpikingJelly has no example module {EXAMPLES}.{module}") from None
        raise ValueError(f"{name!r}: its module {EXAMPLES}.{module} needs {e.name!r}, which is not installed"
                         + (" (pip install 'szo[log]')" if (e.name or "").startswith("tensorboard") else "")) from None
    cls = getattr(mod, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{name!r}: {EXAMPLES}.{module} has no nn.Module class {cls_name!r}")
    return cls


def create_foreign(name: str, *, num_classes: int, T: int, activation: str = "lif", bn_time: str = "shared",
                   in_channels: int | None = None, output: str = "rate", **kw: Any) -> ForeignModel:
    """``ForeignModel`` around ``resolve(name)(T=T, **kw)`` (``T`` passed only if the constructor takes
    it). ``activation`` / ``bn_time`` / ``in_channels``: szo's model options, which a foreign
    network fixes itself: accepted at their defaults (any ``in_channels``: the data decide, and a
    mismatch is the network's own error), refused otherwise."""
    cls = resolve(name)
    if activation != "lif":
        raise ValueError(f"{name} brings its own neurons: model.activation cannot be {activation!r} (leave it at lif)")
    params = inspect.signature(cls).parameters
    args = dict(kw)
    if "T" in params:
        args["T"] = T
    unknown = sorted(k for k in args if k not in params)
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"model {name!r} has no argument(s) {', '.join(map(repr, unknown))}; its constructor takes: "
                         f"{', '.join(p for p in params if p != 'self')}")
    model = ForeignModel(cls(**args), num_classes=num_classes, T=T, model_name=name, output=output)
    return model.set_bn_time(bn_time)
