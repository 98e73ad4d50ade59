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

from typing import Callable, Sequence

import torch
from torch import nn

from szo.functional.zo import per_sample_node_estimate
from szo.methods import register_builder
from szo.zo import (
    GENERATOR_COUNTERS,
    Field,
    ForwardOnlyBase,
    LoopEvaluator,
    NodeSpace,
    ParamSpace,
    ProbeGuard,
    StateCodec,
    check_hparams,
    heavy_ball_,
    one_point_plan,
    trainable_layers,
)

__all__ = ["LayerwiseZO", "PERTURBATIONS", "trainable_layers"]

PERTURBATIONS: tuple[str, ...] = ("node", "weight", "adaptive")


class LayerwiseZO(ForwardOnlyBase):
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
    """

    # state_dict()["layerwise"]: generator, forward count, per-layer modes
    codecs = (StateCodec("layerwise", GENERATOR_COUNTERS + (Field("modes", "plain"),)),)

    def __init__(self, model: nn.Module, *, perturbation: str = "node", layers: Sequence[str] | None = None,
                 mu: float = 1e-2, lr: float = 0.1, momentum: float = 0.9, q: int = 1,
                 generator: torch.Generator | None = None, bn_update: str = "recompute", per_sample: bool = True):
        if perturbation not in PERTURBATIONS:
            raise ValueError(f"unknown perturbation {perturbation!r}; valid: {', '.join(PERTURBATIONS)}")
        check_hparams(lr=lr, momentum=momentum, mu=mu, q=q)
        self.layers = trainable_layers(model, layers)
        params = [p for m in self.layers.values() for p in m.parameters(recurse=False) if p.requires_grad]
        if not params:
            raise ValueError("the chosen layers have no trainable parameters")
        super().__init__(params, dict(lr=lr, momentum=momentum, mu=mu))
        self.model = model
        self.perturbation = perturbation
        self.q = q
        self.per_sample = bool(per_sample) and perturbation != "weight"
        self.loss_reduction = "none" if self.per_sample else "mean"
        self._init_forward_only(LoopEvaluator(ProbeGuard(model, "LayerwiseZO", bn_update=bn_update)), generator)
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
                self.modes[name] = "node" if node_dim < d_w else "weight"  # node_dim: what one difference drives
            else:
                self.modes[name] = self.perturbation
        return self.modes[name]

    def _noise(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q`` Gaussian draws shaped ``shape``, flattened to ``[q, numel]`` (drawn one at a time)."""
        return torch.stack([torch.randn(shape, generator=self.generator, dtype=dtype).reshape(-1)
                            for _ in range(self.q)])

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("LayerwiseZO.step needs a closure that runs a forward pass and returns the loss")
        group = self.param_groups[0]
        mu = group["mu"]
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, tuple[torch.Size, int]] = {}

        def record(name):
            def hook(mod, args, out):
                inputs[name] = args[0].detach()
                outputs[name] = (out.shape, out.shape[1] if out.dim() > 2 else out.shape[0])  # [T, N, ...] or [N, F]
            return hook

        grads: dict[nn.Parameter, torch.Tensor] = {}
        losses_all: list[float] = []
        ev, ps = self.evaluator, self.per_sample
        with ev.session():
            handles = [m.register_forward_hook(record(n)) for n, m in self.layers.items()]
            try:
                clean = ev.centre(closure, per_sample=ps)  # l_n [N] (per sample) or l
                l0 = float(clean.mean()) if ps else clean
            finally:
                for h in handles:
                    h.remove()
            for name, m in self.layers.items():
                shape, batch = outputs[name]
                # the nodes one loss difference weights: one sample's (per-sample losses), all N's (batch mean)
                node_dim = int(torch.Size(shape).numel()) // (max(batch, 1) if ps else 1)
                own = self.spaces[name]
                if self._mode(name, m, node_dim) == "node":
                    plan = one_point_plan(self._noise(torch.Size(shape)), mu, centre=False)
                    losses = ev.run(closure, NodeSpace(m, shape), plan, label=f"layer {name}, node probe",
                                    per_sample=ps)
                    if ps:  # Algorithm 1 line 29: xi_{q,n} (l_{q,n} - l_n) / mu, averaged over q and n
                        g_z = per_sample_node_estimate(plan.directions, losses, clean, mu, shape)
                        losses = losses.mean(1)
                    else:
                        g_z = plan.estimate(losses, centre=l0).view(shape)
                    with torch.enable_grad():  # eq. 10: this layer's VJP at its recorded input
                        z = m(inputs[name])
                        for p, g in zip(own.params, torch.autograd.grad(z, own.params, grad_outputs=g_z.to(z))):
                            grads[p] = g
                else:
                    xi = self._noise(torch.Size([own.d]), own.dtype).to(own.device)
                    plan = one_point_plan(xi, mu, centre=False)
                    losses = ev.run(closure, own, plan, label=f"layer {name}, weight probe", per_sample=ps)
                    if ps:
                        losses = losses.mean(1)  # weight perturbation: the batch loss (Algorithm 1 line 10)
                    for p, g in zip(own.params, own.split(plan.estimate(losses, centre=l0))):
                        grads[p] = g
                losses_all += losses.tolist()
        for p in group["params"]:
            p.add_(heavy_ball_(self.state[p]["velocity"], grads[p], lr=group["lr"], momentum=group["momentum"]))
        return self.finish_step(closure, [l0, *losses_all], l0, 1 + self.q * len(self.layers))


@register_builder("np-zo", "wp-zo", "awp-zo")
def build_layerwise(spec, model: nn.Module, subspace, o, run) -> LayerwiseZO:
    """LayerwiseZO with the method's perturbation (``spec.variant``: node, weight, adaptive)."""
    return LayerwiseZO(model, perturbation=spec.variant, layers=None if o.layers is None else list(o.layers),
                       mu=o.mu, lr=o.lr, momentum=o.momentum, q=o.q, generator=run.generator, bn_update=o.bn_update,
                       per_sample=o.node_losses == "per-sample")
