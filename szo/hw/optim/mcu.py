"""Seed 004's integer learner (Zhao et al. 2025, "Poor Man's Training on MCUs"): quantized,
layer-wise, adaptive weight / node perturbation on the int8 weights of a real-quantized graph.

:class:`MCUZO` trains the stored integers of a :class:`~szo.hw.convert.FixedPointNetwork`
(``net.freeze_weights()``: every synapse's int8 weight mantissas with its layer exponent, BN and
pooling folded in, the 13-bit bias mantissas), every probe an integer forward. One step
(Algorithm 1, App. A):

1. one clean forward: per-sample losses ``l_n`` and each trained layer's integer input ``a_i``;
2. for each trained layer ``i`` (layer-wise: only that layer is perturbed), a 32-bit seed ``S``
   drawn from the learner's XORShift32, and from it ``Q`` Rademacher vectors (XORShift32, LSB ->
   sign; regenerated from ``S``, never stored):

   * **weight perturbation** (``d_w < d_a``): ``Q`` forwards at ``W_i + mu xi_q`` (``mu = 1`` LSB
     of the int8 mantissa, bias mantissas too), ``g = 1/Q sum_q (l_q - l) / mu xi_q`` with ``l_q``,
     ``l`` the batch means (Algorithm 1 line 15: one direction for the whole batch);
   * **node perturbation** (``d_w >= d_a``): ``Q`` forwards with ``mu xi_{q,n}`` added to the
     layer's integer accumulator ``z_i = W_i a_i`` (``mu = 1`` LSB of it: the smallest change of
     ``z`` the layer's integers can make), per-sample losses ``l_{q,n}``, node estimate
     ``1/(QN) sum (l_{q,n} - l_n)/mu xi_{q,n}`` (lines 23/29), weight estimate eq. 10
     ``g_W = g_z a_i^T`` (the layer's own integer input), bias ``g_z 2**(bias_exp - shift)``;

   ``d_a`` counts one sample's nodes over T (what one loss difference weights), ``d_w`` the
   layer's weights and biases;
3. every trained layer updated at once from the estimates at ``theta_t`` (the *global* update of
   Algorithm 1 line 34) by eq. 8: ``clip(W - round(NQ/(NQ + d - 1) lr/s^2 g), -128, 127)`` with
   ``s`` the value of one integer unit (``2**exp`` for weights, ``2**(bias_exp - 12)`` for bias
   mantissas), ``d = d_w`` (weight perturbation, ``N = 1``: one direction per probe for the
   batch) or ``d_a`` (node perturbation, ``N`` = batch: independent per-sample node directions).

Exact on every machine: the logits are read in float64 (``FixedPointNetwork.readout_precision``: the
readout's integers, de-scaled without rounding), every per-sample loss is turned into fixed point
(``szo.functional.integer.fixed_point_losses``, 24 fractional bits) before it is differenced, and the
sums of both estimates and of eq. 10 are int64, so no CPU's kernels or summation order can change an
integer the learner decides; one float product per element then scales the sum (eq. 8's factor and
``1 / (Q N mu 2**24)``). Only a loss within float64 rounding of a fixed-point tie could still differ.

No momentum, no optimizer state beyond the integers and the 32-bit generator state (Sec. 3:
vanilla ZO-SGD). ``layers`` restricts training to a subset (the paper's sparse training of one
block): :func:`split_blocks` cuts the layers into the paper's four blocks, :func:`select_block`
picks one by a short BP-free test training per block (Sec. 3.3.1).

The float parameters follow the integers after every step (dequantised, BN un-folded), so
``model.safetensors`` and the float backend see the learned model.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from szo.evaluators import build_evaluator
from szo.functional.integer import LOSS_FRAC, fixed_point_losses
from szo.functional.xorshift import XorShift32
from szo.functional.zo import integer_node_sums, integer_weight_sums
from szo.hw.convert import FixedPointNetwork, IntSynapse
from szo.hw.fixed import STATE_SHIFT, SaturationCounter, int_range, saturate
from szo.methods import get_method, register_builder
from szo.zo import (
    CleanForward,
    Field,
    LayerwiseBase,
    Plan,
    ProbePath,
    StateCodec,
    adaptive_perturbation,
    check_hparams,
    one_point_plan,
    quantized_zo_update,
    refuse_frozen,
    refuse_shared_weights,
    trainable_layers,
)

__all__ = ["MCUZO", "MCU_PERTURBATIONS", "LayerPlan", "select_block", "split_blocks"]

MCU_PERTURBATIONS: tuple[str, ...] = ("adaptive", "weight", "node")


@dataclass(frozen=True)
class LayerPlan:
    """How one trained layer is estimated: ``mode`` ("weight" | "node"), ``d_w`` (weights + biases),
    ``d_a`` (one sample's nodes over T)."""

    mode: str
    d_w: int
    d_a: int


class IntWeightSpace:
    """One synapse's integer weights and bias mantissas as one vector of ``d_w`` integers: a probe
    sets ``sat(w0 + sign mu xi)`` (the perturbed int8 value stays int8: a clamp is counted)."""

    def __init__(self, syn: IntSynapse, weight_bits: int, bias_bits: int, counter: SaturationCounter, path: str):
        self.syn, self.weight_bits, self.bias_bits = syn, weight_bits, bias_bits
        self.counter, self.path = counter, path
        self.n_w = syn.w_int.numel()
        self.d = self.n_w + (0 if syn.bias_mant is None else syn.bias_mant.numel())

    def flat(self) -> torch.Tensor:
        parts = [self.syn.w_int.reshape(-1)] + ([] if self.syn.bias_mant is None else [self.syn.bias_mant])
        return torch.cat(parts)

    def load(self, v: torch.Tensor, quantity: str) -> None:
        s = self.syn
        s.w_int = saturate(v[:self.n_w].view_as(s.w_int), self.weight_bits, self.counter, self.path, quantity)
        if s.bias_mant is not None:
            s.bias_mant = saturate(v[self.n_w:], self.bias_bits, self.counter, self.path, f"bias {quantity}")

    def mover(self, plan: Plan) -> "_IntWeightMover":
        return _IntWeightMover(self, plan)


class _IntWeightMover:
    def __init__(self, space: IntWeightSpace, plan: Plan):
        self.space, self.plan = space, plan
        self.saved = (space.syn.w_int, space.syn.bias_mant)
        self.base = space.flat()

    def move(self, j: int) -> None:
        i = self.plan.index[j]
        if i < 0:
            self.restore()
            return
        step = int(self.plan.sign[j]) * int(self.plan.mu)
        d = self.plan.directions[i].to(device=self.base.device, dtype=torch.int64)  # the signs live on the CPU
        self.space.load(self.base + step * d, "probe")  # +-1: exact

    def restore(self) -> None:
        self.space.syn.w_int, self.space.syn.bias_mant = self.saved


class AccNodeSpace:
    """One synapse's integer accumulator ``z = W_int a`` (shape ``[T*N, ...]``): a probe adds
    ``sign mu xi`` through the network's accumulator hook, removed by ``restore``."""

    def __init__(self, net: FixedPointNetwork, path: str):
        self.net, self.path = net, path

    def mover(self, plan: Plan) -> "_AccNodeMover":
        return _AccNodeMover(self, plan)


class _AccNodeMover:
    def __init__(self, space: AccNodeSpace, plan: Plan):
        self.space, self.plan = space, plan

    def move(self, j: int) -> None:
        self.restore()
        i = self.plan.index[j]
        if i < 0:
            return
        add = int(self.plan.sign[j]) * int(self.plan.mu) * self.plan.directions[i].to(torch.int64)  # +-1: exact
        # the signs are drawn on the CPU; the accumulator lives with the network (one copy per probe)
        self.space.net.acc_hooks[self.space.path] = lambda x, acc, shift: acc + add.to(acc.device).view(acc.shape)

    def restore(self) -> None:
        self.space.net.acc_hooks.pop(self.space.path, None)


def _check_state(opt: "MCUZO", section: dict) -> None:
    # the integer graph and the trained integers, checked before anything is loaded (their setters put them)
    if section.get("synapses") is not None:
        opt._checked_graph(section["synapses"])
    if section.get("integers") is not None:
        opt._checked_integers(section["integers"])
    paths = section.get("paths")
    if paths is not None and (not isinstance(paths, (list, tuple)) or list(paths) != list(opt.layers)):
        got = list(paths) if isinstance(paths, (list, tuple)) else type(paths).__name__
        raise ValueError(f"optimizer state trains layers {got}, this optimizer trains {list(opt.layers)}")
    plans = section.get("plans")
    if plans is not None and (not isinstance(plans, dict) or not set(plans) <= set(opt.layers) or any(
            not isinstance(v, (list, tuple)) or len(v) != 3 or v[0] not in ("weight", "node") for v in plans.values())):
        raise ValueError(f"optimizer state: plans must map trained layers ({', '.join(opt.layers)}) to "
                         "[mode ('weight' | 'node'), d_w, d_a]")


def _checked_mantissas(t: Any, layer: str, what: str, shape: tuple[int, ...], bits: int) -> torch.Tensor:
    """A checkpoint's mantissas as an int64 copy, or one ValueError: an integer tensor of ``shape``
    whose values fit the signed ``bits`` (a checkpoint is data: its mantissas are not trusted)."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"optimizer state: layer {layer!r} {what} are {got}, not integer mantissas")
    if tuple(t.shape) != shape:
        raise ValueError(f"optimizer state: layer {layer!r} {what} have shape {tuple(t.shape)}, the layer's "
                         f"are {shape}")
    lo, hi = int_range(bits)
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        bad = int(t.max()) if int(t.max()) > hi else int(t.min())
        raise ValueError(f"optimizer state: layer {layer!r} {what} hold {bad}, outside the signed {bits}-bit "
                         f"range [{lo}, {hi}] of its mantissas; the checkpoint was not written by this "
                         "learner (or was altered)")
    return t.clone()


class MCUZO(LayerwiseBase):
    """Seed 004's quantized layer-wise adaptive WP/NP learner on a fixed-point network (module docstring).

    ``net``: a :class:`FixedPointNetwork` (its weights are frozen to integers at the first step,
    or now with ``net.freeze_weights()``); ``layers``: synapse paths to train (None: all);
    ``perturbation``: ``"adaptive"`` (the paper's), ``"weight"`` or ``"node"`` everywhere;
    ``q``: probes per layer (the paper's Q); ``mu_w`` / ``mu_node``: perturbation in LSBs (the
    paper's 1); ``lr``: eq. 8's global rate (read from ``param_groups[0]`` each step, so a host
    schedule applies); ``seed``: the XORShift32 seed (nonzero 32-bit).
    """

    loss_reduction = "none"  # per-sample losses l_n (Algorithm 1)
    # The integer graph is the learner's point: "synapses" (every synapse's exponents, the mantissas of
    # those it does not train) and "integers" (the trained mantissas) put it back without quantising
    # the float parameters again, and "plans" the modes it chose, so a resumed run decides and counts
    # as the uninterrupted one (checkpoints written before them have neither: the graph is frozen
    # from the float parameters and the modes re-decided at the first step)
    codecs = (StateCodec("mcu", (Field("paths", "plain", "layer_paths", record_only=True),
                                 Field("synapses", "plain", "synapse_state", optional=True),
                                 Field("integers", "tensors", "integer_state", optional=True),
                                 Field("rng_state", "xorshift", "rng"),
                                 Field("modes", "plain", "mode_names", record_only=True),
                                 Field("plans", "plain", "plan_state"),
                                 Field("forward_passes", "int", default=0), Field("step_count", "int", default=0),
                                 Field("saturations", "counter", "counter")),
                         check=_check_state),)
    fixed_space = "the integers of the layers it was built with (layers=)"

    def __init__(self, net: FixedPointNetwork, *, layers: Sequence[str] | None = None, perturbation: str = "adaptive",
                 q: int = 10, lr: float = 1e-3, mu_w: int = 1, mu_node: int = 1, seed: int = 1) -> None:
        if not isinstance(net, FixedPointNetwork):
            raise ValueError(f"MCUZO trains a fixed-point network (szo.hw.to_fixed(model)), got {type(net).__name__}; "
                             "set backend: fixed")
        if perturbation not in MCU_PERTURBATIONS:
            raise ValueError(f"unknown perturbation {perturbation!r}; valid: {', '.join(MCU_PERTURBATIONS)}")
        check_hparams(lr=lr, momentum=0.0, q=q)
        for name, v in (("mu_w", mu_w), ("mu_node", mu_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int (LSBs; the paper's is 1), got {v!r}")
        self.layers = trainable_layers(net, layers)  # the synapses (model order), or the named subset
        refuse_shared_weights(self.layers, "MCUZO")
        # a layer's integers stand for its weight and bias, or the folded BatchNorm's shift (write_back)
        moved = [p for n, m in self.layers.items() for p in m.parameters(recurse=False)] + [
            net.get_submodule(net.fused[n]).bias for n, m in self.layers.items()
            if m.bias is None and n in net.fused and net.get_submodule(net.fused[n]).bias is not None]
        refuse_frozen(moved, net, "MCUZO", "trains the integers of every layer it is given (weights, biases, a "
                      "folded BatchNorm's shift)", "unfreeze them, or name the layers to train in layers=")
        super().__init__([p for m in self.layers.values() for p in m.parameters(recurse=False)], dict(lr=float(lr)))
        self.net = net
        self.perturbation, self.q, self.mu_w, self.mu_node = perturbation, q, mu_w, mu_node
        self.rng = XorShift32(seed)
        self.step_count = 0
        self.counter = SaturationCounter()
        self.plans: dict[str, LayerPlan] = {}
        self._pending: list[torch.Tensor] | None = None  # integers of a loaded checkpoint, set at the freeze
        self._pending_graph: dict[str, dict] | None = None  # a loaded checkpoint's exponents / untrained mantissas
        self._floats_stale = False  # the float twin waits for the pooling factors (known after a forward)
        self._init_forward_only(build_evaluator(ProbePath(freeze_bn=False, method=get_method("mcu-zo")), net, "MCUZO"))

    # ------------------------------------------------------------------ state
    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def layer_paths(self) -> list[str]:
        return list(self.layers)

    @property
    def mode_names(self) -> dict[str, str]:
        return {n: p.mode for n, p in self.plans.items()}

    def result_fields(self) -> dict:
        """Seed 004's learner: its layers' modes and every clamped int8 weight / probe
        (``szo.zo.ReportsResults``)."""
        return {"mcu": {"modes": self.mode_names, "saturations": self.counter.as_dict()}}

    @property
    def plan_state(self) -> dict[str, list]:
        """Each trained layer's plan as chosen at the first step: ``{layer: [mode, d_w, d_a]}``."""
        return {n: [p.mode, p.d_w, p.d_a] for n, p in self.plans.items()}

    @plan_state.setter
    def plan_state(self, value: dict[str, list]) -> None:
        self.plans = {n: LayerPlan(str(v[0]), int(v[1]), int(v[2])) for n, v in value.items()}

    @property
    def synapse_state(self) -> dict[str, dict] | None:
        """The frozen integer graph beyond the trained mantissas: every synapse's weight and bias
        exponents, and the mantissas of the synapses this learner does not train (None before the
        weights are frozen)."""
        if self.net.int_weights is None:
            return self._pending_graph
        out = {}
        for path, syn in self.net.int_weights.items():
            out[path] = {"exp": int(syn.exp), "bias_exp": int(syn.bias_exp)}
            if path not in self.layers:
                out[path].update(w_int=syn.w_int, bias_mant=syn.bias_mant)
        return out

    @synapse_state.setter
    def synapse_state(self, value: dict[str, dict] | None) -> None:
        if value is None:
            return
        graph = self._checked_graph(value)
        if self.net.int_weights is None:
            self._pending_graph = graph
            return
        for path, g in graph.items():
            syn = self.net.int_weights[path]
            syn.exp, syn.bias_exp = g["exp"], g["bias_exp"]
            if "w_int" in g:
                syn.w_int, syn.bias_mant = g["w_int"], g["bias_mant"]

    def _checked_graph(self, value: Any) -> dict[str, dict]:
        """A checkpoint's synapse section checked against this network (one ValueError otherwise)."""
        synapses = trainable_layers(self.net)
        if not isinstance(value, dict) or set(value) != set(synapses):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"optimizer state: the synapses are {got}, this network's are {sorted(synapses)}")
        P, out = self.net.widths, {}
        for path, m in synapses.items():
            g = value[path]
            if not isinstance(g, dict) or not all(isinstance(g.get(k), int) for k in ("exp", "bias_exp")):
                raise ValueError(f"optimizer state: synapse {path!r} needs integer exponents exp and bias_exp")
            out[path] = {"exp": g["exp"], "bias_exp": g["bias_exp"]}
            if path in self.layers:
                continue
            has_bias = m.bias is not None or path in self.net.fused
            if (g.get("bias_mant") is None) == has_bias:
                raise ValueError(f"optimizer state: synapse {path!r} {'lacks' if has_bias else 'has'} bias mantissas")
            out[path]["w_int"] = _checked_mantissas(g.get("w_int"), path, "weights", tuple(m.weight.shape),
                                                    P.weight_bits).to(m.weight.device)
            out[path]["bias_mant"] = None if not has_bias else _checked_mantissas(
                g["bias_mant"], path, "bias", (int(m.weight.shape[0]),), P.bias_mant_bits).to(m.weight.device)
        return out

    @property
    def integer_state(self) -> list[torch.Tensor] | None:
        """The trained layers' integers (weight mantissas, then bias mantissas, per layer)."""
        if self.net.int_weights is None:
            return self._pending
        out = []
        for n in self.layers:
            s = self.net.int_weights[n]
            out += [s.w_int] + ([] if s.bias_mant is None else [s.bias_mant])
        return out

    @integer_state.setter
    def integer_state(self, value: list[torch.Tensor] | None) -> None:
        if value is None:
            return
        value = self._checked_integers(value)  # all of it, before anything is replaced
        if self.net.int_weights is None:
            self._pending = value
            return
        it = iter(value)
        for n in self.layers:
            s = self.net.int_weights[n]
            s.w_int = next(it)
            if s.bias_mant is not None:
                s.bias_mant = next(it)
        self.write_back()

    def integer_layout(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """What :attr:`integer_state` holds, in order: ``(layer, "weights" | "bias", shape, bits)``
        per tensor -- each layer's weight mantissas (its weight's shape, ``weight_bits`` signed),
        then its bias mantissas when the synapse has a bias (its own or a folded BatchNorm's;
        ``bias_mant_bits`` signed). Known from the modules before the weights are frozen."""
        P, out = self.net.widths, []
        for n, m in self.layers.items():
            out.append((n, "weights", tuple(m.weight.shape), P.weight_bits))
            if m.bias is not None or n in self.net.fused:
                out.append((n, "bias", (int(m.weight.shape[0]),), P.bias_mant_bits))
        return out

    def _checked_integers(self, value: Any) -> list[torch.Tensor]:
        """A checkpoint's integers as int64 copies, or one ValueError: the tensors this learner's
        layers hold (:meth:`integer_layout`), each an integer tensor of its shape whose values
        fit its signed width (a checkpoint is data: its mantissas are not trusted to be int8)."""
        layout = self.integer_layout()
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
            raise ValueError(f"optimizer state: the integers must be a list of tensors, got {type(value).__name__}")
        if len(value) != len(layout):
            want = ", ".join(f"{n} {what}" for n, what, _, _ in layout)
            raise ValueError(f"optimizer state holds {len(value)} integer tensors where this learner's layers need "
                             f"{len(layout)} ({want}); the checkpoint was not written by this model's learner "
                             "(or was altered)")
        return [_checked_mantissas(t, n, what, shape, bits) for t, (n, what, shape, bits) in zip(value, layout)]

    @property
    def forwards_per_step(self) -> int:
        return 1 + self.q * len(self.layers)

    # ------------------------------------------------------------------ the step
    def _finish_load(self, prepared: Any) -> None:
        """After the state: a checkpoint that carries its integer graph is put in place now (the float
        parameters follow it as soon as the pooling factors are known)."""
        if self.net.int_weights is None and self._pending_graph is not None:
            self._freeze()

    def _freeze(self) -> bool:
        """Freeze the network's weights -- a loaded checkpoint's integer graph as it stood, else the
        float parameters quantised; then a loaded checkpoint's integers replace them (True if so)."""
        graph, self._pending_graph = self._pending_graph, None
        if self.net.int_weights is None and graph is None:
            self.net.freeze_weights()
        elif self.net.int_weights is None:  # the trained mantissas come from the checkpoint's integers
            layout = {(n, what): shape for n, what, shape, _ in self.integer_layout()}
            self.net.int_weights = {
                path: IntSynapse(
                    g["w_int"] if "w_int" in g else torch.zeros(layout[path, "weights"], dtype=torch.int64,
                                                                 device=m.weight.device),
                    g["exp"],
                    g["bias_mant"] if "w_int" in g else None if (path, "bias") not in layout else torch.zeros(
                        layout[path, "bias"], dtype=torch.int64, device=m.weight.device),
                    g["bias_exp"])
                for path, m in trainable_layers(self.net).items() for g in (graph[path],)}
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        self.integer_state = pending
        return True

    def _clean(self, closure: Callable[[], torch.Tensor], inputs: dict, record: Callable) -> torch.Tensor:
        """The clean forward's per-sample losses ``[N]``, recording each trained layer's integer input."""
        net = self.net
        net.acc_hooks.update({n: record(n) for n in self.layers})
        try:
            return self.evaluator.centre(closure, per_sample=True)
        finally:
            for n in self.layers:
                net.acc_hooks.pop(n, None)

    def _layer_plan(self, name: str, syn: IntSynapse, acc_shape: torch.Size, batch: int) -> LayerPlan:
        d_w = syn.w_int.numel() + (0 if syn.bias_mant is None else syn.bias_mant.numel())
        d_a = acc_shape.numel() // batch  # [T*N, ...]: one sample's nodes over T
        if self.perturbation == "adaptive":
            mode = adaptive_perturbation(d_w, d_a)  # Sec. 3.2.2
        else:
            mode = self.perturbation
        return LayerPlan(mode, d_w, d_a)

    def _rademacher(self, q: int, n: int) -> torch.Tensor:
        """``[q, n]`` Rademacher signs (float64, exact) from one 32-bit seed drawn from the learner's generator."""
        return XorShift32(self.rng.next()).rademacher(q * n).view(q, n).to(torch.float64)

    # ------------------------------------------------------------------ the step's parts (LayerwiseBase.step)
    def _step_scope(self):
        """The logits in float64 for the step's forwards: losses of the exact integers, not float32's."""
        return self.net.readout_precision(torch.float64)

    def _clean_forward(self, closure: Callable[[], torch.Tensor]):
        """The clean forward's per-sample losses, recording each trained layer's integer input (node
        layers: eq. 10 needs it) and accumulator shape; the weights frozen to integers first."""
        net = self.net
        inputs: dict[str, tuple[torch.Tensor | None, torch.Size, int]] = {}  # input kept for node layers only

        def record(name: str):
            keep = name not in self.plans or self.plans[name].mode == "node"  # eq. 10 needs the input

            def hook(x: torch.Tensor, acc: torch.Tensor, shift: int) -> torch.Tensor:
                inputs[name] = (x if keep else None, acc.shape, shift)
                return acc
            return hook

        extra = 0
        if net.int_weights is None and net.scales_known:
            self._freeze()  # before the clean forward: a resumed run's integers are in it
        clean = self._clean(closure, inputs, record)
        if self._floats_stale:  # a loaded graph's float twin: the pooling factors are known now
            self.write_back()
        # pooling factors known only now: the same integers as that forward, unless a checkpoint's
        # were waiting (then measure again, one more forward)
        if net.int_weights is None and self._freeze():
            clean, extra = self._clean(closure, inputs, record), 1
        return CleanForward(fixed_point_losses(clean), float(clean.mean()), extra, inputs)

    def _probe_layer(self, closure: Callable[[], torch.Tensor], name: str, m: nn.Module, clean: CleanForward):
        """One layer's q probes: 1-LSB weight probes of its integers, or Rademacher probes of its
        accumulator nodes then eq. 10 with the integer input; the gradient per LSB of (weights, biases)."""
        net, ev = self.net, self.evaluator
        batch = int(clean.losses.numel())
        syn = net.int_weights[name]
        x, acc_shape, shift = clean.layers[name]
        if name not in self.plans:
            self.plans[name] = self._layer_plan(name, syn, acc_shape, batch)
        if self.plans[name].mode == "weight":
            space = IntWeightSpace(syn, net.widths.weight_bits, net.widths.bias_mant_bits, self.counter, name)
            plan = one_point_plan(self._rademacher(self.q, space.d), self.mu_w, centre=False)
            per = ev.run(closure, space, plan, label=f"layer {name}, weight probe", per_sample=True)
            sums = integer_weight_sums(plan.directions.to(torch.int64), fixed_point_losses(per), clean.losses)
            g = (sums.to(torch.float64) * self._scale(batch, self.mu_w)).to(syn.w_int.device)  # per LSB
            return (g[:space.n_w].view_as(syn.w_int), None if syn.bias_mant is None else g[space.n_w:]), per.mean(1)
        T = acc_shape[0] // batch
        shape = torch.Size([T, batch, *acc_shape[1:]])
        plan = one_point_plan(self._rademacher(self.q, shape.numel()), self.mu_node, centre=False)
        per = ev.run(closure, AccNodeSpace(net, name), plan, label=f"layer {name}, node probe", per_sample=True)
        sums = integer_node_sums(plan.directions.to(torch.int64), fixed_point_losses(per), clean.losses, shape)
        sums = sums.reshape(acc_shape)  # int64 on the CPU
        scale = self._scale(batch, self.mu_node)
        gw = (_weight_vjp(m, x, sums, syn.w_int.shape).to(torch.float64) * scale).to(x.device)  # eq. 10, in integers
        gb = None
        if syn.bias_mant is not None:
            dims = [0] + list(range(2, sums.dim()))
            gb = (sums.sum(dims).to(torch.float64) * (scale * 2.0 ** (syn.bias_exp - shift))).to(x.device)
        return (gw, gb), per.mean(1)

    def _scale(self, batch: int, mu: int) -> float:
        """What turns an integer sum of the estimates into the gradient per LSB: ``1 / (Q N mu 2**frac)``
        (one Python float, the same on every machine)."""
        return 1.0 / (self.q * batch * mu * float(1 << LOSS_FRAC))

    def _update(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor | None]], clean: CleanForward) -> None:
        """The global update (eq. 8) of every layer's integers, then the float twin."""
        batch = int(clean.losses.numel())
        for name, (gw, gb) in grads.items():
            self._update_layer(name, self.net.int_weights[name], self.plans[name], gw, gb, batch)
        self.step_count += 1
        self.write_back()

    def _update_layer(self, name: str, syn: IntSynapse, lp: LayerPlan, gw: torch.Tensor, gb: torch.Tensor | None,
                batch: int) -> None:
        n, d = (1, lp.d_w) if lp.mode == "weight" else (batch, lp.d_a)
        P = self.net.widths
        syn.w_int = quantized_zo_update(syn.w_int, gw, lr=self.lr, scale=2.0 ** syn.exp, n=n, q=self.q, d=d,
                                        bits=P.weight_bits, counter=self.counter, layer=name, quantity="weight")
        if gb is not None:
            syn.bias_mant = quantized_zo_update(syn.bias_mant, gb, lr=self.lr, scale=2.0 ** (syn.bias_exp - STATE_SHIFT),
                                                n=n, q=self.q, d=d, bits=P.bias_mant_bits, counter=self.counter,
                                                layer=name, quantity="bias")

    # ------------------------------------------------------------------ the float twin
    @torch.no_grad()
    def write_back(self) -> None:
        """Float parameters := the integers, dequantised with BN and the pooling factor un-folded
        (``W = w_int 2**exp / (mult g/sqrt(v+eps))``; the bias goes to the synapse's bias, or to the
        folded BN's ``beta`` when the synapse has none)."""
        if self.net.int_weights is None:
            return
        self._floats_stale = not self.net.scales_known
        if self._floats_stale:  # a synapse behind an AdaptiveAvgPool2d: after the next forward
            return
        mults = {p: q["mult"] for p, q in self.net.quantized_layers().items()}
        for name, m in self.layers.items():
            syn = self.net.int_weights[name]
            bn_path = self.net.fused.get(name)
            bn = self.net.get_submodule(bn_path) if bn_path else None
            scale = torch.ones(syn.w_int.shape[0], dtype=torch.float64, device=syn.w_int.device)
            if bn is not None:
                g = bn.weight.to(torch.float64) if bn.weight is not None else torch.ones_like(scale)
                scale = g / torch.sqrt(bn.running_var.to(torch.float64) + bn.eps)
            w = syn.w_int.to(torch.float64) * 2.0 ** syn.exp / mults[name]
            m.weight.copy_((w / scale.view(-1, *([1] * (w.dim() - 1)))).to(m.weight.dtype))
            if syn.bias_mant is None:
                continue
            b_folded = syn.bias_int.to(torch.float64) / (1 << STATE_SHIFT)
            if bn is None:
                m.bias.copy_(b_folded.to(m.bias.dtype))
            elif m.bias is not None:
                m.bias.copy_(((b_folded - bn.bias.to(torch.float64)) / scale + bn.running_mean.to(torch.float64))
                             .to(m.bias.dtype))
            else:
                bn.bias.copy_((b_folded + bn.running_mean.to(torch.float64) * scale).to(bn.bias.dtype))

    # ------------------------------------------------------------------ memory
    def memory_bytes(self, batch: int, q: int | None = None) -> dict[str, int]:
        """What the learner adds to inference on a chip, in bytes (Table 3's efficient rows): the
        trained int8 weights and 16-bit bias mantissas, one layer's int32 gradient buffer (the
        largest trained), the loss buffer of the layer being estimated (``Q`` float32 for weight
        perturbation, ``N Q`` for node perturbation, plus the clean ``N``), the 32-bit seed.
        ``q``: another probe count than the learner's (the buffers grow with it)."""
        if not self.plans:
            raise ValueError("memory_bytes is known after the first step (the layers' modes and node counts)")
        iw = self.net.int_weights
        weights = sum(iw[n].w_int.numel() + 2 * (0 if iw[n].bias_mant is None else iw[n].bias_mant.numel())
                      for n in self.layers)
        grad = max(p.d_w for p in self.plans.values()) * 4
        q = self.q if q is None else q
        losses = max((q if p.mode == "weight" else batch * q) for p in self.plans.values()) * 4 + batch * 4
        return {"trained_weights": weights, "gradient_buffer": grad, "loss_buffer": losses, "seed": 4}


def _weight_vjp(m: nn.Module, x: torch.Tensor, g_acc: torch.Tensor, w_shape: torch.Size) -> torch.Tensor:
    """Eq. 10 for the integer layer: ``sum g_z a^T`` at the recorded integer input ``a``, both int64 (a
    convolution's weight gradient through ``unfold``); int64 on the CPU, exact in any summation order."""
    xi = x.detach().cpu()
    g = g_acc.detach().cpu().to(torch.int64)
    if xi.is_floating_point():
        if not bool((xi == torch.round(xi)).all()):
            raise ValueError("eq. 10 needs the layer's integer input; got non-integer values")
        xi = xi.to(torch.int64)
    if isinstance(m, nn.Linear):
        return g.t() @ xi
    if m.groups != 1:
        raise ValueError(f"the integer learner's node perturbation supports convolutions with groups=1, got {m.groups}")
    # im2col of small integers in float64 is exact (a copy, no arithmetic); the products and sums in int64
    cols = F.unfold(xi.to(torch.float64), tuple(w_shape[2:]), dilation=m.dilation, padding=m.padding,
                    stride=m.stride).to(torch.int64)  # [B, C_in kh kw, L]
    gz = g.reshape(g.shape[0], g.shape[1], -1)  # [B, C_out, L]
    return torch.einsum("bol,bkl->ok", gz, cols).reshape(w_shape)


# ---------------------------------------------------------------------- sparse training (Sec. 3.3)
def split_blocks(layers: Sequence[str], n_blocks: int = 4) -> list[list[str]]:
    """The layers cut into ``n_blocks`` contiguous, non-overlapping blocks in model order (the
    paper's four; fewer when there are fewer layers), sizes as even as possible, earlier blocks larger."""
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"n_blocks must be a positive int, got {n_blocks!r}")
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to split")
    n = min(n_blocks, len(layers))
    size, extra = divmod(len(layers), n)
    out, i = [], 0
    for b in range(n):
        j = i + size + (1 if b < extra else 0)
        out.append(layers[i:j])
        i = j
    return out


