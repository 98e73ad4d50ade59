"""Probe forwards as CUDA graphs: ``model.set_cuda_graphs(True)`` (recipe key ``cuda_graphs``).

A small spiking network at a small batch is launch-bound on a GPU: its forward takes about the same
time in fp32 and TF32 (measured: docs/performance.md; its bf16 times predate issue 40's weight-cache
fix), because the LIF's per-time-step elementwise kernels and the convolutions are each too small to
fill the card, and the CPU launches them one by one. A zeroth-order step is 2k such forwards of
the *same* shapes with the parameters changed *in place* (the probe moves them, the restore moves
them back): exactly what a CUDA graph replays. :class:`ForwardGraphs` captures the no-grad
multi-step forward (``model.forward_seq``) once per input signature and replays it:

* **What a graph reads**: the input, copied into the graph's static input buffer, and the
  parameters and buffers at their addresses (in-place changes are seen; a tensor *replaced*, e.g.
  by ``model.to(...)``, changes the signature and gets a new graph). Train-mode BN updates its
  running statistics inside the graph, as eagerly; ``szo.zo.bn``'s snapshot / restore copy in place.
* **Signature** (one graph each, at most ``max_graphs``; beyond that, eager): input shape /
  dtype / device / layout, every module's train flag, autocast state and dtype, the TF32
  switches (``szo.precision``: the captured kernels were chosen under them), and the addresses
  of the parameters and buffers.
* **Capture**: ``warmup`` eager forwards on a side stream (cuDNN / cuBLAS initialise their
  workspaces), then the capture, both with autocast's weight cache off (``szo.precision.fresh_casts``:
  under bf16 the graph holds the casts of the parameters, so every replay casts them where they
  are; a cached cast would be a tensor the graph reads at the weights of the capture); the warm-up's side effects on the buffers (BN running
  statistics) are undone, then the graph is replayed once for the call itself, so a captured call
  and an eager one change the model's state alike. The neuron state starts from its reset value
  in every forward (``SpikingModel.forward`` resets after each call), which is what was captured.
* **Eager instead** (the result is the same, only slower), counted in :attr:`GraphStats.eager`
  by reason: grad enabled (BPTT, forward gradients), not a CUDA tensor, inside
  ``persistent_state()`` (streaming: the state carries over), a neuron that stores its voltage
  sequence (``store_v_seq``), a full graph table, or a capture that failed (e.g. an operation that
  synchronises with the host: that signature stays eager, one warning).
* Forward hooks run in the warm-up forwards only, never in a replay (as with ``torch.compile``):
  code that drives layers through hooks at every call (``szo.distributed.SyncBatchNorm``, the
  layer-wise methods' node perturbation and clean-forward records: ``MethodSpec.hooks``) must not
  use graphs; the probe path (``szo.zo.ProbePath``) refuses those combinations at every door.

The capture mechanism is a :class:`GraphBackend`: :class:`CudaGraphBackend` (``torch.cuda.CUDAGraph``)
on a GPU; the tests drive the same bookkeeping on the CPU with a backend that replays by calling
the function again, and with one that replays the recorded ATen operations without running any
Python, as a CUDA graph does (``tests/models/graph_replay.py``: a hook added after the capture does
not run in its replays).
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from spikingjelly.activation_based import functional
from spikingjelly.activation_based.neuron import BaseNode
from torch import nn

from szo.precision import fresh_casts, tf32_flags

__all__ = ["ForwardGraphs", "GraphStats", "GraphBackend", "CudaGraphBackend", "eager_reason"]

Replay = Callable[[], None]


class GraphBackend(Protocol):
    """Captures ``fn()`` (reading static inputs) into something that replays it: ``capture(fn)``
    returns ``(replay, outputs)``; ``replay()`` recomputes ``outputs`` in place."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def capture(self, fn: Callable[[], torch.Tensor], warmup: int,
                between: Callable[[], None]) -> tuple[Replay, torch.Tensor]: ...


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` with the side-stream warm-up PyTorch's CUDA-graph notes prescribe."""

    def supports(self, x: torch.Tensor) -> bool:
        return x.is_cuda

    def capture(self, fn: Callable[[], torch.Tensor], warmup: int,
                between: Callable[[], None]) -> tuple[Replay, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
                between()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
        between()
        return graph.replay, out


@dataclass
class GraphStats:
    """What the graphs did: captures, replays, eager forwards by reason, failed signatures."""

    captures: int = 0
    replays: int = 0
    eager: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"captures": self.captures, "replays": self.replays, "eager": dict(self.eager),
                "failures": list(self.failures)}


@dataclass
class _Graph:
    static_x: torch.Tensor
    out: torch.Tensor
    replay: Replay


def eager_reason(model: nn.Module, x_seq: torch.Tensor, backend: GraphBackend, persistent: bool = False) -> str | None:
    """Why this forward cannot be a replay (None: it can); ``persistent``: the neuron state carries
    over from the previous forward (``SpikingModel.persistent_state``)."""
    if torch.is_grad_enabled():
        return "grad enabled"
    if not backend.supports(x_seq):
        return f"{x_seq.device.type} tensor"
    if persistent:
        return "persistent state"
    if any(isinstance(m, BaseNode) and getattr(m, "store_v_seq", False) for m in model.modules()):
        return "store_v_seq"
    return None


def _autocast_key(device_type: str) -> tuple[bool, Any]:
    if not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


class ForwardGraphs:
    """One model's captured forwards (see the module doc). ``graphs(model, x_seq)`` returns the
    logits of ``model.forward_seq(x_seq)``, replayed when it can, eagerly otherwise."""

    def __init__(self, *, warmup: int = 2, max_graphs: int = 8, backend: GraphBackend | None = None):
        for name, v, lo in (("warmup", warmup, 1), ("max_graphs", max_graphs, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.warmup, self.max_graphs = warmup, max_graphs
        self.backend: GraphBackend = backend if backend is not None else CudaGraphBackend()
        self.stats = GraphStats()
        self._graphs: dict[tuple, _Graph] = {}
        self._failed: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._graphs)

    def __deepcopy__(self, memo: dict) -> "ForwardGraphs":
        """A copy of the model gets its own, empty graph table (graphs are bound to the tensors'
        addresses; a copied model has new ones)."""
        return ForwardGraphs(warmup=self.warmup, max_graphs=self.max_graphs, backend=self.backend)

    def clear(self) -> None:
        """Drop every captured graph (and its memory)."""
        self._graphs.clear()
        self._failed.clear()

    def signature(self, model: nn.Module, x: torch.Tensor) -> tuple:
        tensors = [*model.parameters(), *model.buffers()]
        modes = tuple((m.training, getattr(m, "bn_time", None)) for m in model.modules())  # what steers the layers
        return (tuple(x.shape), x.dtype, x.device, tuple(x.stride()), modes,
                _autocast_key(x.device.type), tf32_flags(), tuple(t.data_ptr() for t in tensors))

    def __call__(self, model: nn.Module, x_seq: torch.Tensor, *, persistent: bool = False) -> torch.Tensor:
        why = eager_reason(model, x_seq, self.backend, persistent)
        if why is not None:
            self.stats.eager[why] += 1
            return model.forward_seq(x_seq)
        key = self.signature(model, x_seq)
        g = self._graphs.get(key)
        if g is None:
            if key in self._failed:
                self.stats.eager["capture failed"] += 1
                return model.forward_seq(x_seq)
            if len(self._graphs) >= self.max_graphs:
                self.stats.eager["graph table full"] += 1
                return model.forward_seq(x_seq)
            g = self._capture(model, x_seq, key)
            if g is None:
                return model.forward_seq(x_seq)
        else:
            g.static_x.copy_(x_seq)
        g.replay()
        self.stats.replays += 1
        return g.out.clone()  # the next replay overwrites g.out

    def _capture(self, model: nn.Module, x_seq: torch.Tensor, key: tuple) -> _Graph | None:
        static_x = x_seq.clone()
        buffers = [(b, b.clone()) for b in model.buffers()]

        def restore() -> None:  # undo what the warm-up / capture forwards did to the model's state
            functional.reset_net(model)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

        try:
            with fresh_casts():
                replay, out = self.backend.capture(lambda: model.forward_seq(static_x), self.warmup, restore)
        except Exception as e:  # an operation a graph cannot hold (a host sync): this signature stays eager
            restore()
            self._failed.add(key)
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.stats.failures.append(msg)
            self.stats.eager["capture failed"] += 1
            warnings.warn(f"CUDA graph capture of {type(model).__name__}'s forward failed ({msg}); this input "
                          "signature runs eagerly", RuntimeWarning, stacklevel=3)
            return None
        restore()
        self.stats.captures += 1
        g = _Graph(static_x=static_x, out=out, replay=replay)
        self._graphs[key] = g
        return g
