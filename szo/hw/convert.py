"""Float szo model -> fixed-point (Loihi-style) network: a backend, not a fork of the models.

:func:`to_fixed` traces the model's ``forward_seq`` with ``torch.fx`` (every supported layer
is a leaf; containers and residual blocks are traced through, so explicit ``+`` becomes an
integer current sum) and returns a :class:`FixedPointNetwork` that

* holds the *same* float parameter tensors as the source model under the same names
  (``named_parameters()`` / ``flat_params()`` layout identical), so ``szo.optim.SZO`` and any
  flat-parameter code work unchanged: the float parameters are the master copy;
* re-quantises them on every forward (``W = Q(theta)``: BN folded with its running
  statistics, 8-bit mantissa with a per-layer exponent, 13-bit bias mantissa with exponent);
* runs the forward on int64 tensors holding values of the documented widths in one of two
  arithmetics (``szo.hw.fixed.ARITHMETICS``): ``"szo"`` saturates every narrowing (counted
  per layer) and shifts synaptic sums exactly; ``"loihi"`` is bit-exact with Lava's
  ``PyDenseModelBitAcc`` -> ``PyLifModelBitAcc`` (floor shift by the weight exponent, current
  wrapping modulo 2**24, bias into the voltage; every wrap counted);
* returns float logits ``[T, N, num_classes]`` (readout current / 2**12).

Integer products and sums are exact: convolutions / matmuls run in float32 only when the
bound ``max|w| * max|x| * fan_in <= 2**24`` (every partial sum is an integer below 2**24,
exactly representable), else in float64 (exact to 2**53), else they raise; TF32 and autocast are
off there (``szo.precision.exact_fp32``), whatever the run's precision.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from spikingjelly.activation_based import neuron as sj_neuron
from torch import fx, nn

from szo.hw.arithmetic import arithmetic_model
from szo.hw.fixed import (
    ACT_SHIFT,
    STATE_SHIFT,
    BitWidths,
    SaturationCounter,
    quantize_bias,
    quantize_weight,
    saturate,
)
from szo.hw.neuron import RESETS, FixedCubaLIF
from szo.models.base import SpikingModel
from szo.precision import exact_fp32

__all__ = ["BACKENDS", "FLOAT32_EXACT", "FLOAT64_EXACT", "FixedPointNetwork", "IntSynapse", "SUPPORTED_LAYERS",
           "UnsupportedLayerError", "backend", "pool_window", "to_fixed"]

BACKENDS: tuple[str, ...] = ("float", "fixed")
FLOAT32_EXACT: int = 1 << 24  # every integer of magnitude <= 2**24 is exact in float32
FLOAT64_EXACT: int = 1 << 53

SUPPORTED_LAYERS: tuple[type, ...] = (
    nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.MaxPool2d,
    nn.Flatten, nn.Identity, nn.Dropout, sj_neuron.LIFNode,
)
_SUPPORTED_NAMES = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in SUPPORTED_LAYERS)


class UnsupportedLayerError(ValueError):
    """A layer or operation the converter cannot map to the fixed-point backend."""


def _unsupported(path: str, what: str, why: str = "") -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"cannot convert layer {path!r} ({what}) to fixed point{': ' + why if why else ''}; "
        f"supported layer types: {_SUPPORTED_NAMES}; supported functions: residual '+' of currents/spikes"
    )


def kernel_dtype(bound: int) -> torch.dtype:
    """float32 when every partial sum is exact in float32, else float64; raise beyond 2**53."""
    if bound <= FLOAT32_EXACT:
        return torch.float32
    if bound <= FLOAT64_EXACT:
        return torch.float64
    raise OverflowError(f"integer kernel bound {bound} exceeds 2**53; no exact float kernel")


class _Tracer(fx.Tracer):
    """Leaves: supported layers and any module without children; containers are traced through."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, nn.Sequential):
            return False
        return isinstance(m, SUPPORTED_LAYERS) or next(m.children(), None) is None