def select_block(net: FixedPointNetwork, blocks: Sequence[Sequence[str]], batches: Collection,
                 heldout: Callable[[], float], loss_fn: Callable[..., torch.Tensor],
                 make: Callable[[list[str]], MCUZO]) -> dict[str, Any]:
    """Sec. 3.3.1: from the same integers, a BP-free test training of each block on ``batches``
    (``(x, y)`` pairs, e.g. one epoch), its gain of ``heldout()`` accuracy; the integers are put
    back after each. Returns ``{"block": index of the best, "gains": [...], "forwards": total}``.

    Each block iterates ``batches`` once: a list, or an iterable that yields the same batches every
    time it is iterated and knows its length, so they need not be held in memory
    (``szo.prepare.block_selection_stage`` streams them); a one-shot iterator is read into a list first.
    ``make(layers)`` builds the learner of one block (the same settings for every block);
    ``loss_fn(out, y, reduction="none")`` gives the per-sample losses.
    """
    if iter(batches) is batches:  # an iterator: a second block would see nothing
        batches = list(batches)
    if not blocks or not len(batches):
        raise ValueError("select_block needs at least one block and one batch")
    if net.int_weights is None:
        raise ValueError("freeze the network's weights first (net.freeze_weights()): every block starts from them")
    start = copy.deepcopy(net.int_weights)
    base = heldout()
    gains, forwards = [], 0
    for block in blocks:
        opt = make(list(block))
        for x, y in batches:
            opt.step(lambda x=x, y=y: loss_fn(net(x), y, reduction="none"))
        forwards += opt.forward_passes
        gains.append(heldout() - base)
        net.int_weights = copy.deepcopy(start)
        opt.write_back()
    best = max(range(len(gains)), key=lambda i: gains[i])
    return {"block": best, "gains": gains, "baseline": base, "forwards": forwards}


@register_builder("mcu-zo", integer=True)
def build_mcu(spec, model: nn.Module, subspace: Any, o, run) -> MCUZO:
    """Seed 004's learner on the fixed-point network (``backend: fixed``): ``szo.q`` probes per
    layer, ``szo.layers`` the trained subset (sparse), 1-LSB perturbations, eq. 8 with ``train.lr``."""
    seed = o.integer.seed if o.integer is not None else 1
    return MCUZO(model, layers=None if o.layers is None else list(o.layers), q=o.q, lr=o.lr, seed=seed)
