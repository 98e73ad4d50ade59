"""``SpikingModel``: the base of every model in the zoo.

Handles input encoding (static image -> repeated over ``T``), neuron-state reset after each
forward, the time-chunked (streaming) forward (``szo.models.streaming``), and the
flat-parameter view used by the subspace optimizers (order = ``named_parameters()``, BN
running statistics excluded because they are buffers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from spikingjelly.activation_based import functional
from torch import nn

from szo.layout import layout_fingerprint, param_layout
from szo.models.compiled import check_compile, compiled_forward_seq
from szo.models.graphed import ForwardGraphs, GraphBackend
from szo.models.streaming import (
    BatchNorm2d,
    bn_time_of,
    check_bn_time,
    check_stream_bn,
    check_time_chunk,
    chunked_forward,
)
from szo.vocab import MEMORY_FORMATS
from szo.zo.path import ProbePath


def check_memory_format(fmt: object) -> str:
    """One clear ValueError for an unknown activation memory format; returns it."""
    if fmt not in MEMORY_FORMATS:
        raise ValueError(f"unknown memory_format {fmt!r}; valid: {', '.join(MEMORY_FORMATS)}")
    return fmt  # type: ignore[return-value]


def to_channels_last(x: torch.Tensor, repeat: int | None = None) -> torch.Tensor:
    """``[N, C, H, W]`` or ``[T, N, C, H, W]`` with every image channels-last (NHWC) in memory.
    ``repeat=T`` (4-D ``x``): the ``[T, N, C, H, W]`` sequence of ``x`` repeated over T, written
    channels-last in one copy (a probe's input, built once per forward)."""
    if repeat is not None:
        out = torch.empty((repeat * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device,
                          memory_format=torch.channels_last).unflatten(0, (repeat, x.shape[0]))
        return out.copy_(x.unsqueeze(0).expand(repeat, *x.shape))
    if x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, x.shape[:2])


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class SpikingModel(nn.Module):
    """Base class. Subclasses build layers in ``__init__`` and implement ``forward_seq``."""

    sample_dims: int = 3
    """Dimensions of one input frame: ``[C, H, W]`` for the zoo; an imported NIR graph has its
    Input node's (``szo.export.NIRNetwork``)."""
    cpu_channels_last: bool = False
    """Whether ``memory_format="auto"`` runs this model channels-last on the CPU: set where it was
    measured to be faster there (docs/performance.md)."""

    def __init__(self, *, num_classes: int, T: int, model_name: str) -> None:
        super().__init__()
        self.num_classes = positive_int("num_classes", num_classes)
        self.T = positive_int("T", T)
        self.model_name = model_name
        self._persist_depth = 0
        self.time_chunk: int | None = None  # chunked (streaming) forward; see set_streaming
        self.stream_bn: str = "exact"
        self.compile_opts: tuple[str, str | None] | None = None  # torch.compile; see set_compile
        self.memory_format: str = "auto"  # activations' layout; see set_memory_format
        self.cuda_graphs: ForwardGraphs | None = None  # probe forwards replayed as CUDA graphs; see set_cuda_graphs

    # ------------------------------------------------------------------ forward
    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        """Map ``[T, N, C, H, W]`` to logits ``[T, N, num_classes]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_seq")

    def forward(self, x: torch.Tensor, *, time_chunk: int | None = None,
                stream_bn: str | None = None) -> torch.Tensor:
        """``x``: ``[N, C, H, W]`` (repeated over ``self.T``) or ``[T, N, C, H, W]`` (used as is).

        Returns ``[T, N, num_classes]``. Neuron state is reset afterwards unless inside
        ``persistent_state()``.

        ``time_chunk`` (default: ``self.time_chunk``, set by ``set_streaming``): run the T
        steps in chunks of this many steps, keeping only the neuron state between chunks
        (1 = fully streaming, memory flat in T; ``None`` or >= T = all steps at once).
        ``stream_bn`` (default: ``self.stream_bn``) says what train-mode BatchNorm does in a
        chunked forward: ``"exact"``, ``"running"`` or ``"chunk"``; see
        ``szo.models.streaming`` for exactly when the result equals the multi-step forward.
        """
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (self.sample_dims + 1, self.sample_dims + 2):
            frame = "C, H, W" if self.sample_dims == 3 else f"{self.sample_dims}-D frame"
            raise ValueError(f"input must be [N, {frame}] (static image) or [T, N, {frame}] (sequence), got shape "
                             f"{tuple(x.shape)}")
        chunk = check_time_chunk(self.time_chunk if time_chunk is None else time_chunk)
        mode = check_stream_bn(self.stream_bn if stream_bn is None else stream_bn)
        static = x.dim() == self.sample_dims + 1
        T = self.T if static else x.shape[0]
        try:
            channels_last = self._channels_last(x)
            if chunk is not None and chunk < T:
                return chunked_forward(self, to_channels_last(x) if channels_last else x, static=static, T=T,
                                       chunk=chunk, stream_bn=mode, persistent=self._persist_depth > 0)
            if channels_last:
                x_seq = to_channels_last(x, repeat=self.T) if static else to_channels_last(x)
            else:
                x_seq = x.unsqueeze(0).repeat(self.T, *(1,) * x.dim()) if static else x
            if self.compile_opts is not None:
                return compiled_forward_seq(type(self), *self.compile_opts)(self, x_seq)
            if self.cuda_graphs is not None:
                return self.cuda_graphs(self, x_seq, persistent=self._persist_depth > 0)
            return self.forward_seq(x_seq)
        finally:
            if self._persist_depth == 0:
                functional.reset_net(self)

    # ------------------------------------------------------------ memory format
    def set_memory_format(self, memory_format: str = "auto") -> SpikingModel:
        """Memory layout of the activations of later forwards.

        ``"channels_last"``: every image of the input (and so every convolution's output) NHWC
        in memory; ``"contiguous"``: as given (NCHW); ``"auto"`` (default): channels-last for
        CPU inputs of the models measured faster so (``cpu_channels_last``: the BasicBlock
        Spike-ResNets and Spike-VGG11; not Spike-ResNet50, where it was not faster, nor the
        digits ConvNet), as given otherwise. On the CPU oneDNN runs
        the zoo's 16-channel 3x3 convolutions faster on NHWC (brgemm kernels) than on NCHW
        (direct kernel plus two reorders; docs/performance.md has the measurements), which is also the layout ``torch.compile``
        picks on CPU; on CUDA it is unmeasured here, so ``"auto"`` leaves CUDA inputs alone.
        The layout changes the convolution kernels, so results agree with ``"contiguous"``
        to float rounding, not bitwise. Only the input is converted (the weights keep their
        layout, so checkpoints and flat-parameter views are unchanged) and the layers follow it;
        a 1-channel input (MNIST, digits) is the same in both layouts and the network stays
        NCHW. docs/performance.md has the measurements.
        """
        self.memory_format = check_memory_format(memory_format)
        return self

    def _channels_last(self, x: torch.Tensor) -> bool:
        fmt = getattr(self, "memory_format", "auto")
        if fmt == "auto":
            return self.cpu_channels_last and x.device.type == "cpu"
        return fmt == "channels_last"

    # ------------------------------------------------------------- BN over time
    @property
    def bn_time(self) -> str:
        """``"shared"`` or ``"per-step"``: how every BN layer treats time (``set_bn_time``)."""
        modes = {m.bn_time for m in self.modules() if isinstance(m, BatchNorm2d)}
        return modes.pop() if len(modes) == 1 else ("shared" if not modes else "mixed")

    def set_bn_time(self, bn_time: str) -> SpikingModel:
        """BN over time for every BN layer: ``"shared"`` (statistics over all T*N samples of a
        forward, one running-statistics update) or ``"per-step"`` (each time step with its own
        statistics, T updates per forward: the single-step convention); docs/bn.md."""
        check_bn_time(bn_time)
        for m in self.modules():
            if isinstance(m, BatchNorm2d):
                m.bn_time = bn_time
        return self

    def forward_settings(self) -> dict[str, Any]:
        """How this model's forward runs, as the probe path's fields (``szo.zo.ProbePath.on``): compiled
        (the backend) or not, replayed as CUDA graphs, streamed (``time_chunk``), BN per time step in any
        layer, and the backend (``float``; the fixed-point network says ``fixed``)."""
        return {"compile": self.compile_opts[0] if self.compile_opts is not None else False,
                "cuda_graphs": self.cuda_graphs is not None, "time_chunk": self.time_chunk,
                "bn_time": bn_time_of(self), "backend": "float"}

    # ---------------------------------------------------------------- streaming
    def set_streaming(self, time_chunk: int | None = None, stream_bn: str = "exact") -> SpikingModel:
        """Default ``time_chunk`` / ``stream_bn`` of every later ``forward`` (``None``: all T at once)."""
        self.time_chunk = check_time_chunk(time_chunk)
        self.stream_bn = check_stream_bn(stream_bn)
        return self

    @contextlib.contextmanager
    def streaming(self, time_chunk: int | None = 1, stream_bn: str = "exact") -> Iterator[SpikingModel]:
        """``set_streaming`` for the duration of a ``with`` block; the previous setting is restored."""
        old = (self.time_chunk, self.stream_bn)
        self.set_streaming(time_chunk, stream_bn)
        try:
            yield self
        finally:
            self.time_chunk, self.stream_bn = old

    # ------------------------------------------------------------------ compile
    def set_compile(self, enabled: bool = True, *, backend: str = "inductor",
                    mode: str | None = None) -> SpikingModel:
        """Run later multi-step forwards through ``torch.compile`` (``False``: eager again).

        Compiled: ``forward_seq``, once per input shape / grad mode / train-eval mode, shared by
        all instances of the class; parameters and BN buffers changed in place between calls
        are read by the graph without recompiling. The chunked (streaming) forward stays
        eager. See ``szo.models.compiled``.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"set_compile(enabled) must be True or False, got {enabled!r}")
        ProbePath(compile=enabled, cuda_graphs=self.cuda_graphs is not None).check()  # one of them
        self.compile_opts = check_compile(backend, mode) if enabled else None
        return self

    # ------------------------------------------------------------- CUDA graphs
    def set_cuda_graphs(self, enabled: bool = True, *, warmup: int = 2, max_graphs: int = 8,
                        backend: GraphBackend | None = None) -> SpikingModel:
        """Replay later no-grad multi-step forwards on CUDA as captured CUDA graphs (``False``: eager
        again, the graphs freed). One graph per input signature, at most ``max_graphs``; grad-mode,
        CPU and streaming forwards stay eager. Same result as eager (the same kernels), fewer launches:
        see ``szo.models.graphed`` and docs/performance.md. ``self.cuda_graphs.stats`` counts captures,
        replays and eager forwards by reason."""
        if not isinstance(enabled, bool):
            raise ValueError(f"set_cuda_graphs(enabled) must be True or False, got {enabled!r}")
        ProbePath(compile=self.compile_opts is not None, cuda_graphs=enabled).check()  # one of them
        self.cuda_graphs = ForwardGraphs(warmup=warmup, max_graphs=max_graphs, backend=backend) if enabled else None
        return self

    # -------------------------------------------------------------------- state
    def reset_state(self) -> None:
        """Reset all neuron membrane potentials."""
        functional.reset_net(self)

    @contextlib.contextmanager
    def persistent_state(self) -> Iterator[SpikingModel]:
        """Keep neuron state across ``forward`` calls (streaming); reset on exit."""
        self._persist_depth += 1
        try:
            yield self
        finally:
            self._persist_depth -= 1
            if self._persist_depth == 0:
                functional.reset_net(self)

    # ------------------------------------------------------------ flat params
    def param_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter in ``named_parameters()`` order."""
        return param_layout(self)

    def num_params(self) -> int:
        """Total parameter count ``d`` (trainable or not)."""
        return sum(p.numel() for p in self.parameters())

    def flat_params(self) -> torch.Tensor:
        """A new detached float32 1-D tensor ``[d]`` of all parameters (layout order)."""
        params = [p.detach().reshape(-1) for p in self.parameters()]
        if not params:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat(params).to(torch.float32)

    @torch.no_grad()
    def load_flat_params(self, vec: torch.Tensor) -> None:
        """Copy a flat vector ``[d]`` (layout order) into the parameters in place."""
        params = list(self.parameters())
        d = sum(p.numel() for p in params)
        if not isinstance(vec, torch.Tensor):
            raise ValueError(f"vec must be a 1-D torch.Tensor of length {d}, got {type(vec).__name__}")
        if vec.dim() != 1 or vec.numel() != d:
            raise ValueError(f"vec must be 1-D of length d={d}, got shape {tuple(vec.shape)}")
        if not (vec.is_floating_point()):
            raise ValueError(f"vec must be floating point, got dtype {vec.dtype}")
        if not params:
            return
        ref = params[0]
        if vec.device != ref.device or vec.dtype != ref.dtype:
            vec = vec.to(device=ref.device, dtype=ref.dtype)
        chunks = vec.split([p.numel() for p in params])
        torch._foreach_copy_(params, [c.view_as(p) for c, p in zip(chunks, params)])

    def fingerprint(self) -> str:
        """sha256 hex of ``json.dumps([model_name, [[name, shape], ...]])`` (``szo.layout.layout_fingerprint``)."""
        return layout_fingerprint(self.model_name, self.param_layout())
