"""Time-chunked ("streaming") forward: T time steps in chunks of ``c`` steps.

``model(x, time_chunk=c)`` (or ``model.set_streaming(c)`` / ``with model.streaming(c):``)
runs the network's multi-step layers on ``[c, N, ...]`` slices of the sequence one after
another, carrying only the neuron state (membrane potentials) from one chunk to the next,
and concatenates the per-step logits into the usual ``[T, N, num_classes]``. ``c = T``
(or ``None``) is the ordinary multi-step forward; ``c = 1`` is fully streaming: at any
moment only one time step's activations (plus every layer's neuron state) are alive, so
the memory of a no-grad forward no longer grows with T (paper Fig. 5). A SpikingJelly
multi-step layer on a ``[1, N, ...]`` slice runs the same kernels as its single-step form
(``lif_step`` is ``lif_multi_step`` with T = 1), so no ``step_mode`` switch is needed and
every model in the zoo streams as is.

What is exact
-------------
Convolutions, linear layers, pooling, flatten, residual adds and LIF / ReLU neurons act on
each time step separately (the LIF through its state), so the chunked forward computes the
same function as the multi-step forward. On CPU the logits are bitwise equal in our tests.

BatchNorm is the exception. Multi-step ``BatchNorm2d`` in train mode normalises with batch
statistics over all ``T*N`` samples (and all pixels) of its input, which a chunk of ``c < T``
steps cannot see. The policy ``stream_bn`` decides what a train-mode BN layer (or any BN
without running statistics) does in a chunked forward:

* ``"exact"`` (default): **the same function as the multi-step train-mode forward** --
  logits and the running-statistics update. A BN layer's batch statistics depend on every
  time step of every earlier layer, so they are found in extra streaming passes: pass p
  runs the network only up to the p-th batch-statistics BN layer (in execution order),
  accumulating that layer's per-channel statistics over all T steps (float64, Chan's
  pairwise combination of per-chunk ``var_mean``), while the p-1 earlier layers normalise
  with the exact statistics found in earlier passes. After L such passes (L = number of
  train-mode BN layers) a last pass produces the logits. Memory stays that of one chunk;
  compute is ``L + 1`` truncated forwards -- for a chain of equal-cost layers about
  ``L/2 + 1`` full forwards (ConvNet: L = 2; Spike-ResNet20: L = 21, about 11.5x).
  Not for autograd: statistics from earlier passes enter later passes as constants, so a
  gradient through them would be wrong; ``"exact"`` therefore needs ``torch.no_grad()``.
* ``"running"``: one pass. Every step is normalised with the layer's **running**
  statistics (as in eval mode; they stay frozen during the forward), while the batch
  statistics of the layer input over all ``T*N`` samples are accumulated and applied as
  the usual momentum update of the running statistics at the end of the forward. This is a
  *different function* from train-mode BN: it equals a multi-step forward in which BN
  normalises with the running statistics and updates them with its ``T*N`` batch
  statistics -- which is also what this mode computes with ``c = T``, for every ``c``
  (tested). The update therefore differs from the train-mode one whenever an earlier BN
  layer's running and batch statistics differ.
* ``"chunk"``: one pass. Every chunk is normalised with the batch statistics of its own
  ``c*N`` samples (``c = 1``: per-time-step statistics, BNTT/tdBN-like without per-step
  parameters); the running statistics get one update with the statistics pooled over all
  chunks. A *different function* for ``c < T`` (the same as train mode for ``c = T``).
  For a static image repeated over T the first BN layer sees the same input at every step,
  so only deeper layers differ.

BN layers in eval mode (running statistics) need no policy: with them, and in models
without BN, every chunk size gives the multi-step result. Whatever the policy, the running
statistics are updated (and ``num_batches_tracked`` incremented) once per forward, after
the last chunk, so ``szo.optim.BNStatsFreezer`` (snapshot / restore / accumulate / commit
per SZO step) works unchanged.

Per-time-step BN (``bn_time="per-step"``, see ``BatchNorm2d``) normalises every time step
with that step's own statistics, so a chunk sees everything it needs: such layers take no
policy, and every chunk size gives the multi-step result (T running-statistics updates per
forward, as without chunks).

Only the zoo's ``szo.models.streaming.BatchNorm2d`` (a drop-in subclass of SpikingJelly's
``layer.BatchNorm2d``, same parameters and buffers) can be driven by a policy; a chunked
forward with any other BatchNorm that would use batch statistics raises ``ValueError``.
Each BN layer must run once per time step (no module reuse within a step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as Fn
from spikingjelly.activation_based import functional, layer
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.vocab import BN_TIMES, STREAM_BN_MODES

__all__ = ["STREAM_BN_MODES", "BN_TIMES", "bn_time_of", "check_bn_time", "BatchNorm2d", "BNStream", "check_time_chunk", "check_stream_bn",
           "chunked_forward", "batch_stat_bn_layers", "bn_momentum"]





def bn_time_of(model: nn.Module) -> str:
    """``"per-step"`` when any BN layer of ``model`` normalises each time step apart, else ``"shared"``."""
    return "per-step" if any(isinstance(m, BatchNorm2d) and m.bn_time == "per-step" for m in model.modules()) \
        else "shared"


def check_bn_time(value: object) -> str:
    if value not in BN_TIMES:
        raise ValueError(f"unknown bn_time {value!r}; valid: {', '.join(BN_TIMES)} (shared: BN statistics over "
                         "all T*N samples of a forward; per-step: each time step normalised with its own)")
    return value  # type: ignore[return-value]


def check_time_chunk(value: object) -> int | None:
    """``None`` (all T steps at once) or a positive int; anything else raises ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"time_chunk must be a positive int (time steps per chunk) or None (all T at once), "
                         f"got {value!r}")
    return value


