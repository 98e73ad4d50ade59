"""Layer-wise weight / node perturbation ZO (seed 004, Zhao et al. 2025, Sec. 3.2, Algorithm 1).

One step, with ``L`` trainable layers (``nn.Linear`` / ``nn.Conv*``, SpikingJelly's multi-step
layers included) and ``Q = q`` probes per layer:

1. one clean forward ``l0 = L(theta)``; forward hooks record each trainable layer's input ``a_i``;
2. for each trainable layer ``i`` (the others are not perturbed: *layer-wise* estimation), ``q``
   one-sided probes (paper eq. 6 / 9):

   * **node perturbation** (``"node"``): a forward hook adds ``mu * xi`` to the layer's output
     ``z_i = W_i a_i + b_i`` (the pre-activation: the neuron input current, one scalar per node,
     per time step and per sample, ``xi ~ N(0, I)``), giving ``g_z = 1/q sum (l_q - l0)/mu xi_q``;
     the weight gradient is the layer's own outer product (eq. 10) ``g_W = g_z a_i^T`` computed as
     the vector-Jacobian product of that one layer at the recorded input (a convolution's
     ``g_z * a_i``), never a backward pass through the network;
   * **weight perturbation** (``"weight"``): ``W_i + mu xi``, ``g_W = 1/q sum (l_q - l0)/mu xi_q``;
   * ``"adaptive"``: node perturbation where the layer's node dimension (per sample, over T) is
     smaller than its weight dimension, weight perturbation otherwise (Sec. 3.2.2); with
     ``per_sample=False`` one loss difference drives the nodes of all N samples, so the node side
     counts N times the per-sample nodes;

3. all layers are updated together from the estimates at ``theta_t`` (a *global* update, as in
   Algorithm 1's recomputation of the activations), heavy ball in velocity form like
   :class:`~szo.optim.FullSpaceZO`.

Only the parameters of those layers are trained (BN affine parameters are in no perturbed layer).
``layers`` picks a subset of the trainable layers by module name (the paper's *sparse* training:
only those layers are perturbed and updated); the default trains all of them. Forwards per step:
``1 + q * L``, plus one under ``bn_update="recompute"``.

BN statistics and neuron state as in ``SZO`` / ``FullSpaceZO`` (``szo.zo.guard``): every
forward of the step (the clean one included) starts from the step's BN running statistics and
reset neurons; ``bn_update="recompute"`` (default) then runs one unperturbed train-mode forward of
theta_{t+1}, which updates the statistics (counted in ``forward_passes``; ``step`` returns its
loss), ``"probe-mean"`` sets them to the mean over the step's forwards (``step`` returns ``l0``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as TF
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.evaluators import build_evaluator
from szo.functional.zo import per_sample_node_estimate
from szo.methods import get_method, list_methods, register_builder
from szo.zo import (
    GENERATOR_COUNTERS,
    CleanForward,
    Field,
    LayerwiseBase,
    NodeSpace,
    ParamSpace,
    ProbePath,
    StateCodec,
    adaptive_perturbation,
    check_hparams,
    heavy_ball_,
    one_point_plan,
    refuse_shared_weights,
    trainable_layers,
)

__all__ = ["LayerwiseZO", "PERTURBATIONS", "NODE_BN", "CleanBatchStatistics", "trainable_layers"]

PERTURBATIONS: tuple[str, ...] = ("node", "weight", "adaptive")
NODE_BN: tuple[str, ...] = ("bn-vjp", "frozen", "live")
"""What a batch-statistics (train-mode) BatchNorm after a node-perturbed layer does during that
layer's per-sample probes (Algorithm 1 assumes no batch-dependent operation after the node):

* ``"live"``: the probe's own batch statistics. One sample's perturbation moves them and so every
  other sample's loss, which the per-sample estimate does not see: biased (szo before issue 32);
* ``"frozen"``: every such BN normalises with the clean forward's batch statistics, so a sample's
  perturbation reaches only its own loss; unbiased for the gradient *with the statistics held
  constant*, which misses the same cross-sample terms;