@dataclass
class IntSynapse:
    """One synapse's stored integers (a *real-quantized* graph, seed 004 Sec. 2.1): the weight
    mantissas ``w_int`` (signed ``weight_bits``; BN and the pooling factor folded in) with the
    layer's exponent ``exp`` (``W = w_int 2**exp``), and the bias mantissas ``bias_mant`` (signed
    ``bias_mant_bits``, None without a bias) with ``bias_exp`` (bias = ``bias_mant << bias_exp``
    state units)."""

    w_int: torch.Tensor
    exp: int
    bias_mant: torch.Tensor | None
    bias_exp: int

    @property
    def bias_int(self) -> torch.Tensor | None:
        return None if self.bias_mant is None else self.bias_mant << self.bias_exp


AccHook = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``hook(x_int, acc, shift) -> acc``: sees a synapse's integer input ``[T*N, ...]``, its integer
accumulator ``acc = W_int x_int`` before the shift into state units and that shift (one unit of
``acc`` is ``2**shift`` state units), returns the accumulator the layer goes on with (node
perturbation adds ``mu xi`` here)."""


@dataclass
class _Val:
    """An integer activation flowing between layers."""

    data: torch.Tensor  # int64 [T, N, ...]
    kind: str  # "act": spikes / graded / pooled sums (frac fractional bits); "current": state units
    frac: int = 0
    mult: float = 1.0  # pending factor (1/k^2 from sum pooling), folded into the next synapse
    binary: bool = False  # 0/1 spikes
    counts: bool = False  # sums of spikes (events per element = the value)
    bias: torch.Tensor | None = None  # "loihi": bias of a current, added to the voltage of the neuron it feeds

    def events(self) -> torch.Tensor:
        """Per-element number of input events (spikes) this tensor stands for."""
        return self.data.abs() if self.counts else (self.data != 0).to(torch.int64)


def _type_name(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _abs_max(x: _Val, flat: torch.Tensor) -> int:
    """``max |x|`` for a kernel bound; 1 for spikes without reading the tensor (no device sync)."""
    if x.binary:
        return 1
    return int(flat.abs().max()) if flat.numel() else 0


def _fold_bn(weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.BatchNorm2d | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """BN(conv(x)) with running statistics -> conv'(x): W' = W g/sqrt(v+eps), b' = (b - m) g/sqrt(v+eps) + beta."""
    w = weight.detach().to(torch.float64)
    b = None if bias is None else bias.detach().to(torch.float64)
    if bn is None:
        return w, b
    inv = 1.0 / torch.sqrt(bn.running_var.to(torch.float64) + bn.eps)
    g = bn.weight.detach().to(torch.float64) if bn.weight is not None else torch.ones_like(inv)
    beta = bn.bias.detach().to(torch.float64) if bn.bias is not None else torch.zeros_like(inv)
    scale = g * inv
    w = w * scale.view(-1, *([1] * (w.dim() - 1)))
    b0 = b if b is not None else torch.zeros_like(scale)
    return w, (b0 - bn.running_mean.to(torch.float64)) * scale + beta