def check_stream_bn(value: object) -> str:
    if value not in STREAM_BN_MODES:
        raise ValueError(f"unknown stream_bn {value!r}; valid: {', '.join(STREAM_BN_MODES)}")
    return value  # type: ignore[return-value]


def bn_momentum(mod: _BatchNorm) -> float:
    """Factor of ``mod``'s next running-statistics update: ``momentum``, or with ``momentum=None``
    (cumulative average) ``1 / (num_batches_tracked + 1)``. The buffer is read only in that
    case, as torch's ``_BatchNorm.forward`` does: reading it on CUDA synchronises the device."""
    if mod.momentum is not None:
        return mod.momentum
    return 1.0 / (float(mod.num_batches_tracked) + 1.0)


class _StopPass(Exception):
    """Raised by the BN layer whose statistics an ``"exact"`` pass is collecting."""


class BNStream:
    """Per-BN-layer state of one chunked forward (all passes of it).

    ``apply(mod, x, weight, bias, running_mean, running_var)`` normalises one chunk
    ``x [B, C', ...]`` (B = chunk steps x N, C' = C, or m*C in the batched engine's
    channel-folded forward) according to the policy and accumulates the per-channel
    statistics of ``x``. ``finish(mod)`` applies the one running-statistics update.
    """

    def __init__(self, mode: str):
        self.mode = check_stream_bn(mode)
        self.n = 0.0  # samples per channel seen so far
        self.mean: torch.Tensor | None = None  # float64 [C']
        self.m2: torch.Tensor | None = None  # float64 [C']: sum of squared deviations
        self.norm_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # "exact": (mean, biased var)
        self.calls = 0  # calls in the current pass
        self.target: tuple[torch.Tensor | None, torch.Tensor | None, bool] | None = None

    # ------------------------------------------------------------------ statistics
    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        var_b, mean_b = torch.var_mean(x.detach(), dim=dims, correction=0)
        n_b = float(x.numel() // x.shape[1])
        mean_b, m2_b = mean_b.double(), var_b.double() * n_b
        if self.mean is None:
            self.n, self.mean, self.m2 = n_b, mean_b, m2_b
            return
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (self.n * n_b / n)
        self.n = n

    def freeze(self) -> None:
        """``"exact"``: the statistics of all T steps are complete; normalise with them from now on."""
        if self.mean is None:
            raise RuntimeError("internal: freezing BN statistics that were never accumulated")
        dt = torch.float32
        self.norm_stats = (self.mean.to(dt), (self.m2 / self.n).to(dt))

    @property
    def pending(self) -> bool:
        return self.mode == "exact" and self.norm_stats is None and self.mean is not None

    # ------------------------------------------------------------------ forward
    def apply(self, mod: _BatchNorm, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              running_mean: torch.Tensor | None, running_var: torch.Tensor | None, *,
              count_batches: bool = True) -> torch.Tensor:
        """Normalise one chunk; ``running_*`` are the tensors to normalise with / update at the end.

        ``count_batches``: ``finish`` increments ``mod.num_batches_tracked`` (False when the
        caller does that itself, e.g. the batched engine).
        """
        if self.target is None:
            self.target = (running_mean, running_var, count_batches)
        elif self.target[0] is not running_mean:
            raise ValueError(f"{type(mod).__name__}: the chunked forward got different running-statistics "
                             "tensors for one BN layer within a forward")
        self.calls += 1
        if self.mode == "exact":
            if self.norm_stats is None:
                self._accumulate(x)
                raise _StopPass
            mean, var = self.norm_stats
            return Fn.batch_norm(x, mean.to(x.dtype), var.to(x.dtype), weight, bias, False, 0.0, mod.eps)
        self._accumulate(x)
        if self.mode == "running":
            if running_mean is None or running_var is None:
                raise ValueError(f"stream_bn='running' needs running statistics; {type(mod).__name__} has "
                                 "track_running_stats=False (use 'exact' or 'chunk')")
            return Fn.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, mod.eps)
        return Fn.batch_norm(x, None, None, weight, bias, True, 0.0, mod.eps)  # "chunk"

    @torch.no_grad()
    def finish(self, mod: _BatchNorm) -> None:
        """One running-statistics update with the statistics over all T steps (train mode only)."""
        if self.target is None or self.mean is None:
            return
        rm, rv, count = self.target
        if not (mod.training and mod.track_running_stats) or rm is None or rv is None:
            return
        factor = bn_momentum(mod)
        if count:
            mod.num_batches_tracked.add_(1)
        unbiased = self.m2 / max(self.n - 1.0, 1.0)
        rm.mul_(1.0 - factor).add_(self.mean.to(rm.dtype), alpha=factor)
        rv.mul_(1.0 - factor).add_(unbiased.to(rv.dtype), alpha=factor)


