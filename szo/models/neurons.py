"""The one place that builds neurons (paper eq. (1)-(2) LIF, or the ReLU ANN twin).

Eq. (1): u[t] = (1 - 1/tau) (u[t-1] - V_th s[t-1]) + W s_{l-1}[t] + b
Eq. (2): s[t] = H(u[t] - V_th)

SpikingJelly's ``LIFNode(decay_input=False, v_reset=None)`` charges
``h[t] = (1 - 1/tau) v[t-1] + x[t]`` and soft-resets ``v[t] = h[t] - V_th s[t]``,
which is exactly eq. (1)-(2).

:class:`LIFNode` is SpikingJelly's ``LIFNode`` with a faster forward where no gradient is
needed on the CPU (every SZO probe, every evaluation): SpikingJelly's CPU operator builds and
stacks the charged-voltage sequence it would need for a backward pass and converts the spike
mask twice, ~1/3 of a Spike-ResNet20 forward; :func:`lif_multi_step_nograd` computes the same
charge / fire / reset in the same floating-point order with in-place ops into preallocated
buffers. Spikes and final voltage are bitwise equal to SpikingJelly's (tests/models/
test_neurons.py); grad mode, CUDA (SpikingJelly's fused Triton kernels), other dtypes and
explicit neuron precision go to SpikingJelly unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from spikingjelly.activation_based import neuron, surrogate
from torch import nn
from torch.autograd.function import once_differentiable

from szo.vocab import ACTIVATIONS

TAU: float = 1.1
"""LIF membrane time constant (paper Sec. 6 / App. G)."""
V_TH: float = 1.0
"""LIF firing threshold (paper Sec. 6 / App. G)."""


_LIF_KEYS = frozenset(inspect.signature(neuron.LIFNode.__init__).parameters) - {"self"}


@torch.no_grad()
def lif_multi_step_nograd(x_seq: torch.Tensor, v: torch.Tensor, *, tau: float, decay_input: bool,
                          v_threshold: float, v_reset: float | None,
                          h_seq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SpikingJelly's multi-step LIF forward without autograd state: ``(spikes [T, ...], final v)``.

    The same operations in the same order as SpikingJelly's CPU paths (``spikingjelly._ops.lif``:
    ``cpu._forward_impl`` and the autograd ``reference``), so the result is bitwise equal:
    ``h = v - (v - v_r) / tau + x`` (``decay_input=False``) or ``h = v + (x - (v - v_r)) / tau``,
    ``s = [h >= v_th]``, then ``v = h - s * v_th`` (soft reset, ``v_reset=None``) or
    ``v = s * v_reset + (1 - s) * h``. ``s * v_th`` is exactly 0 or ``v_th``, so the soft reset
    is written as ``h - v_th * s``, and the hard reset as ``where(s, v_reset, h)`` (equal for
    finite ``h``; SpikingJelly's form turns an infinite ``h`` into NaN). The spikes keep ``x_seq``'s memory layout (channels-last
    activations stay channels-last for the next convolution). ``v`` is not modified. ``h_seq``
    (``x_seq``'s shape): where to keep the charged voltages ``h[t]`` (a backward pass needs them).
    """
    r = 0.0 if v_reset is None else float(v_reset)
    out = torch.empty_like(x_seq)
    scratch = torch.empty_like(v) if h_seq is None else None
    bufs = (torch.empty_like(v), torch.empty_like(v))  # v[t] alternates between them; the input v is kept
    r_t = None if v_reset is None else torch.tensor(r, dtype=v.dtype, device=v.device)
    for t in range(x_seq.shape[0]):
        x, v_next = x_seq[t], bufs[t % 2]
        h = scratch if h_seq is None else h_seq[t]
        dv = v if r == 0.0 else torch.sub(v, r, out=h)  # v - 0.0 == v exactly
        if decay_input:  # v + (x - (v - v_r)) / tau
            torch.sub(x, dv, out=h)
            h.div_(tau).add_(v)
        else:  # v - (v - v_r) / tau + x
            torch.div(dv, tau, out=h)
            torch.sub(v, h, out=h)
            h.add_(x)
        s = out[t]
        torch.ge(h, v_threshold, out=s)  # the comparison written as 0.0 / 1.0 straight into the spikes
        if r_t is None:  # soft reset: h - s * v_th
            torch.sub(h, s, alpha=v_threshold, out=v_next)
        else:  # hard reset: s * v_r + (1 - s) * h
            torch.where(s.bool(), r_t, h, out=v_next)
        v = v_next
    return out, v


