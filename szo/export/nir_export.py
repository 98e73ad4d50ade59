"""szo models -> NIR (Neuromorphic Intermediate Representation) graphs.

:func:`to_nir` turns any zoo model (float, or the fixed-point network of ``szo.hw``) into a
``nir.NIRGraph``; its reader, :func:`szo.export.nir_import.from_nir`, turns such a graph back into a
:class:`NIRNetwork`, a :class:`~szo.models.SpikingModel` built from SpikingJelly multi-step
layers that every szo evaluation path runs (``model(x)`` -> logits ``[T, N, classes]``,
neuron state reset after each forward, ``persistent_state()`` for streaming). An imported
:class:`NIRNetwork` (a graph made anywhere, cycles and ``CubaLIF`` included) is written back node
for node with its current weights (:func:`_imported_graph`).

Tracing and add-node handling are nirtorch's (``torch_to_nir``); the per-layer maps are here
because SpikingJelly's own
``nir_exchange`` refuses soft reset (``NotImplementedError("NIR does not distinguish soft
reset.")``) and has no BatchNorm, adaptive or max pooling. What NIR cannot hold, said plainly:

* **Soft reset.** NIR's ``LIF`` resets *to* ``v_reset``; the paper's LIF subtracts the
  threshold. The node is written as ``nir.LIF`` with every field exact (below) and
  ``metadata["reset"] = "subtract"``. A reader that ignores metadata runs a hard reset to 0
  (a different network). :func:`from_nir` honours the flag;
  ``szo.export.simulators.snntorch_from_nir`` applies it to snnTorch's importer.
* **Discrete time.** The eq. (1) LIF ``h[t] = (1 - 1/tau) v[t-1] + x[t]`` is the forward-Euler
  step of NIR's ``tau_m dv/dt = (v_leak - v) + r I`` with step ``dt``: ``tau_m = tau * dt``,
  ``r = tau``, ``v_leak = 0`` (the convention of SpikingJelly's and snnTorch's exchanges;
  ``dt`` defaults to 1e-4 s, snnTorch's hard-coded value). The graph metadata records ``dt``.
* **BatchNorm** has no NIR node: it is folded (eval mode, running statistics) into the
  preceding convolution's weight and bias, ``torch.nn.utils.fusion.fuse_conv_bn_eval``.
  Exact in real arithmetic; in float32 the folded product rounds differently (see
  docs/deploy.md for the measured error).
* **Adaptive average pooling** is written as ``nir.AvgPool2d`` with kernel = stride = input /
  output size when the input divides; otherwise (VGG's 7x7 pool on a 4x4 map), when it feeds
  ``Flatten -> Linear``, it is folded into that Linear's weight (exact in real arithmetic), and
  anywhere else an error names the layer.
* **Max pooling** has no NIR node. After a spiking layer its input is 0/1, where
  ``max = H(sum - 1/2)``: it is written as a ``nir.SumPool2d`` followed by a
  ``nir.Threshold(0.5)`` (exact for spikes; an error for graded inputs).
* **Foreign networks** (``szo.models.foreign.ForeignModel``, e.g. SpikingJelly's Fashion-MNIST
  tutorial CSNN of the fmnist recipes): their own ``forward`` is traced; the tutorial form
  ``core(x.unsqueeze(0).repeat(T, ...) / .expand(T, ...))`` followed by ``.mean(0)`` is exported as
  the multi-step core (the static frame is the input at every step, as for szo's models) and graph
  metadata ``output = "rate"``: the graph's output is the last layer's spikes per step, the
  network's output their mean over T (:class:`NIRNetwork` returns that mean, ``[1, N, C]``, as
  ``ForeignModel`` does). Any other encoding or readout is refused in one line. SpikingJelly's
  ``IFNode`` is ``nir.IF`` with ``r = 1 / dt`` (``v += x`` per step), reset as for the LIF.
* **Fixed point** (``szo.hw.FixedPointNetwork``): the graph is the float network its integer
  forward computes: weights ``w_int * 2**exp`` (exactly representable in float32), biases
  ``bias_int / 2**12``, sum pools, ``tau`` of the 12-bit decay; node metadata carries the
  integers (``w_int``, ``exp``, ``bias_int``, ``voltage_decay_int``, ``threshold_int``) and the
  graph metadata the bit widths. The integer roundings (input, leak, right shifts), saturation
  and the strict ``v > th`` are not expressible in NIR (:func:`_fixed_deploy_module`).
"""
from __future__ import annotations

import copy
import io
import operator
import os
from typing import Any, Callable