class BatchNorm2d(layer.BatchNorm2d):
    """SpikingJelly ``layer.BatchNorm2d`` that a chunked forward can drive (``stream_bn``), with
    a choice of BN over time (``bn_time``, ``BN_TIMES``).

    ``bn_time="shared"`` (default): outside a chunked forward (``stream_policy is None``) it is
    exactly the SpikingJelly layer; same parameters, buffers and state_dict keys.
    ``bn_time="per-step"`` (multi-step mode): ``[T, N, C, H, W]`` is normalised one time step
    at a time, ``y[t] = BN(x[t])``, as a single-step BN called in a loop over T: train mode
    uses each step's own batch statistics and updates the running statistics T times per
    forward. Eval mode (running statistics) computes the same function either way.
    """

    stream_policy: BNStream | None = None
    bn_time: str = "shared"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bn_time == "per-step" and self.step_mode == "m":
            if x.dim() != 5:
                raise ValueError(f"expected x with shape [T, N, C, H, W], but got x with shape {tuple(x.shape)}")
            return torch.stack([self.super_forward(x[t]) for t in range(x.shape[0])])
        return super().forward(x)

    def super_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The BN on ``[B, C, H, W]`` (SpikingJelly's ``forward`` merges T and N into B in
        multi-step mode): the policy of the chunked forward, else ``nn.BatchNorm2d``'s."""
        st = self.stream_policy
        if st is None:
            return super().super_forward(x)
        return st.apply(self, x, self.weight, self.bias, self.running_mean, self.running_var)


def batch_stat_bn_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """BN layers that would normalise with batch statistics over time steps (train mode, or no
    running stats); per-time-step BN is exact in any chunk and not listed."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
            and getattr(m, "bn_time", "shared") != "per-step"]


def chunked_forward(model: nn.Module, x: torch.Tensor, *, static: bool, T: int, chunk: int,
                    stream_bn: str, persistent: bool) -> torch.Tensor:
    """``model.forward_seq`` over chunks of ``chunk`` steps (``model``: a ``szo.models.SpikingModel``, which
    imports this module); see the module docstring.

    ``x``: ``[N, C, H, W]`` (``static``: the same image at every step) or ``[T, N, ...]``.
    Neuron state is not reset at the end (the caller does that); it is reset between the
    passes of ``stream_bn="exact"``.
    """
    live = batch_stat_bn_layers(model)
    streams: dict[_BatchNorm, BNStream] = {}
    if live:  # stream_bn was checked by the caller (SpikingModel.forward) and is again by BNStream
        foreign = [f"{n} ({type(m).__module__}.{type(m).__qualname__})" for n, m in live
                   if not isinstance(m, BatchNorm2d)]
        if foreign:
            raise ValueError(
                f"a chunked forward (time_chunk={chunk} < T={T}) cannot reproduce batch-statistics BatchNorm in "
                f"{', '.join(foreign)}; build the model with szo.models.streaming.BatchNorm2d, put BN in eval "
                f"mode, or use time_chunk=None")
        if stream_bn == "exact":
            if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
                raise ValueError("stream_bn='exact' is a no-grad forward (batch statistics of earlier passes are "
                                 "constants, so gradients would be wrong); run it under torch.no_grad(), or use "
                                 "stream_bn='running' / 'chunk', or time_chunk=None")
            if persistent:
                raise ValueError("stream_bn='exact' restarts the sequence once per BN layer and cannot keep neuron "
                                 "state across calls (persistent_state); use eval-mode BN, 'running' or 'chunk'")
        streams = {m: BNStream(stream_bn) for _, m in live}
    bounds = [(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)]
    names = {m: n for n, m in live}
    try:
        for m, st in streams.items():
            m.stream_policy = st
        while True:
            outs: list[torch.Tensor] = []
            stopped = False
            for st in streams.values():
                st.calls = 0
            for t0, t1 in bounds:
                xc = x.unsqueeze(0).expand(t1 - t0, *x.shape) if static else x[t0:t1]
                try:
                    outs.append(model.forward_seq(xc))
                except _StopPass:
                    stopped = True
            for m, st in streams.items():
                if st.calls not in (0, len(bounds)):
                    raise ValueError(f"BN layer {names[m]!r} ran {st.calls} times in {len(bounds)} chunks; the "
                                     "chunked forward needs every BN layer to run once per time step")
            if not stopped:
                break
            pending = [st for st in streams.values() if st.pending]
            if len(pending) != 1:
                raise RuntimeError(f"internal: an exact pass stopped with {len(pending)} pending BN layers")
            pending[0].freeze()
            functional.reset_net(model)
        for m, st in streams.items():
            st.finish(m)
        return torch.cat(outs, 0)
    finally:
        for m in streams:
            m.stream_policy = None