def _lif_traced(x_seq: torch.Tensor, v: torch.Tensor, *, tau: float, decay_input: bool, v_threshold: float,
                v_reset: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lif_multi_step_nograd` in out-of-place ops, for ``torch.compile`` to fuse (inside a
    compiled graph buffers are the compiler's business)."""
    r = 0.0 if v_reset is None else float(v_reset)
    spikes = []
    for x in x_seq:
        h = v + (x - (v - r)) / tau if decay_input else v - (v - r) / tau + x
        s = (h >= v_threshold).to(x.dtype)
        v = h - s * v_threshold if v_reset is None else s * r + (1.0 - s) * h
        spikes.append(s)
    return torch.stack(spikes), v


def _surrogate(node: neuron.LIFNode):
    """SpikingJelly's own surrogate-gradient function and its (alpha, id) for ``node``, or None
    (a surrogate SpikingJelly's CPU path does not handle by id, or a SpikingJelly without it)."""
    try:
        from spikingjelly._ops.surrogate import _surrogate_gradient, _surrogate_spec
    except ImportError:  # pragma: no cover - another SpikingJelly layout: use its own path
        return None
    spec = _surrogate_spec(node.surrogate_function)
    return None if spec is None else (_surrogate_gradient, spec[1], spec[0])


class _SoftResetLIF(torch.autograd.Function):
    """The paper's LIF (``decay_input=False``, soft reset, reset not detached) for BPTT on the CPU.

    Forward: :func:`lif_multi_step_nograd`, keeping only the charged voltages ``h[t]``.
    Backward: the gradient SpikingJelly's CPU path gets from autograd through its reference ops
    (``v - (v - 0)/tau + x``, ``s = SurrogateSpike(h - v_th)``, ``v' = h - s * v_th``), written out
    with the same floating-point operations: ``g_s = g_out + (-g_v') * v_th``, ``g_h = g_s * sg(h - v_th)
    + g_v'``, ``g_x = g_h``, ``g_v = g_h + (-g_h) / tau``. Every sum has two terms, so the order
    autograd happens to add them in does not matter: gradients are bitwise SpikingJelly's
    (tests/models/test_neurons.py), while the forward keeps one tensor per step instead of the
    reference graph's intermediates. First derivatives only (a double backward raises; SpikingJelly's
    own ``LIFNode`` has second ones); forward-mode AD goes to SpikingJelly's path.
    """

    @staticmethod
    def forward(ctx, x_seq, v, tau, v_threshold, sg_fn, alpha, sid):
        hs = torch.empty_like(x_seq)
        out, v = lif_multi_step_nograd(x_seq, v, tau=tau, decay_input=False, v_threshold=v_threshold, v_reset=None,
                                       h_seq=hs)
        ctx.save_for_backward(hs)
        ctx.params = (tau, v_threshold, sg_fn, alpha, sid)
        return out, v

    @staticmethod
    @once_differentiable  # a second derivative would need the graph of hs: say so instead of a wrong one
    def backward(ctx, g_out, g_vT):
        (hs,) = ctx.saved_tensors
        tau, th, sg_fn, alpha, sid = ctx.params
        gx: list[torch.Tensor] = []
        g_next = g_vT  # gradient of v[t] from the steps after t (None: v[T] unused)
        for t in range(hs.shape[0] - 1, -1, -1):
            g_s = g_out[t] if g_out is not None else torch.zeros_like(hs[t])
            if g_next is not None:
                g_s = g_s + (-g_next) * th  # MulBackward0 of s * v_th, fed by SubBackward0 of h - s * v_th
            g_h = g_s * sg_fn(hs[t] - th, alpha, sid)  # _SurrogateSpikeBackward, then SubBackward0 of h - v_th
            if g_next is not None:
                g_h = g_h + g_next
            gx.append(g_h)
            g_next = g_h + (-g_h) / tau  # v - (v - 0) / tau: SubBackward0, DivBackward0, SubBackward0
        # stacked as UnbindBackward0 does: the same memory layout, so the layers below run the same kernels
        return torch.stack(gx[::-1]), g_next, None, None, None, None, None


class LIFNode(neuron.LIFNode):
    """SpikingJelly's ``LIFNode`` (same arguments, state and gradients) with a faster CPU forward:
    no-grad (:func:`lif_multi_step_nograd`) and, for the paper's neuron, with gradients
    (:class:`_SoftResetLIF`); both bitwise equal to SpikingJelly's."""

    def multi_step_forward(self, x_seq: torch.Tensor, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        v = self.v
        grad = torch.is_grad_enabled() and (x_seq.requires_grad or (isinstance(v, torch.Tensor) and v.requires_grad))
        sg = _surrogate(self) if grad else None
        if (args or kwargs or self.store_v_seq or getattr(self, "_neuron_precision", None) is not None
                or x_seq.device.type != "cpu" or x_seq.dtype != torch.float32
                or fwAD.unpack_dual(x_seq).tangent is not None  # forward-mode AD: szo.models.forward_mode
                or (grad and (sg is None or self.decay_input or self.v_reset is not None or self.detach_reset
                              or torch.compiler.is_compiling()))):
            return super().multi_step_forward(x_seq, *args, **kwargs)
        (v,) = self.materialize_states((x_seq,), (v,), "m")
        if v.dtype != torch.float32:
            return super().multi_step_forward(x_seq, *args, **kwargs)
        if grad:
            spikes, v = _SoftResetLIF.apply(x_seq, v, self.tau, self.v_threshold, *sg)
        else:
            step = _lif_traced if torch.compiler.is_compiling() else lif_multi_step_nograd
            spikes, v = step(x_seq, v, tau=self.tau, decay_input=self.decay_input, v_threshold=self.v_threshold,
                             v_reset=self.v_reset)
        self._memories["v"] = v
        self.v_seq = None
        return spikes


def to_spikingjelly(module: nn.Module) -> nn.Module:
    """Replace, in place, every szo :class:`LIFNode` in ``module`` by SpikingJelly's own ``LIFNode``
    with the same arguments (a model for code without szo, or SpikingJelly's kernels to compare
    against); returns ``module``. Same function: spikes and gradients are bitwise equal."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is LIFNode:
                setattr(parent, name, neuron.LIFNode(**{k: getattr(child, k) for k in _LIF_KEYS}))
    return module


def lif_defaults() -> dict[str, Any]:
    """Keyword arguments of the paper's LIF (a fresh dict; the surrogate is a new instance)."""
    return dict(
        tau=TAU,
        decay_input=False,
        v_threshold=V_TH,
        v_reset=None,  # soft reset: subtract V_th on a spike
        surrogate_function=surrogate.PiecewiseQuadratic(),  # triangle surrogate
        detach_reset=False,
        step_mode="m",
    )


def make_neuron(activation: str = "lif", **overrides: Any) -> nn.Module:
    """Build one activation layer.

    ``"lif"``: the paper's multi-step LIF (``overrides`` replace any ``LIFNode`` argument,
    e.g. ``store_v_seq=True``). ``"relu"``: an elementwise ``nn.ReLU`` (the ANN twin; it
    acts on ``[T, N, ...]`` directly and takes no overrides).
    """
    if activation == "lif":
        unknown = sorted(set(overrides) - _LIF_KEYS)
        if unknown:
            raise ValueError(
                f"unknown LIF override(s) {unknown}; valid keys: {sorted(_LIF_KEYS)}"
            )
        kwargs = lif_defaults()
        kwargs.update(overrides)
        return LIFNode(**kwargs)
    if activation == "relu":
        if overrides:
            raise ValueError(
                f"activation 'relu' takes no overrides, got {sorted(overrides)}"
            )
        return nn.ReLU()
    raise ValueError(f"unknown activation {activation!r}; valid: {list(ACTIVATIONS)}")