import numpy as np
import torch
from spikingjelly.activation_based import functional, layer
from spikingjelly.activation_based import neuron as sj_neuron
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from szo.export.nir_common import DEFAULT_DT, FORMAT, Delay, Scale, SumPool2d, Threshold, nir_modules, why
from szo.export.nir_import import NIRNetwork
from szo.hw.convert import FixedPointNetwork
from szo.hw.fixed import DECAY_SHIFT, STATE_SHIFT, decay_to_int, threshold_to_int
from szo.io import atomic_write_bytes
from szo.models.base import SpikingModel
from szo.models.cuba import CUBA_FIELDS, CubaLIFNode
from szo.models.foreign import ForeignModel
from szo.models.neurons import LIFNode, make_neuron
from szo.models.nir_dynamics import CUBA_LI_FIELDS, LI_FIELDS, CubaLINode, INode, LINode
from szo.models.pooling import AdaptiveAvgPool2d

__all__ = ["to_nir", "write_nir"]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float32).numpy().copy()


def _unsupported(path: str, m: nn.Module, why: str) -> ValueError:
    return ValueError(f"cannot export layer {path!r} ({type(m).__module__}.{type(m).__qualname__}) to NIR: {why}")


class _Root(nn.Module):
    """Traceable root: ``forward`` is the model's ``forward_seq`` (multi-step ``[T, N, ...]``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        return self.net.forward_seq(x_seq)


class _ForeignRoot(nn.Module):
    """Traceable root of a ``ForeignModel``: ``forward`` is its network's own (``net.net``), so
    layer paths are the model's (``net.conv_fc.0``)."""

    def __init__(self, model: ForeignModel) -> None:
        super().__init__()
        self.net = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.net(x)


_SPIKING = (sj_neuron.LIFNode, sj_neuron.IFNode)
"""Neurons whose output is 0/1 spikes (a max pool after them is a sum pool + threshold)."""

_LEAVES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.MaxPool2d, nn.Flatten,
                             sj_neuron.BaseNode, nn.modules.batchnorm._BatchNorm, nn.Identity, nn.ReLU, nn.Dropout)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _LEAVES) or super().is_leaf_module(m, qualname)


def _fold_adaptive_pool_into_linear(gm: fx.GraphModule, shape: tuple[int, int, int]) -> None:
    """``AdaptiveAvgPool2d -> Flatten -> Linear`` whose pool is no ``AvgPool2d`` (the input size is
    not a multiple of the output size, e.g. VGG's 7x7 pool on a 4x4 map) becomes
    ``Flatten -> Linear`` with the pool folded into the weight: ``W' = W P`` (P: the pool as a
    matrix, found as the Jacobian of the linear map). Exact in real arithmetic."""
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros(1, 1, *shape))
    functional.reset_net(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.AdaptiveAvgPool2d):
            continue
        pool = gm.get_submodule(node.target)
        c, h, w = node.args[0].meta["tensor_meta"].shape[-3:]
        o = pool.output_size if isinstance(pool.output_size, (tuple, list)) else (pool.output_size,) * 2
        oh, ow = o[0] or h, o[1] or w
        if h % oh == 0 and w % ow == 0:
            continue  # one AvgPool2d: exported as is
        flat = next(iter(node.users)) if len(node.users) == 1 else None
        if flat is None or flat.op != "call_module" or not isinstance(gm.get_submodule(flat.target), nn.Flatten):
            continue
        lin = next(iter(flat.users)) if len(flat.users) == 1 else None
        if lin is None or lin.op != "call_module" or not isinstance(gm.get_submodule(lin.target), nn.Linear):
            continue
        f = gm.get_submodule(flat.target)
        if (f.start_dim, f.end_dim) != (1, -1):
            continue
        fc = gm.get_submodule(lin.target)
        wt = fc.weight.detach().double()

        def head(x: torch.Tensor, wt=wt, out=(oh, ow)) -> torch.Tensor:
            return torch.nn.functional.adaptive_avg_pool2d(x, out).flatten(1) @ wt.t()

        jac = torch.autograd.functional.jacobian(head, torch.zeros(1, c, h, w, dtype=torch.float64))
        new = layer.Linear(c * h * w, fc.out_features, bias=fc.bias is not None, step_mode="m")
        with torch.no_grad():
            new.weight.copy_(jac.reshape(fc.out_features, c * h * w).float())
            if fc.bias is not None:
                new.bias.copy_(fc.bias)
        parent, _, name = lin.target.rpartition(".")
        setattr(gm.get_submodule(parent), name, new)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()