def pool_window(path: str, m: nn.Module, hw: tuple[int, int]) -> tuple[Any, Any, Any]:
    """``(kernel, stride, padding)`` of a pooling layer on an ``hw = (H, W)`` input; an
    ``AdaptiveAvgPool2d`` must divide its input evenly (uniform windows, else UnsupportedLayerError)."""
    if isinstance(m, nn.AdaptiveAvgPool2d):
        H, W = hw
        oh, ow = (m.output_size, m.output_size) if isinstance(m.output_size, int) else m.output_size
        oh, ow = oh or H, ow or W
        if H % oh or W % ow:
            raise _unsupported(path, _type_name(m), f"input {H}x{W} is not a multiple of output {oh}x{ow}")
        return (H // oh, W // ow), (H // oh, W // ow), 0
    return m.kernel_size, m.stride, m.padding


class FixedPointNetwork(SpikingModel):
    """Integer forward of a converted szo model; float master parameters in the source layout.

    The layer graph, the integer neurons (tau, threshold, reset, ``widths``) and the module
    lookup are fixed at conversion; the weights are re-quantised on every forward.
    ``collect_stats=True`` fills ``last_stats`` on every forward (see :func:`to_fixed`).
    """

    def __init__(self, model: SpikingModel, widths: BitWidths | None = None, *,
                 verify_exact: bool = False, collect_stats: bool = False, arithmetic: str = "szo",
                 reset: str | None = None, record: bool = False) -> None:
        if not isinstance(model, SpikingModel):
            raise ValueError(f"to_fixed needs a szo SpikingModel, got {type(model).__name__}")
        model_of = arithmetic_model(arithmetic)  # the implementation, chosen once by its tag (szo.hw.arithmetic)
        if reset is not None and reset not in RESETS:
            raise ValueError(f"unknown reset {reset!r}; valid: None (each LIF's own: v_reset None -> 'subtract', "
                             f"0 -> 'zero') or one of {list(RESETS)}")
        super().__init__(num_classes=model.num_classes, T=model.T, model_name=model.model_name)
        if widths is not None and not isinstance(widths, BitWidths):
            raise ValueError(f"widths must be a szo.hw.fixed.BitWidths, got {type(widths).__name__}")
        self.widths = widths or BitWidths()
        self.verify_exact = bool(verify_exact)
        self.collect_stats = bool(collect_stats)  # per-layer events / synops / spikes in last_stats (costs syncs)
        self.arithmetic = model_of.tag  # 'szo' | 'loihi' (szo.hw.fixed.ARITHMETICS): what reports show
        self.arithmetic_model = model_of  # how the integers are computed: no method compares the tag
        self.reset_override = reset
        self.record = bool(record)  # keep every synaptic current / spike tensor of the last forward in last_record
        self.last_record: dict[str, torch.Tensor] = {}
        self.last_record_lava_rounding: dict[str, torch.Tensor] = {}  # "szo": the same sums floor-shifted as Lava
        self.int_weights: dict[str, IntSynapse] | None = None  # freeze_weights(): the forward uses these integers
        self.acc_hooks: dict[str, AccHook] = {}  # synapse path -> hook on its integer accumulator
        if model._parameters:
            raise _unsupported("<root>", type(model).__name__, "parameters registered directly on the model")
        for name, child in model.named_children():
            self.add_module(name, child)  # same objects: the float params are shared, not copied
        if [n for n, _ in self.named_parameters()] != [n for n, _ in model.named_parameters()]:
            raise ValueError("internal: fixed-point network parameter layout differs from the source model")
        self.counter = SaturationCounter()
        self.graph = self._trace(model)
        self.last_stats: dict[str, dict[str, Any]] = {}
        self.last_readout_sum: torch.Tensor | None = None
        # the dtype of the de-scaled logits: float32 (the float model's), or float64 where a learner
        # needs the loss of these exact integers without float32's machine-dependent rounding (MCUZO)
        self.readout_dtype: torch.dtype = torch.float32

    # ------------------------------------------------------------------ conversion
    def _trace(self, model: SpikingModel) -> fx.Graph:
        if type(model).forward_seq is SpikingModel.forward_seq:
            raise ValueError(f"{type(model).__name__} does not implement forward_seq; cannot convert")
        root = self

        class _Root(nn.Module):
            def forward(self, x_seq):  # noqa: D401
                return model.forward_seq(x_seq)

        wrapper = _Root()
        for name, child in root.named_children():
            wrapper.add_module(name, child)
        try:
            graph = _Tracer().trace(wrapper)
        except Exception as exc:  # fx raises many types; one clear message
            raise UnsupportedLayerError(
                f"cannot trace {type(model).__name__}.forward_seq with torch.fx ({type(exc).__name__}: {exc}); "
                f"the fixed-point converter needs a static layer graph of: {_SUPPORTED_NAMES}"
            ) from exc
        self._mods: dict[str, nn.Module] = dict(self.named_modules())  # path -> module, looked up every forward
        modules = self._mods
        users: dict[fx.Node, list[fx.Node]] = {n: list(n.users) for n in graph.nodes}
        self.fused: dict[str, str] = {}  # synapse path -> BN path folded into it
        self.neurons: dict[str, FixedCubaLIF] = {}  # LIF path -> its integer neuron (tau, threshold, reset fixed)
        # synapse path -> factor folded into its weights (1/k^2 of the sum pools before it); None
        # while unknown (an AdaptiveAvgPool2d window depends on the input size: set by the forward)
        self._synapse_mult: dict[str, float | None] = {}
        scale: dict[fx.Node, float | None] = {}  # pending factor of each node's output
        for node in graph.nodes:
            if node.op == "placeholder":
                scale[node] = 1.0
            elif node.op == "call_module":
                m = modules[node.target]
                path, tname = node.target, _type_name(m)
                if not isinstance(m, SUPPORTED_LAYERS):
                    raise _unsupported(path, tname)
                scale[node] = self._static_scale(path, m, scale.get(node.args[0]))
                if isinstance(m, nn.BatchNorm2d):
                    src = node.args[0]
                    ok = (isinstance(src, fx.Node) and src.op == "call_module"
                          and isinstance(modules[src.target], (nn.Conv2d, nn.Linear)) and len(users[src]) == 1)
                    if not ok:
                        raise _unsupported(path, tname, "BatchNorm must directly follow a Conv2d/Linear to be folded")
                    if not m.track_running_stats or m.running_var is None:
                        raise _unsupported(path, tname, "BatchNorm without running statistics cannot be folded")
                    self.fused[src.target] = path
                if isinstance(m, sj_neuron.LIFNode):
                    if m.decay_input:
                        raise _unsupported(path, tname, "decay_input=True is not a CUBA neuron; use decay_input=False")
                    if m.v_reset not in (None, 0.0):
                        raise _unsupported(path, tname, f"v_reset={m.v_reset}; valid: None (soft) or 0.0 (hard)")
                    reset = self.reset_override or ("subtract" if m.v_reset is None else "zero")
                    try:
                        self.neurons[path] = self.arithmetic_model.neuron(1.0, 1.0 / float(m.tau), float(m.v_threshold), reset,
                                                         self.widths, self.counter, path)
                    except ValueError as exc:
                        raise _unsupported(path, tname, f"{self.arithmetic} arithmetic: {exc}") from None
                if isinstance(m, nn.Flatten) and (m.start_dim, m.end_dim) != (1, -1):
                    raise _unsupported(path, tname, "only Flatten(start_dim=1, end_dim=-1)")
                if isinstance(m, nn.AvgPool2d) and (m.ceil_mode or (m.padding and not m.count_include_pad)
                                                    or m.divisor_override):
                    raise _unsupported(path, tname, "only AvgPool2d without ceil_mode/divisor_override")
                if isinstance(m, nn.MaxPool2d) and (m.ceil_mode or m.return_indices):
                    raise _unsupported(path, tname, "only MaxPool2d without ceil_mode/return_indices")
            elif node.op == "call_function" or node.op == "call_method":
                if not (node.target in (operator.add, torch.add) or node.target == "add"):
                    raise _unsupported(str(node.name), f"{node.op} {getattr(node.target, '__name__', node.target)}")
                scale[node] = 1.0  # a current sum
            elif node.op == "get_attr":
                raise _unsupported(str(node.target), "direct parameter use in forward")
        return graph

    def _static_scale(self, path: str, m: nn.Module, src: float | None) -> float | None:
        """The pending factor of a layer's output given its input's (None: known only at run time)."""
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            known = self._synapse_mult.get(path, src)
            self._synapse_mult[path] = src if known == src else None  # a module called twice: run time decides
            return 1.0  # a current
        if isinstance(m, (sj_neuron.LIFNode, nn.MaxPool2d)):
            return 1.0  # spikes
        if isinstance(m, nn.AvgPool2d):
            kh, kw = (m.kernel_size, m.kernel_size) if isinstance(m.kernel_size, int) else m.kernel_size
            return None if src is None else src / (kh * kw)
        if isinstance(m, nn.AdaptiveAvgPool2d):
            return None  # the window is input size / output size
        return src  # BatchNorm (folded), Flatten, Identity, Dropout

    # --------------------------------------------------------------- quantisation
    @property
    def scales_known(self) -> bool:
        """Every synapse's pooling factor is known (False before the first forward of a network with an
        ``AdaptiveAvgPool2d``): :meth:`quantized_layers` and :meth:`freeze_weights` can run."""
        return all(m is not None for m in self._synapse_mult.values())

    @contextlib.contextmanager
    def readout_precision(self, dtype: torch.dtype) -> Iterator["FixedPointNetwork"]:
        """Logits in ``dtype`` inside the block (float32 or float64; the integers are the same), then the
        previous dtype again."""
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"readout dtype must be torch.float32 or torch.float64, got {dtype}")
        old, self.readout_dtype = self.readout_dtype, dtype
        try:
            yield self
        finally:
            self.readout_dtype = old

    def forward_settings(self) -> dict[str, Any]:
        """The probe path's view of this network (``szo.zo.ProbePath.on``): the integer forward."""
        return {**super().forward_settings(), "backend": "fixed"}

    def freeze_weights(self) -> dict[str, IntSynapse]:
        """Quantise every synapse once (:meth:`quantized_layers`) and run every later forward on
        these stored integers instead of re-quantising the float parameters: the real-quantized
        graph an integer learner trains in place (``net.int_weights``, path -> :class:`IntSynapse`).
        The float parameters are no longer read by the forward."""
        frozen = {}
        for path, q in self.quantized_layers().items():
            b = q["bias_int"]
            mant = None if b is None else b >> q["bias_exp"]  # exact: bias_int = mant << bias_exp
            frozen[path] = IntSynapse(q["w_int"].clone(), q["exp"], mant, q["bias_exp"])
        self.int_weights = frozen
        return frozen

    def _quantize_synapse(self, path: str, m: nn.Module, mult: float
                          ) -> tuple[torch.Tensor, int, int, torch.Tensor | None, int, int]:
        """``W = Q(theta)`` of one synapse: ``(w_int, e, n_w_sat, bias_int, n_b_sat, bias_exp)``.

        BN folded with its running statistics; ``mult`` (pooling's 1/k^2 before this synapse)
        is folded into the float weights before quantising, so it changes ``e`` and ``w_int``.
        After :meth:`freeze_weights`: the stored integers (nothing saturates here).
        """
        if self.int_weights is not None:
            s = self.int_weights[path]
            return s.w_int, s.exp, 0, s.bias_int, 0, s.bias_exp
        P = self.widths
        bn = self._mods[self.fused[path]] if path in self.fused else None
        w, b = _fold_bn(m.weight, m.bias, bn)
        w_int, e, n_w = quantize_weight(w * mult if mult != 1.0 else w, P)
        bias_int, n_b, bias_exp = None, 0, 0
        if b is not None:
            bias_int, bias_exp, n_b = quantize_bias(b * (1 << STATE_SHIFT), P)
        return w_int, e, n_w, bias_int, n_b, bias_exp

    def quantized_layers(self) -> dict[str, dict[str, Any]]:
        """``W = Q(theta)`` of every synapse as the forward uses it: ``w_int``, exponent ``exp``,
        ``bias_int`` (= mantissa ``<< bias_exp``) and the pooling factor ``mult`` folded into the
        weights (no side effects).

        A synapse behind an ``AdaptiveAvgPool2d`` has a factor that depends on the input size:
        it is the one of the last forward (ValueError before the first forward).
        """
        out = {}
        for path, mult in self._synapse_mult.items():
            if mult is None:
                raise ValueError(f"synapse {path!r} follows an input-size dependent pooling (AdaptiveAvgPool2d): "
                                 "its weight scale is known after a forward; run the network once first")
            w_int, e, _, bias_int, _, bias_exp = self._quantize_synapse(path, self._mods[path], mult)
            out[path] = {"w_int": w_int, "exp": e, "bias_int": bias_int, "bias_exp": bias_exp, "mult": mult}
        return out

    # -------------------------------------------------------------------- forward
    def reset_counters(self) -> None:
        self.counter.reset()

    def saturation_counts(self) -> dict[str, dict[str, int]]:
        return self.counter.as_dict()

    def quantize_input(self, x_seq: torch.Tensor) -> torch.Tensor:
        """The graded input spikes the forward sees: ``round(x * 2**ACT_SHIFT)`` (to nearest), saturated to
        ``widths.input_bits`` (counted as ``input``)."""
        q = torch.round(x_seq.to(torch.float64) * (1 << ACT_SHIFT)).to(torch.int64)  # round to nearest
        return saturate(q, self.widths.input_bits, self.counter, "input", "input")

    @torch.no_grad()
    def forward_seq(self, x_seq: torch.Tensor) -> torch.Tensor:
        if not x_seq.is_floating_point():
            raise ValueError(f"input must be a float tensor (it is quantised to {self.widths.input_bits}-bit "
                             f"graded spikes with {ACT_SHIFT} fractional bits), got {x_seq.dtype}")
        env: dict[fx.Node, _Val] = {}
        self.last_stats = {}
        self.last_record = {}
        self.last_record_lava_rounding = {}
        result = None
        for node in self.graph.nodes:
            if node.op == "placeholder":
                env[node] = _Val(self.quantize_input(x_seq), "act", frac=ACT_SHIFT)
            elif node.op == "call_module":
                env[node] = self._call(node.target, self._mods[node.target], env[node.args[0]])
            elif node.op in ("call_function", "call_method"):
                env[node] = self._add(node.name, env[node.args[0]], env[node.args[1]])
            elif node.op == "output":
                result = env[node.args[0]]
        if result is None:
            raise RuntimeError("internal: traced graph has no output node")
        if result.kind == "current":
            if result.bias is not None:  # "loihi": no neuron to take the bias; the host adds it to the readout
                result = _Val(result.data + result.bias, "current")
            acc = saturate(result.data.sum(0), self.widths.readout_bits, self.counter, "readout", "accumulator")
            self.last_readout_sum = acc  # integer readout accumulated over T
            return result.data.to(self.readout_dtype) / (1 << STATE_SHIFT)  # de-scale to float logits
        self.last_readout_sum = None
        return result.data.to(self.readout_dtype) * (2.0 ** -result.frac) * result.mult

    def _call(self, path: str, m: nn.Module, x: _Val) -> _Val:
        if isinstance(m, nn.BatchNorm2d):
            return x  # folded into the preceding synapse (checked at conversion)
        if isinstance(m, (nn.Identity, nn.Dropout)):
            return x
        if isinstance(m, nn.Flatten):
            bias = None if x.bias is None else x.bias.expand(x.data.shape[1:]).flatten(1)
            return _Val(x.data.flatten(2), x.kind, x.frac, x.mult, x.binary, x.counts, bias)
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            if x.kind != "act":
                raise _unsupported(path, _type_name(m), "input is a current (no neuron between two synapses)")
            return self._synapse(path, m, x)
        if isinstance(m, sj_neuron.LIFNode):
            if x.kind != "current":
                raise _unsupported(path, _type_name(m), "a neuron needs a synaptic current input (Conv2d/Linear before it)")
            n = self.neurons[path]
            spikes, _, _ = n.run(x.data, bias=x.bias)  # "loihi": the synapse's bias enters the voltage (Lava)
            if self.record:
                self.last_record[path] = spikes
            if self.collect_stats:
                self.last_stats[path] = {"type": "neuron", "neurons": int(x.data[0, 0].numel()),
                                         "spikes": int(spikes.sum()), "T": int(x.data.shape[0]),
                                         "N": int(x.data.shape[1]), "voltage_decay_int": n.voltage_decay_int,
                                         "threshold_int": n.threshold_int, "reset": n.reset}
            return _Val(spikes, "act", 0, 1.0, binary=True)
        if isinstance(m, (nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.MaxPool2d)):
            return self._pool(path, m, x)
        raise _unsupported(path, _type_name(m))  # unreachable: checked at conversion

    def _pool(self, path: str, m: nn.Module, x: _Val) -> _Val:
        if x.kind != "act":
            raise _unsupported(path, _type_name(m), "pooling of currents; pool spikes instead")
        T, N = x.data.shape[:2]
        flat = x.data.flatten(0, 1)
        k, s, p = pool_window(path, m, tuple(flat.shape[-2:]))
        kh, kw = (k, k) if isinstance(k, int) else k
        if isinstance(m, nn.MaxPool2d):
            if not x.binary:
                raise _unsupported(path, _type_name(m), "max pooling is mapped only for binary spikes (an OR neuron)")
            # max of 0/1 spikes = OR: a sum-pool synapse into a neuron with threshold 0 and full decay
            y = F.max_pool2d(flat.to(torch.float32), k, s, p, dilation=m.dilation).to(torch.int64)
            if self.collect_stats:
                self.last_stats[path] = {"type": "maxpool", "events": int(flat.sum()),
                                         "synops": self._conv_synops(flat, 1, (kh, kw), s, p, 1, 1),
                                         "neurons": int(y[0].numel()), "T": int(T), "N": int(N)}
            return _Val(y.view(T, N, *y.shape[1:]), "act", 0, 1.0, binary=True)
        bound = _abs_max(x, flat) * kh * kw
        dt = kernel_dtype(bound)
        # integer sum pooling (divisor 1): exact in dt by the bound above; 1/(kh*kw) is folded downstream
        y = F.avg_pool2d(flat.to(dt), k, s, p, divisor_override=1).round().to(torch.int64)
        if self.collect_stats:
            self.last_stats[path] = {"type": "sumpool", "kernel": [kh, kw], "bound": bound, "kernel_dtype": str(dt)}
        return _Val(y.view(T, N, *y.shape[1:]), "act", x.frac, x.mult / (kh * kw), binary=False,
                    counts=x.binary or x.counts)

    @staticmethod
    def _conv_synops(ev: torch.Tensor, c_out: int, k: tuple[int, int], stride: Any, padding: Any,
                     dilation: Any, groups: int) -> int:
        """Exact number of (input event, target neuron) pairs of a convolution."""
        TN, C, H, W = ev.shape
        g = ev.view(TN, groups, C // groups, H, W).sum(2).to(torch.float64)
        ones = torch.ones(groups, 1, *k, dtype=torch.float64)
        pairs = F.conv2d(g, ones, None, stride, padding, dilation, groups)
        return int(pairs.sum().round()) * (c_out // groups)

    def _synapse(self, path: str, m: nn.Module, x: _Val) -> _Val:
        P = self.widths
        self._synapse_mult[path] = x.mult  # what quantized_layers() reports
        w_int, e, n_w, bias_int, n_b, _ = self._quantize_synapse(path, m, x.mult)
        self.counter.add(path, "weight", n_w)
        if bias_int is not None:
            self.counter.add(path, "bias", n_b)
        T, N = x.data.shape[:2]
        xin = x.data.flatten(0, 1)
        if isinstance(m, nn.Conv2d):
            fan_in = (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        else:
            fan_in = m.in_features
        bound = int(w_int.abs().max()) * _abs_max(x, xin) * fan_in
        dt = kernel_dtype(bound)
        with exact_fp32(xin.device.type):  # TF32 and autocast off, whatever the run's precision
            if isinstance(m, nn.Conv2d):
                acc = F.conv2d(xin.to(dt), w_int.to(dt), None, m.stride, m.padding, m.dilation, m.groups)
            else:
                acc = F.linear(xin.to(dt), w_int.to(dt))
        acc = acc.round().to(torch.int64)  # integral already: every partial sum is exact (bound above)
        if self.verify_exact:
            ref = self._int64_reference(m, xin, w_int)
            if not torch.equal(acc.cpu(), ref):  # the reference is computed on the CPU
                raise RuntimeError(f"{path}: float kernel result differs from the int64 reference")
        to_state = e - x.frac + STATE_SHIFT  # one unit of acc is 2**to_state state units
        hook = self.acc_hooks.get(path)
        if hook is not None:
            acc = hook(xin, acc, to_state)
        bias = None if bias_int is None else bias_int.view(1, -1, *([1] * (acc.dim() - 2)))
        # into state units as the arithmetic does it ("szo": exact shift, bias added, saturated; "loihi": Lava's
        # Dense floor shift, the bias left for the neuron's voltage)
        cur, syn, bias, lava = self.arithmetic_model.synaptic_current(acc, to_state, bias, P, self.counter, path,
                                                                      self.record)
        if lava is not None:
            self.last_record_lava_rounding[path] = lava.view(T, N, *lava.shape[1:])
        if self.record:
            self.last_record[path] = syn.view(T, N, *syn.shape[1:])  # synaptic current without bias, state units
        if self.collect_stats:
            ev = x.events().flatten(0, 1)
            if isinstance(m, nn.Conv2d):
                synops = self._conv_synops(ev, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups)
            else:
                synops = int(ev.sum()) * m.out_features
            self.last_stats[path] = {
                "type": type(m).__name__.lower(), "bn_folded": self.fused.get(path), "weights": int(w_int.numel()),
                "out_channels": int(w_int.shape[0]), "fan_in": fan_in, "weight_exp": e, "events": int(ev.sum()),
                "synops": synops, "bound": bound, "kernel_dtype": str(dt), "T": int(T), "N": int(N),
                "has_bias": bias_int is not None,
            }
        return _Val(cur.view(T, N, *cur.shape[1:]), "current", bias=bias)

    @staticmethod
    def _int64_reference(m: nn.Module, xin: torch.Tensor, w_int: torch.Tensor) -> torch.Tensor:
        """Pure int64 (CPU) convolution / matmul, for verification."""
        xin, w_int = xin.cpu(), w_int.cpu()
        if isinstance(m, nn.Linear):
            return xin @ w_int.t()
        N, C, H, W = xin.shape
        kh, kw = m.kernel_size
        if m.groups != 1:
            raise ValueError("int64 reference supports groups=1 only")
        cols = F.unfold(xin.to(torch.float64), (kh, kw), m.dilation, m.padding, m.stride)
        cols = cols.round().to(torch.int64)  # unfold only copies values: exact
        out = w_int.view(w_int.shape[0], -1) @ cols  # [N, C_out, L] in int64
        oh = (H + 2 * m.padding[0] - m.dilation[0] * (kh - 1) - 1) // m.stride[0] + 1
        ow = (W + 2 * m.padding[1] - m.dilation[1] * (kw - 1) - 1) // m.stride[1] + 1
        return out.view(N, -1, oh, ow)

    def _add(self, name: str, a: _Val, b: _Val) -> _Val:
        """Residual: integer current sum; spikes enter through a one-to-one synapse of weight 1.0."""
        def as_current(v: _Val, which: str) -> torch.Tensor:
            if v.kind == "current":
                return v.data
            if not v.binary:
                raise _unsupported(name, "add", "only currents or binary spikes can be summed")
            if self.collect_stats:
                n_ev = int(v.data.sum())
                self.last_stats[f"{name}.{which}"] = {"type": "identity", "events": n_ev, "synops": n_ev, "weights": 0}
            return v.data << STATE_SHIFT  # spike (1.0) -> current 1.0 = 2**12 state units
        s = as_current(a, "a") + as_current(b, "b")
        data, bias = self.arithmetic_model.add_currents(s, a.bias, b.bias, self.widths, self.counter, name)
        return _Val(data, "current", bias=bias)


def to_fixed(model: SpikingModel, *, weight_bits: int | None = None, widths: BitWidths | None = None,
             verify_exact: bool = False, collect_stats: bool = False, arithmetic: str = "szo",
             reset: str | None = None, record: bool = False) -> FixedPointNetwork:
    """Convert a szo model to the fixed-point backend (sharing its float parameters).

    ``arithmetic``: ``"szo"`` (default: saturating, exact synaptic shifts) or ``"loihi"``
    (bit-exact with Lava's ``PyDenseModelBitAcc`` / ``PyLifModelBitAcc``: floor shift, wrapping
    current, bias into the voltage); see docs/hardware.md.
    ``reset``: None keeps each LIF's own reset (``v_reset=None`` -> ``"subtract"``, ``0`` ->
    ``"zero"``); ``"zero"`` is what a standard Loihi 2 LIF process does, ``"subtract"`` needs a
    custom neuron program on Loihi.
    ``record``: keep the last forward's synaptic currents (without bias) and spikes per layer in
    ``net.last_record`` (to compare arithmetics).
    ``weight_bits`` (default 8) is a shortcut for ``BitWidths(weight_bits=...)``.
    ``collect_stats``: fill ``net.last_stats`` (per-layer input events, exact synaptic
    operations, spikes, kernel bounds) on every forward, as ``szo hw-report`` does; off by
    default because counting costs an extra convolution per layer and device syncs.
    """
    if widths is None:
        widths = BitWidths(weight_bits=8 if weight_bits is None else weight_bits)
    elif weight_bits is not None and weight_bits != widths.weight_bits:
        raise ValueError(f"weight_bits={weight_bits} conflicts with widths.weight_bits={widths.weight_bits}")
    return FixedPointNetwork(model, widths, verify_exact=verify_exact, collect_stats=collect_stats,
                             arithmetic=arithmetic, reset=reset, record=record)


def backend(model: SpikingModel, kind: str = "fixed", **kw: Any) -> nn.Module:
    """``"float"``: the model itself; ``"fixed"``: :func:`to_fixed` (same interface and parameter layout)."""
    if kind == "float":
        if kw:
            raise ValueError(f"backend 'float' takes no options, got {sorted(kw)}")
        return model
    if kind == "fixed":
        return to_fixed(model, **kw)
    raise ValueError(f"unknown backend {kind!r}; valid: {list(BACKENDS)}")