* ``"bn-vjp"`` (default): ``"frozen"``, then the node estimate is carried through the local
  vector-Jacobian product of the BN layer the perturbed layer feeds (its batch statistics
  included, at the clean forward's input), as eq. 10 carries it through the layer itself. Where
  that BN is the only batch-dependent operation after the layer this is unbiased for the true
  gradient; BN layers further on stay frozen (their statistics' terms are still missing).

docs/methods.md measures the three (cosine to the true gradient, accuracy)."""


def _batch_stat_bn(m: nn.Module) -> bool:
    """A BN layer that normalises with the statistics of its batch (train mode, or no running statistics)."""
    return isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)


def _bn_axes(m: nn.Module) -> tuple[int, ...]:
    """The axes a BN layer keeps of its input: the channel, and time for per-time-step BN
    (SpikingJelly multi-step ``[T, N, C, ...]``; a single-step layer's input is ``[N, C, ...]``)."""
    if getattr(m, "step_mode", "s") == "m":
        return (0, 2) if getattr(m, "bn_time", "shared") == "per-step" else (2,)
    return (1,)


def _keepdim(t: torch.Tensor, keep: tuple[int, ...], ndim: int) -> torch.Tensor:
    """Statistics shaped by the kept axes, viewed to broadcast over an ``ndim`` input."""
    shape = [1] * ndim
    for i, ax in enumerate(keep):
        shape[ax] = t.shape[i]
    return t.reshape(shape)


class CleanBatchStatistics:
    """The batch statistics every batch-statistics BatchNorm of ``model`` computed in one recorded
    (clean) forward; forwards in which chosen BN layers normalise with them instead of their own
    batch's; the local VJP of the BN a trained layer feeds.

    Inside :meth:`session`: the forward run under :meth:`recording` stores, per BN layer, the mean
    and biased variance of its input over what the layer normalises over (``_bn_axes``), the order
    in which the BN and trained layers ran (:meth:`after`), and which BN takes a trained layer's
    output itself as its input (:meth:`bn_vjp`); under :meth:`frozen` the given BN layers' outputs
    are replaced by ``F.batch_norm`` of their input with the recorded statistics (eval-mode
    arithmetic, the layer's affine parameters and eps). Running statistics are not touched here
    (the probe guard restores them around every probe). A BN layer run twice in one forward is one
    error: its statistics would be ambiguous.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module], *, enabled: bool = True):
        self.model = model
        self.enabled = enabled  # False: every method is a no-op (node_bn="live", or no per-sample estimate)
        self.bns: list[nn.Module] = []  # found when a session opens: the BN layers in batch-statistics mode then
        self.layers = layers
        self.stats: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.order: dict[nn.Module, int] = {}
        self.direct: dict[nn.Module, tuple[nn.Module, torch.Tensor]] = {}  # layer -> (the BN it feeds, its input)
        self._recording = False
        self._frozen: set[nn.Module] = set()
        self._last: tuple[nn.Module, torch.Tensor] | None = None

    def _pre(self, m: nn.Module, args) -> None:
        if not self._recording:
            return None
        if m in self.order:
            if isinstance(m, _BatchNorm):
                raise ValueError(f"{type(m).__name__} ran twice in one forward; node perturbation with its batch "
                                 "statistics frozen needs each BatchNorm layer once per forward (or node_bn='live')")
            return None  # a trained layer run again: its first call orders it (conservative)
        self.order[m] = len(self.order)
        if not isinstance(m, _BatchNorm):
            return None
        x = args[0].detach()
        keep = _bn_axes(m)
        var, mean = torch.var_mean(x, [d for d in range(x.dim()) if d not in keep], unbiased=False)
        self.stats[m] = (mean, var)
        if self._last is not None and args[0] is self._last[1]:  # the trained layer's output itself
            self.direct.setdefault(self._last[0], (m, x))
        return None

    def _post(self, m: nn.Module, args, out):
        if self._recording and m in self.layers.values():
            self._last = (m, out)
            return None
        if m not in self._frozen:
            return None
        x = args[0]
        mean, var = self.stats[m]
        keep = _bn_axes(m)
        if keep == (1,):
            return TF.batch_norm(x, mean, var, m.weight, m.bias, False, 0.0, m.eps)
        if keep == (2,):
            return TF.batch_norm(x.flatten(0, 1), mean, var, m.weight, m.bias, False, 0.0, m.eps).view_as(x)
        return torch.stack([TF.batch_norm(x[t], mean[t], var[t], m.weight, m.bias, False, 0.0, m.eps)
                            for t in range(x.shape[0])])

    @contextlib.contextmanager
    def session(self) -> Iterator["CleanBatchStatistics"]:
        """Hooks on the BN and trained layers for one step (none when disabled or no BN normalises with
        its batch's statistics now: the model's mode at this step decides); what was recorded ends with it."""
        self.bns = [m for m in self.model.modules() if _batch_stat_bn(m)] if self.enabled else []
        handles = []
        for m in (*self.bns, *self.layers.values()) if self.bns else ():
            handles.append(m.register_forward_pre_hook(self._pre))
            handles.append(m.register_forward_hook(self._post))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.stats, self.order, self.direct, self._frozen, self._recording = {}, {}, {}, set(), False
            self._last = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.stats, self.order, self.direct, self._recording = {}, {}, {}, True
        try:
            yield
        finally:
            self._recording, self._last = False, None

    def after(self, layer: nn.Module) -> list[nn.Module]:
        """The batch-statistics BN layers that ran after ``layer`` in the recorded forward (the ones
        its output can reach; conservative for branches)."""
        at = self.order.get(layer)
        if at is None:
            return []
        return [m for m in self.bns if self.order.get(m, -1) > at]

    @contextlib.contextmanager
    def frozen(self, bns: Sequence[nn.Module]) -> Iterator[None]:
        self._frozen = set(bns)
        try:
            yield
        finally:
            self._frozen = set()

    def bn_vjp(self, layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
        """``g`` (the gradient at ``layer``'s output with every BN's statistics held constant) carried
        through the batch statistics of the BN that takes that output as its input, at the recorded
        input ``x``: ``g - mean(g) - x_hat mean(g x_hat)`` over the BN's normalised axes, ``x_hat =
        (x - mean) / sqrt(var + eps)`` (BatchNorm's backward with ``gamma / sigma`` factored out, which
        the constant-statistics gradient already holds). ``g`` unchanged if no BN takes the output.
        Assumes the output feeds nothing else (a convolution followed by its BN)."""
        if layer not in self.direct:
            return g
        bn, x = self.direct[layer]
        keep = _bn_axes(bn)
        dims = [d for d in range(x.dim()) if d not in keep]
        mean, var = self.stats[bn]
        x64 = x.to(torch.float64)
        xh = (x64 - _keepdim(mean.to(torch.float64), keep, x.dim())) / torch.sqrt(
            _keepdim(var.to(torch.float64), keep, x.dim()) + bn.eps)
        g64 = g.to(device=x.device, dtype=torch.float64).view_as(x)
        out = g64 - g64.mean(dims, keepdim=True) - xh * (g64 * xh).mean(dims, keepdim=True)
        return out.to(g.dtype).view_as(g)


class LayerwiseZO(LayerwiseBase):
    """Forward-only layer-wise ZO with node, weight or adaptive perturbation (``step(closure)``).

    Composed from the core: per layer a one-sided plan of ``q`` Gaussian directions in a
    :class:`~szo.zo.NodeSpace` (the layer's output) or a :class:`~szo.zo.ParamSpace` (its own
    weights), all run by the loop evaluator after the step's clean forward, then heavy ball per
    parameter tensor.

    ``per_sample`` (default): node perturbation as seed 004's Algorithm 1 (lines 23 and 29) does it:
    every sample's node perturbation ``xi_{q,n}`` is weighted by *its own* loss difference
    ``l_{q,n} - l_n``, so each node estimate carries one sample's noise, not all N; the closure
    then returns one loss per sample (``loss_reduction == "none"``; ``szo.train.fit`` asks the loss
    for ``reduction="none"``), and weight perturbation uses their mean. The estimate is of the
    batch-mean loss's gradient (Algorithm 1 sums over n; the 1/N is the mean's). ``per_sample=False``:
    the batch-mean form szo had before (every node weighted by the batch loss's difference).

    ``node_bn`` (:data:`NODE_BN`): Algorithm 1 assumes no batch-dependent operation after the
    perturbed node. With a train-mode BatchNorm after a node-perturbed layer, one sample's
    perturbation moves the batch statistics and so every other sample's loss, and the per-sample
    estimate is biased (``"live"``, the earlier behaviour). ``"bn-vjp"`` (default) runs that
    layer's probes with every such BN normalising with the clean forward's batch statistics
    (:class:`CleanBatchStatistics`) and carries the node estimate through the local VJP of the BN
    the layer feeds (``"frozen"``: without that VJP). Weight perturbation and the batch-mean form
    are unbiased with live statistics and never freeze them.
    """

    # state_dict()["layerwise"]: generator, forward count, per-layer modes
    codecs = (StateCodec("layerwise", GENERATOR_COUNTERS + (Field("modes", "plain"),)),)
    fixed_space = "the parameters of the layers it was built with (layers=)"

    def __init__(self, model: nn.Module, *, perturbation: str = "node", layers: Sequence[str] | None = None,
                 mu: float = 1e-2, lr: float = 0.1, momentum: float = 0.9, q: int = 1,
                 generator: torch.Generator | None = None, bn_update: str = "recompute", per_sample: bool = True,
                 node_bn: str = "bn-vjp"):
        if perturbation not in PERTURBATIONS:
            raise ValueError(f"unknown perturbation {perturbation!r}; valid: {', '.join(PERTURBATIONS)}")
        if node_bn not in NODE_BN:
            raise ValueError(f"unknown node_bn {node_bn!r}; valid: {', '.join(NODE_BN)} (bn-vjp / frozen: BatchNorm "
                             "after a node-perturbed layer normalises its probes with the clean forward's batch "
                             "statistics, bn-vjp then carries the estimate through the BN's batch statistics; live: "
                             "the probes' own statistics, a biased per-sample estimate)")
        check_hparams(lr=lr, momentum=momentum, mu=mu, q=q)
        self.layers = trainable_layers(model, layers)
        refuse_shared_weights(self.layers, "LayerwiseZO")
        # a layer whose parameters are all frozen (requires_grad=False) is not trained (named: refused)
        still = [n for n, m in self.layers.items() if not any(p.requires_grad for p in m.parameters(recurse=False))]
        if layers is not None and still:
            raise ValueError(f"LayerwiseZO: layer(s) {', '.join(still)} have only frozen parameters "
                             "(requires_grad=False), which an optimizer never changes: leave them out of layers=")
        self.layers = {n: m for n, m in self.layers.items() if n not in still}
        params = [p for m in self.layers.values() for p in m.parameters(recurse=False) if p.requires_grad]
        if not params:
            raise ValueError("the chosen layers have no trainable parameters")
        super().__init__(params, dict(lr=lr, momentum=momentum, mu=mu))
        self.model = model
        self.perturbation = perturbation
        self.q = q
        self.per_sample = bool(per_sample) and perturbation != "weight"
        self.loss_reduction = "none" if self.per_sample else "mean"
        self.node_bn = node_bn
        self.clean_stats = CleanBatchStatistics(model, self.layers, enabled=self.per_sample and node_bn != "live")
        # the method's record says it drives layers through hooks (its clean forward records inputs, node
        # perturbation adds noise through them): the probe path refuses forwards that would skip them
        method = get_method(list_methods(family="layer-wise-zo", variant=perturbation)[0])
        self._init_forward_only(build_evaluator(ProbePath(bn_update=bn_update, method=method), model, "LayerwiseZO"),
                                generator)
        self.modes: dict[str, str] = {}  # layer -> "node" | "weight" (adaptive: fixed at the first step)
        self.spaces = {n: ParamSpace([p for p in m.parameters(recurse=False) if p.requires_grad])
                       for n, m in self.layers.items()}
        for p in params:
            self.state[p]["velocity"] = torch.zeros_like(p)

    @property
    def forwards_per_step(self) -> int:
        """The clean forward, ``q`` probes per layer, and the BN forward under ``bn_update="recompute"``."""
        return 1 + self.q * len(self.layers) + int(self.recomputes)

    def _mode(self, name: str, m: nn.Module, node_dim: int) -> str:
        if name not in self.modes:
            if self.perturbation == "adaptive":
                d_w = sum(p.numel() for p in m.parameters(recurse=False))
                self.modes[name] = adaptive_perturbation(d_w, node_dim)  # node_dim: what one difference drives
            else:
                self.modes[name] = self.perturbation
        return self.modes[name]

    def _noise(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q`` Gaussian draws shaped ``shape``, flattened to ``[q, numel]`` (drawn one at a time)."""
        return torch.stack([torch.randn(shape, generator=self.generator, dtype=dtype).reshape(-1)
                            for _ in range(self.q)])

    # ------------------------------------------------------------------ the step's parts (LayerwiseBase.step)
    def _step_scope(self):
        return self.clean_stats.session()

    def _clean_forward(self, closure: Callable[[], torch.Tensor]):
        """The clean forward, recording each layer's input (eq. 10's VJP point), output shape and batch size."""
        recorded: dict[str, tuple[torch.Tensor, torch.Size, int]] = {}

        def record(name):
            def hook(mod, args, out):  # out: [T, N, ...] or [N, F]
                recorded[name] = (args[0].detach(), out.shape, out.shape[1] if out.dim() > 2 else out.shape[0])
            return hook

        handles = [m.register_forward_hook(record(n)) for n, m in self.layers.items()]
        try:
            with self.clean_stats.recording():
                clean = self.evaluator.centre(closure, per_sample=self.per_sample)  # l_n [N] (per sample) or l
        finally:
            for h in handles:
                h.remove()
        l0 = float(clean.mean()) if self.per_sample else clean
        return CleanForward(clean, l0, 0, recorded)

    def _probe_layer(self, closure: Callable[[], torch.Tensor], name: str, m: nn.Module, clean: CleanForward):
        """One layer's q probes: node perturbation (its output, then eq. 10's VJP to its weights) or
        weight perturbation (its own weights); the gradient per parameter of the layer."""
        ev, ps, cs, mu = self.evaluator, self.per_sample, self.clean_stats, self.param_groups[0]["mu"]
        x, shape, batch = clean.layers[name]
        # the nodes one loss difference weights: one sample's (per-sample losses), all N's (batch mean)
        node_dim = int(torch.Size(shape).numel()) // (max(batch, 1) if ps else 1)
        own = self.spaces[name]
        if self._mode(name, m, node_dim) == "weight":
            xi = self._noise(torch.Size([own.d]), own.dtype).to(own.device)
            plan = one_point_plan(xi, mu, centre=False)
            losses = ev.run(closure, own, plan, label=f"layer {name}, weight probe", per_sample=ps)
            if ps:
                losses = losses.mean(1)  # weight perturbation: the batch loss (Algorithm 1 line 10)
            return own.split(plan.estimate(losses, centre=clean.l0)), losses
        if ps and batch != clean.losses.numel():
            raise ValueError(
                f"node perturbation with per-sample losses perturbs layer {name!r}'s output sample by sample, but its "
                f"output {list(shape)} has no axis of the batch's {clean.losses.numel()} samples ([T, N, ...] or [N, F]; "
                "a SeqToANNContainer folds T and N into one): use SpikingJelly's multi-step layers (layer.Conv2d / "
                "layer.Linear, step_mode='m'), node_losses='batch-mean', or method wp-zo")
        plan = one_point_plan(self._noise(torch.Size(shape)), mu, centre=False)
        # the BN layers this layer's output reaches normalise with the clean batch's statistics
        with cs.frozen(cs.after(m)):
            losses = ev.run(closure, NodeSpace(m, shape), plan, label=f"layer {name}, node probe", per_sample=ps)
        if ps:  # Algorithm 1 line 29: xi_{q,n} (l_{q,n} - l_n) / mu, averaged over q and n
            g_z = per_sample_node_estimate(plan.directions, losses, clean.losses, mu, shape)
            if self.node_bn == "bn-vjp":  # through the BN it feeds
                g_z = cs.bn_vjp(m, g_z)
            losses = losses.mean(1)
        else:
            g_z = plan.estimate(losses, centre=clean.l0).view(shape)
        with torch.enable_grad():  # eq. 10: this layer's VJP at its recorded input
            z = m(x)
            return torch.autograd.grad(z, own.params, grad_outputs=g_z.to(z)), losses

    def _update(self, grads: dict[str, Sequence[torch.Tensor]], clean: CleanForward) -> None:
        group = self.param_groups[0]
        for name, layer_grads in grads.items():
            for p, g in zip(self.spaces[name].params, layer_grads):
                p.add_(heavy_ball_(self.state[p]["velocity"], g, lr=group["lr"], momentum=group["momentum"]))


@register_builder("np-zo", "wp-zo", "awp-zo")
def build_layerwise(spec, model: nn.Module, subspace, o, run) -> LayerwiseZO:
    """LayerwiseZO with the method's perturbation (``spec.variant``: node, weight, adaptive)."""
    return LayerwiseZO(model, perturbation=spec.variant, layers=None if o.layers is None else list(o.layers),
                       mu=o.mu, lr=o.lr, momentum=o.momentum, q=o.q, generator=run.generator, bn_update=o.bn_update,
                       per_sample=o.node_losses == "per-sample")