def _method_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _foreign_core(model: ForeignModel) -> tuple[fx.GraphModule, bool]:
    """``(traced multi-step core, rate)`` of a foreign network of the SpikingJelly tutorial form
    ``forward(x) = core(x.unsqueeze(0).repeat(T, 1, ...) or .expand(T, -1, ...))``, followed by
    ``.mean(0)`` (``rate``) for an ``output="rate"`` model: the encoding and the time mean are cut,
    the core's input is the sequence and its output the spikes per step. One ValueError otherwise."""
    form = ("NIR holds a multi-step network; a foreign network is exported when its forward has SpikingJelly's "
            "tutorial form core(x.unsqueeze(0).repeat(T, ...) or .expand(T, ...))"
            + (" followed by .mean(0) (its output='rate')" if model.output == "rate" else ""))
    root = _ForeignRoot(copy.deepcopy(model).cpu().float().eval())
    functional.reset_net(root)
    try:
        gm = fx.GraphModule(root, _Tracer().trace(root))
    except Exception as exc:  # data-dependent control flow, unsupported Python: fx's many error types
        raise ValueError(f"cannot export {model.model_name} to NIR: its forward does not trace with torch.fx "
                         f"({why(exc)}); {form}") from None
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    lift = next(iter(x.users)) if len(x.users) == 1 else None
    rep = next(iter(lift.users)) if lift is not None and len(lift.users) == 1 else None
    ok = (lift is not None and lift.op == "call_method" and lift.target == "unsqueeze"
          and _method_arg(lift, 1, "dim") == 0 and rep is not None and rep.op == "call_method")
    if ok and rep.target == "repeat":
        ok = list(rep.args[1:]) == [model.T, 1, 1, 1, 1]
    elif ok and rep.target == "expand":
        ok = len(rep.args) == 6 and rep.args[1] == model.T and all(a == -1 for a in rep.args[2:])
    else:
        ok = False
    if not ok:
        raise ValueError(f"cannot export {model.model_name} to NIR: its input encoding is not a repetition of the "
                         f"frame over T = {model.T} steps; {form}")
    rep.replace_all_uses_with(x)
    gm.graph.erase_node(rep)
    gm.graph.erase_node(lift)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    last = out.args[0]
    rate = (isinstance(last, fx.Node) and last.op == "call_method" and last.target == "mean"
            and _method_arg(last, 1, "dim") == 0 and not _method_arg(last, 2, "keepdim", False))
    if rate != (model.output == "rate"):
        raise ValueError(f"cannot export {model.model_name} to NIR: its readout is not "
                         f"{'the mean over T of its last layer' if model.output == 'rate' else 'the sequence'}; "
                         f"{form}")
    if rate:
        out.args = (last.args[0],)
        gm.graph.erase_node(last)
    gm.recompile()
    return gm, rate


def _deploy_module(model: nn.Module, shape: tuple[int, int, int]) -> fx.GraphModule:
    """A traced eval-mode copy of ``model.forward_seq`` (of a foreign network's multi-step core,
    :func:`_foreign_core`) with BN folded into its conv, ``nn.Identity`` / BN nodes removed and a
    non-uniform adaptive pool folded into the classifier: what the NIR graph will hold, runnable
    in torch."""
    if isinstance(model, ForeignModel):
        gm, _ = _foreign_core(model)
    else:
        root = _Root(copy.deepcopy(model).cpu().float().eval())
        functional.reset_net(root)
        try:
            gm = fx.GraphModule(root, _Tracer().trace(root))
        except Exception as exc:  # a per-step loop (snn_rlif's recurrence), data-dependent control flow
            raise ValueError(f"cannot export {model.model_name} to NIR: its forward does not trace with torch.fx "
                             f"({why(exc)})") from None
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        m = gm.get_submodule(node.target)
        path = node.target.removeprefix("net.")
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            src = node.args[0]
            conv = gm.get_submodule(src.target) if isinstance(src, fx.Node) and src.op == "call_module" else None
            if not isinstance(conv, nn.Conv2d) or len(src.users) != 1 or m.running_mean is None:
                raise ValueError(f"cannot export layer {path!r} ({type(m).__name__}) to NIR: NIR has no BatchNorm node "
                                 f"and this one cannot be folded (it must follow a Conv2d whose output feeds it "
                                 f"alone, and track running statistics)")
            parent, _, name = src.target.rpartition(".")
            setattr(gm.get_submodule(parent), name, torch.nn.utils.fusion.fuse_conv_bn_eval(conv, m))
        elif not isinstance(m, (nn.Identity, nn.Dropout)):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in (operator.add, torch.add):
            raise ValueError(f"cannot export operation {node.target} ({node.name}) to NIR: the only function NIR "
                             f"graphs express is the sum of a node's inputs (residual '+')")
        if node.op == "call_method" and node.target != "add":
            raise ValueError(f"cannot export method call .{node.target}() ({node.name}) to NIR: only '+' is expressible")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _fold_adaptive_pool_into_linear(gm, shape)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


class _Mapper:
    """Module -> NIR node maps for ``nirtorch.torch_to_nir`` or an imported graph's modules.

    ``in_shape[m]``: the ``[T, N, ...]`` shape of module ``m``'s input; ``path[m]``: its layer
    path (node metadata ``szo_layer``); ``prev[m]``: the module feeding it (a max pool's)."""

    def __init__(self, dt: float, quant: dict[str, dict[str, Any]], in_shape: dict[nn.Module, tuple[int, ...]],
                 path: dict[nn.Module, str], prev: dict[nn.Module, nn.Module | None]) -> None:
        nir, _ = nir_modules()
        self.nir, self.dt, self.quant = nir, dt, quant
        self.in_shape, self.path, self.prev = in_shape, path, prev

    @classmethod
    def traced(cls, gm: fx.GraphModule, example: torch.Tensor, dt: float,
               quant: dict[str, dict[str, Any]]) -> _Mapper:
        """The maps of a traced deploy module (shapes from one forward of ``example``)."""
        mapper = cls(dt, quant, {}, {}, {})
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            m = gm.get_submodule(node.target)
            path = node.target.removeprefix("net.")
            if type(m) not in mapper.map_dict:
                raise _unsupported(path, m, "no NIR mapping; supported: Conv1d, Conv2d (+ BatchNorm, folded), Linear, "
                                            "AvgPool2d, AdaptiveAvgPool2d, MaxPool2d right after spikes, Flatten, "
                                            "SpikingJelly LIFNode / IFNode, residual '+'")
            mapper.path[m] = path
            src = node.args[0]
            mapper.prev[m] = gm.get_submodule(src.target) if isinstance(src, fx.Node) and src.op == "call_module" \
                else None
        with torch.no_grad():
            ShapeProp(gm).propagate(example)
        functional.reset_net(gm)
        for node in gm.graph.nodes:
            if node.op == "call_module":
                mapper.in_shape[gm.get_submodule(node.target)] = tuple(node.args[0].meta["tensor_meta"].shape)
        return mapper

    @property
    def map_dict(self) -> dict[type, Callable[[nn.Module], Any]]:
        return {nn.Conv2d: self.conv2d, layer.Conv2d: self.conv2d, nn.Linear: self.linear,
                layer.Linear: self.linear, nn.AvgPool2d: self.avgpool, layer.AvgPool2d: self.avgpool,
                nn.AdaptiveAvgPool2d: self.adaptive_avgpool, layer.AdaptiveAvgPool2d: self.adaptive_avgpool,
                AdaptiveAvgPool2d: self.adaptive_avgpool,
                nn.MaxPool2d: self.maxpool, layer.MaxPool2d: self.maxpool, nn.Flatten: self.flatten,
                layer.Flatten: self.flatten, sj_neuron.LIFNode: self.lif, LIFNode: self.lif, SumPool2d: self.sumpool,
                sj_neuron.IFNode: self.if_node, Threshold: self.threshold, CubaLIFNode: self.cuba_lif,
                nn.Conv1d: self.conv1d, layer.Conv1d: self.conv1d, Scale: self.scale, Delay: self.delay,
                LINode: self.li, CubaLINode: self.cuba_li, INode: self.integrator}

    def _meta(self, m: nn.Module) -> dict[str, Any]:
        meta: dict[str, Any] = {"szo_layer": self.path.get(m, "")}
        q = self.quant.get(meta["szo_layer"])
        if q is not None:  # fixed point: integer mantissas and exponents next to the float weights
            meta.update(q)
        return meta

    def conv2d(self, m: nn.Conv2d) -> Any:
        if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
            raise _unsupported(self.path.get(m, "?"), m, "only ungrouped, zero-padded convolutions with integer padding")
        bias = _np(m.bias) if m.bias is not None else np.zeros(m.out_channels, dtype=np.float32)
        return self.nir.Conv2d(input_shape=tuple(self.in_shape[m][-2:]), weight=_np(m.weight), stride=m.stride,
                               padding=m.padding, dilation=m.dilation, groups=1, bias=bias, metadata=self._meta(m))

    def conv1d(self, m: nn.Conv1d) -> Any:
        if m.padding_mode != "zeros":
            raise _unsupported(self.path.get(m, "?"), m, "only zero-padded convolutions")
        padding = m.padding if isinstance(m.padding, str) else int(m.padding[0])
        bias = _np(m.bias) if m.bias is not None else np.zeros(m.out_channels, dtype=np.float32)
        return self.nir.Conv1d(input_shape=int(self.in_shape[m][-1]), weight=_np(m.weight), stride=int(m.stride[0]),
                               padding=padding, dilation=int(m.dilation[0]), groups=int(m.groups), bias=bias,
                               metadata=self._meta(m))

    def scale(self, m: Scale) -> Any:
        return self.nir.Scale(scale=_np(m.scale), metadata=self._meta(m))

    def delay(self, m: Delay) -> Any:
        """``delay = steps * dt``: the delay in steps kept when written for another ``dt``."""
        return self.nir.Delay(delay=(m.steps.cpu().numpy().astype(np.float64) * self.dt).astype(np.float32),
                              metadata=self._meta(m))

    def _fields(self, m: nn.Module, names: tuple[str, ...], taus: tuple[str, ...] = (),
                rates: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """A neuron module's NIR arrays (what it runs, float32); written for another ``dt`` than its
        own, time constants scaled by ``dt / m.dt`` and rates (``I``'s ``r``) by ``m.dt / dt``, so
        that every step computes the same."""
        f = {k: _np(m.get_buffer(k)) for k in names}
        if self.dt != m.dt:
            for k in taus:
                f[k] = (f[k].astype(np.float64) * (self.dt / m.dt)).astype(np.float32)
            for k in rates:
                f[k] = (f[k].astype(np.float64) * (m.dt / self.dt)).astype(np.float32)
        return f

    def li(self, m: LINode) -> Any:
        return self.nir.LI(**self._fields(m, LI_FIELDS, taus=("tau",)), metadata=self._meta(m))

    def cuba_li(self, m: CubaLINode) -> Any:
        return self.nir.CubaLI(**self._fields(m, CUBA_LI_FIELDS, taus=("tau_syn", "tau_mem")), metadata=self._meta(m))

    def integrator(self, m: INode) -> Any:
        return self.nir.I(**self._fields(m, ("r",), rates=("r",)), metadata=self._meta(m))

    def linear(self, m: nn.Linear) -> Any:
        if m.bias is None:
            return self.nir.Linear(_np(m.weight), metadata=self._meta(m))
        return self.nir.Affine(_np(m.weight), _np(m.bias), metadata=self._meta(m))

    def _pool(self, m: nn.Module, kernel, stride, padding) -> Any:
        pair = lambda v: np.array(v if isinstance(v, (tuple, list)) else (v, v))  # noqa: E731
        return self.nir.AvgPool2d(kernel_size=pair(kernel), stride=pair(stride), padding=pair(padding),
                                  metadata=self._meta(m))

    def sumpool(self, m: SumPool2d) -> Any:
        pair = lambda v: np.array(v if isinstance(v, (tuple, list)) else (v, v))  # noqa: E731
        return self.nir.SumPool2d(kernel_size=pair(m.kernel_size), stride=pair(m.stride), padding=pair(m.padding),
                                  metadata=self._meta(m))

    def avgpool(self, m: nn.AvgPool2d) -> Any:
        if m.ceil_mode or m.divisor_override is not None or (np.any(m.padding) and not m.count_include_pad):
            raise _unsupported(self.path.get(m, "?"), m, "NIR AvgPool2d has no ceil_mode / divisor_override")
        return self._pool(m, m.kernel_size, m.stride if m.stride is not None else m.kernel_size, m.padding)

    def adaptive_avgpool(self, m: nn.AdaptiveAvgPool2d) -> Any:
        h, w = self.in_shape[m][-2:]
        out = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size, m.output_size)
        oh, ow = (h if out[0] is None else out[0]), (w if out[1] is None else out[1])
        if h % oh or w % ow:
            raise _unsupported(self.path.get(m, "?"), m, f"input {h}x{w} is not a multiple of the output {oh}x{ow}, "
                                                         f"so it is not one AvgPool2d")
        return self._pool(m, (h // oh, w // ow), (h // oh, w // ow), (0, 0))

    def maxpool(self, m: nn.MaxPool2d) -> Any:
        prev = self.prev.get(m)
        if not isinstance(prev, _SPIKING):
            raise _unsupported(self.path.get(m, "?"), m, "NIR has no max pooling; it is exported (as SumPool2d + "
                                                         "Threshold 0.5) only right after a spiking layer")
        if m.dilation not in (1, (1, 1)) or m.ceil_mode:
            raise _unsupported(self.path.get(m, "?"), m, "dilation / ceil_mode have no NIR form")
        pair = lambda v: np.array(v if isinstance(v, (tuple, list)) else (v, v))  # noqa: E731
        stride = m.stride if m.stride is not None else m.kernel_size
        c, h, w = self.in_shape[m][-3:]
        k, s, p = pair(m.kernel_size), pair(stride), pair(m.padding)
        out = (c, (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1)
        meta = self._meta(m)
        nodes = {"input": self.nir.Input(input_type=np.array([c, h, w])),
                 "sum": self.nir.SumPool2d(kernel_size=k, stride=s, padding=p, metadata=meta),
                 "any": self.nir.Threshold(threshold=np.full(out, 0.5, dtype=np.float32), metadata=meta),
                 "output": self.nir.Output(output_type=np.array(out))}
        return self.nir.NIRGraph(nodes=nodes, edges=[("input", "sum"), ("sum", "any"), ("any", "output")],
                                 type_check=False, metadata={"szo_layer": meta["szo_layer"], "op": "max_pool_of_spikes"})

    def flatten(self, m: nn.Flatten) -> Any:
        start, end = m.start_dim, m.end_dim
        start = start - 1 if start > 0 else start  # NIR shapes have no batch dim
        end = end - 1 if end > 0 else end
        return self.nir.Flatten(input_type={"input": np.array(self.in_shape[m][2:])}, start_dim=start, end_dim=end,
                                metadata=self._meta(m))

    def lif(self, m: sj_neuron.LIFNode) -> Any:
        shape = self.in_shape[m][2:]
        tau = float(m.tau)
        full = lambda v: np.full(shape, v, dtype=np.float32)  # noqa: E731
        reset = "subtract" if m.v_reset is None else "value"
        v_reset = 0.0 if m.v_reset is None else float(m.v_reset)
        meta = self._meta(m)
        meta.update(reset=reset, tau_steps=tau, decay_input=int(bool(m.decay_input)))
        # forward Euler with step dt: v += dt/tau_m ((v_leak - v) + r I)  ==  SpikingJelly's charge
        return self.nir.LIF(tau=full(tau * self.dt), r=full(1.0 if m.decay_input else tau),
                            v_leak=full(0.0 if m.v_reset is None else v_reset), v_threshold=full(float(m.v_threshold)),
                            v_reset=full(v_reset), metadata=meta)


    def if_node(self, m: sj_neuron.IFNode) -> Any:
        shape = self.in_shape[m][2:]
        full = lambda v: np.full(shape, v, dtype=np.float32)  # noqa: E731
        reset = "subtract" if m.v_reset is None else "value"
        meta = self._meta(m)
        meta.update(reset=reset)
        # forward Euler with step dt: v += dt r I = I, SpikingJelly's IF charge (SpikingJelly's exchange: r = 1/dt)
        return self.nir.IF(r=full(1.0 / self.dt), v_threshold=full(float(m.v_threshold)),
                           v_reset=full(0.0 if m.v_reset is None else float(m.v_reset)), metadata=meta)


    def threshold(self, m: Threshold) -> Any:
        return self.nir.Threshold(threshold=_np(m.threshold), metadata=self._meta(m))

    def cuba_lif(self, m: CubaLIFNode) -> Any:
        """The node's own arrays (what it runs, float32); time constants rescaled by ``dt / m.dt`` when
        written for another step (their length in steps kept)."""
        return self.nir.CubaLIF(**self._fields(m, CUBA_FIELDS, taus=("tau_syn", "tau_mem")), metadata=self._meta(m))


def _flatten_subgraphs(nir, nodes: dict[str, Any], edges: list[tuple[str, str]]) -> tuple[dict, list]:
    """Inline the one-level subgraphs of :meth:`_Mapper.maxpool` (``name.sum`` -> ``name.any``)."""
    for name in [n for n, v in nodes.items() if isinstance(v, nir.NIRGraph)]:
        sub = nodes.pop(name)
        inner = {k: v for k, v in sub.nodes.items() if not isinstance(v, (nir.Input, nir.Output))}
        first = next(d for s, d in sub.edges if isinstance(sub.nodes[s], nir.Input))
        last = next(s for s, d in sub.edges if isinstance(sub.nodes[d], nir.Output))
        nodes.update({f"{name}.{k}": v for k, v in inner.items()})
        new_edges = [(f"{name}.{s}", f"{name}.{d}") for s, d in sub.edges if s in inner and d in inner]
        for s, d in edges:
            new_edges.append((f"{name}.{last}" if s == name else s, f"{name}.{first}" if d == name else d))
        edges = new_edges
    return nodes, edges


def _fixed_deploy_module(net: Any, shape: tuple[int, int, int]) -> tuple[fx.GraphModule, dict[str, dict[str, Any]],
                                                                         dict[str, Any]]:
    """The float graph that the integer forward of a ``szo.hw.FixedPointNetwork`` computes, and
    the per-layer integer parameters (node metadata).

    Synapses carry ``w_int * 2**exp`` (BN and the pooling factor already folded, as on chip)
    and ``bias_int / 2**STATE_SHIFT``; average pools become the sum pools the chip runs; the
    LIF's ``tau`` is the one of the 12-bit decay (``4096 / decay_int``). What the float graph
    does not hold: the rounding of the input to ``ACT_SHIFT`` fractional bits, the toward-zero
    rounding of the integer leak and of right shifts, saturation, and the strict ``v > th``.
    """
    with torch.no_grad():
        net(torch.zeros(1, *shape))  # fixes the pooling factors that quantized_layers() reports
    functional.reset_net(net)
    quant = net.quantized_layers()
    gm = fx.GraphModule(net, copy.deepcopy(net.graph))
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros(1, 1, *shape))  # float modules: shapes for the pools
    functional.reset_net(gm)
    meta: dict[str, dict[str, Any]] = {}

    def put(path: str, module: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, module)

    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        m = gm.get_submodule(node.target)
        path = node.target
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Identity, nn.Dropout)):  # BN: folded into w_int
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif path in quant:
            q = quant[path]
            new = copy.deepcopy(m)
            new.weight = nn.Parameter(q["w_int"].to(torch.float64).mul(2.0 ** q["exp"]).to(torch.float32))
            bias = (q["bias_int"].to(torch.float64) / (1 << STATE_SHIFT) if q["bias_int"] is not None
                    else torch.zeros(new.weight.shape[0], dtype=torch.float64))
            new.bias = nn.Parameter(bias.to(torch.float32))
            put(path, new)
            meta[path] = {"fixed_point": 1, "w_int": q["w_int"].cpu().to(torch.int32).numpy().copy(), "exp": int(q["exp"]),
                          "mult": float(q["mult"])}
            if q["bias_int"] is not None:
                meta[path]["bias_int"] = q["bias_int"].cpu().to(torch.int64).numpy().copy()
        elif isinstance(m, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            h, w = node.args[0].meta["tensor_meta"].shape[-2:]
            if isinstance(m, nn.AdaptiveAvgPool2d):
                o = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size, m.output_size)
                k = (h // (o[0] or h), w // (o[1] or w))
                put(path, SumPool2d(k, k, (0, 0)))
            else:
                put(path, SumPool2d(m.kernel_size, m.stride if m.stride is not None else m.kernel_size, m.padding))
        elif isinstance(m, sj_neuron.LIFNode):
            d = decay_to_int(1.0 / float(m.tau), DECAY_SHIFT)
            put(path, make_neuron("lif", tau=(1 << DECAY_SHIFT) / d, v_threshold=float(m.v_threshold),
                                  v_reset=m.v_reset))
            meta[path] = {"fixed_point": 1, "voltage_decay_int": d, "current_decay_int": 1 << DECAY_SHIFT,
                          "threshold_int": threshold_to_int(float(m.v_threshold))}
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    P = net.widths.as_dict()
    graph_meta = {f"precision_{k}": int(v) for k, v in P.items()}
    graph_meta.update(state_shift=STATE_SHIFT, decay_shift=DECAY_SHIFT)
    return gm, meta, graph_meta


@torch.no_grad()
def to_nir(model: SpikingModel, input_shape: tuple[int, ...] | None = None, *, dt: float | None = None,
           metadata: dict[str, Any] | None = None) -> Any:
    """``nir.NIRGraph`` of ``model`` (eval mode: BN folded with its running statistics).

    ``input_shape``: ``(C, H, W)`` of one frame (shapes of NIR nodes are per sample, without
    time or batch); an imported :class:`~szo.export.NIRNetwork` has its own (given, it must be
    that one) and is written back node for node with its current weights, its edges (cycles
    included) and its graph's metadata (:func:`_imported_graph`). ``dt``: seconds per time step
    written into NIR time constants (default ``DEFAULT_DT``; an imported network's own). ``metadata``:
    extra graph metadata (str / int / float / lists; e.g. ``bin_us`` and ``sensor_size`` of an
    event-stream model, which ``szo demo dvs-stream --model OUT.nir`` needs). A
    ``szo.hw.FixedPointNetwork`` is exported with its dequantised weights plus the integer
    mantissas / exponents as node metadata. Raises ``ValueError`` naming the first layer
    NIR cannot express.
    """
    nir, nirtorch = nir_modules()
    if not isinstance(model, SpikingModel):
        raise ValueError(f"to_nir exports a szo SpikingModel, got {type(model).__name__}")
    if dt is None:
        dt = model.dt if isinstance(model, NIRNetwork) else DEFAULT_DT
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not dt > 0:
        raise ValueError(f"dt must be a positive number of seconds, got {dt!r}")
    if isinstance(model, NIRNetwork):
        if input_shape is not None and tuple(input_shape) != model.input_shape:
            raise ValueError(f"input_shape {tuple(input_shape)!r} is not the imported graph's {model.input_shape!r}")
        return _imported_graph(nir, model, float(dt), metadata)
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else (input_shape,)
    if len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape):
        raise ValueError(f"input_shape must be (C, H, W) positive ints, got {input_shape!r}")
    quant: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    source = model

    if isinstance(model, FixedPointNetwork):
        gm, quant, extra = _fixed_deploy_module(model, shape)
    else:
        gm = _deploy_module(source, shape)
    example = torch.zeros(1, 1, *shape)
    mapper = _Mapper.traced(gm, example, float(dt), quant)
    graph = nirtorch.torch_to_nir(gm, mapper.map_dict, default_dict=None, type_check=False)
    nodes, edges = _flatten_subgraphs(nir, dict(graph.nodes), list(graph.edges))
    rename = {k: (k[4:] if k.startswith("net_") else k) for k in nodes}
    nodes = {rename[k]: v for k, v in nodes.items()}
    edges = [(rename.get(s, s), rename.get(d, d)) for s, d in edges]
    for k, v in nodes.items():
        if isinstance(v, nir.Input):
            nodes[k] = nir.Input(input_type=np.array(shape))
        elif isinstance(v, nir.Output):
            nodes[k] = nir.Output(output_type=np.array([source.num_classes]))
    rate = isinstance(source, ForeignModel) and source.output == "rate"
    meta = {"format": FORMAT, "model_name": source.model_name, "T": int(source.T), "dt": float(dt),
            "num_classes": int(source.num_classes), "input_shape": np.array(shape),
            "fixed_point": int(bool(quant)), "output": "rate" if rate else "sequence", **extra}
    for k, v in (metadata or {}).items():
        meta[str(k)] = np.asarray(v) if isinstance(v, (list, tuple)) else v
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=meta, type_check=False)


def _imported_graph(nir: Any, model: NIRNetwork, dt: float, metadata: dict[str, Any] | None) -> Any:
    """The graph of an imported network as it stands: one node per module (the maps of
    :class:`_Mapper`, shapes from one forward), the Input / Output of its input and output shape,
    the graph's edges in their order, and its metadata with szo's fields updated (the fixed-point
    ones dropped: the weights may have moved off the integer grid)."""
    net = copy.deepcopy(model).cpu().float().eval()
    runner = net.graph_module
    in_shape: dict[nn.Module, tuple[int, ...]] = {}

    def record(m: nn.Module, args: tuple) -> None:  # a pre-hook returning None leaves the input alone
        in_shape.setdefault(m, tuple(args[0].shape))

    hooks = [runner.module_of(n).register_forward_pre_hook(record) for n in runner.names]
    try:
        out = runner(torch.zeros(1, 1, *net.input_shape))
    finally:
        for h in hooks:
            h.remove()
        functional.reset_net(net)
    path = {runner.module_of(n): n for n in runner.names}
    mapper = _Mapper(dt, {}, in_shape, path, {})
    nodes = {}
    for name in runner.plan.nodes:
        if name == runner.plan.input:
            nodes[name] = nir.Input(input_type=np.array(net.input_shape))
        elif name == runner.plan.output:
            nodes[name] = nir.Output(output_type=np.array(out.shape[2:]))
        else:
            m = runner.module_of(name)
            if type(m) not in mapper.map_dict:
                raise _unsupported(name, m, "no NIR mapping")
            nodes[name] = mapper.map_dict[type(m)](m)
    meta = {k: v for k, v in net.nir_metadata.items() if k != "fixed_point" and not k.startswith("precision_")
            and k not in ("state_shift", "decay_shift")}
    meta.update({"format": FORMAT, "model_name": net.model_name, "dt": dt, "num_classes": int(net.num_classes),
                 "input_shape": np.array(net.input_shape), "fixed_point": 0, "output": net.output})
    if net.graph_T is not None:
        meta["T"] = int(net.graph_T)
    for k, v in (metadata or {}).items():
        meta[str(k)] = np.asarray(v) if isinstance(v, (list, tuple)) else v
    return nir.NIRGraph(nodes=nodes, edges=[tuple(e) for e in runner.plan.edges], metadata=meta, type_check=False)


def write_nir(graph: Any, path: str | os.PathLike) -> str:
    """Write ``graph`` to an HDF5 ``.nir`` file atomically (temp file + rename); returns its sha256."""
    nir, _ = nir_modules()
    buf = io.BytesIO()
    nir.write(buf, graph)
    return atomic_write_bytes(path, buf.getvalue())

