"""Full-space zeroth-order baselines (no subspace): DeepZero-style CGE and Gaussian RGE in R^d.

These are the methods the paper shows failing on SNNs (Sec. 3, Figure 1). For a fair
comparison at a fixed forward-pass budget, CGE perturbs ``coords_per_step`` coordinates
drawn uniformly without replacement each step (sparse CGE as in DeepZero; ``None`` = all d
coordinates, 2d forwards per step), and RGE uses ``q`` Gaussian directions ``z ~ N(0, I_d)``.
The update is eq. (6) in parameter space (``szo.zo.heavy_ball_``, velocity form).

``FullSpaceZO(model, ...)`` or ``FullSpaceZO(model.parameters(), ..., model=model)``; BN
freezing, neuron resets before every probe and ``bn_update`` as for ``szo.optim.SZO``
(``szo.zo``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from szo.evaluators import build_evaluator
from szo.methods import register_builder
from szo.zo import (
    GENERATOR_COUNTERS,
    Batch,
    Coordinates,
    ForwardOnlyBase,
    ParamSpace,
    Plan,
    ProbePath,
    StateCodec,
    check_hparams,
    gaussian_rows,
    get_estimator,
    heavy_ball_,
    resolve_model,
    without_frozen,
)

__all__ = ["FullSpaceZO"]


class FullSpaceZO(ForwardOnlyBase):
    """Forward-only full-space ZO optimizer (``estimator="cge"``, ``"coord-one-point"`` or ``"rge"``).

    A :class:`~szo.zo.ParamSpace` over all its parameters (those with ``requires_grad``; param
    groups set their own ``lr`` and ``momentum``, and ``add_param_group`` adds to the space), a CGE plan over ``coords_per_step`` random
    coordinates (probes ``+i, -i`` interleaved; ``"coord-one-point"``: the centre, then ``+i`` --
    one-sided differences, ``n + 1`` forwards) or an RGE plan over ``q`` Gaussian directions
    (drawn one ``[d]`` vector at a time, estimate accumulated direction by direction), the loop
    evaluator, and heavy ball on a ``[d]`` velocity (``self.state[first parameter]["velocity"]``).
    """

    codecs = (StateCodec("zo", GENERATOR_COUNTERS),)
    fixed_space = None  # add_param_group adds to the flat vector

    def __init__(
        self,
        params,
        *,
        estimator: str = "cge",
        mu: float = 5e-3,
        lr: float = 0.1,
        momentum: float = 0.9,
        q: int = 1,
        coords_per_step: int | None = None,
        model: nn.Module | None = None,
        generator: torch.Generator | None = None,
        bn_update: str = "recompute",
    ):
        kind = get_estimator(estimator, ("cge", "coord-one-point", "rge"))
        check_hparams(lr=lr, momentum=momentum, mu=mu, q=None if kind.coordinate else q)
        params, model, names = resolve_model(params, model, "FullSpaceZO")
        self.coords_per_step = coords_per_step
        # each group through add_param_group; every parameter frozen: steps that move nothing (torch's rule)
        super().__init__(params if names is None else list(zip(names, params)), dict(lr=lr, momentum=momentum, mu=mu))
        if coords_per_step is not None and self.d and not 1 <= coords_per_step <= self.d:
            raise ValueError(f"coords_per_step must be in [1, d={self.d}], got {coords_per_step}")
        self.estimator = kind.name
        self.kind = kind
        self.q = q
        self.model = model
        self._init_forward_only(build_evaluator(ProbePath(bn_update=bn_update), model, "FullSpaceZO"), generator)

    def add_param_group(self, param_group: dict) -> None:
        """A group's parameters join the flat vector (their velocity 0; ``lr`` and ``momentum`` of its
        own, ``mu`` the optimizer's); a frozen parameter (``requires_grad=False``) is left out, never
        probed nor moved."""
        group = without_frozen(param_group)
        if group.get("mu", self.defaults["mu"]) != self.defaults["mu"]:
            raise ValueError(f"FullSpaceZO probes every coordinate with one mu (the optimizer's, "
                             f"{self.defaults['mu']}); a param group may set its own lr and momentum, not mu")
        super().add_param_group(group)
        params = [p for g in self.param_groups for p in g["params"]]
        space = ParamSpace(params)
        self.space, self.d = space, space.d
        if not params:
            return
        old = self.state[params[0]].get("velocity")
        vel = torch.zeros(space.d, dtype=params[0].dtype, device=params[0].device)
        if old is not None:
            vel[:old.numel()] = old
        self.state[params[0]]["velocity"] = vel

    @property
    def forwards_per_step(self) -> int:
        """Probe forwards per step, plus one unperturbed BN forward under ``bn_update="recompute"``."""
        return self.kind.probes(self.coords_per_step or self.d, self.q) + int(self.recomputes)

    def plan(self) -> Plan:
        """This step's probes (draws coordinates or directions from ``generator``)."""
        mu = self.param_groups[0]["mu"]
        if self.kind.coordinate:
            n = self.coords_per_step or self.d
            idx = torch.randperm(self.d, generator=self.generator)[:n] if n < self.d else torch.arange(self.d)
            return self.kind.plan(Coordinates(idx, self.d), mu, interleaved=True)
        z = gaussian_rows(self.q, self.d, self.generator, dtype=self.space.dtype, one_at_a_time=True)
        return self.kind.plan(mu=mu, z=z.to(self.space.device), interleaved=True, accumulate="sequential")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        if not self.d:
            return self.idle_step(closure)
        plan = self.plan()
        with self.evaluator.session():
            losses = self.evaluator.run(closure, self.space, plan, batch=batch)
        grad = plan.estimate(losses, dtype=self.space.dtype).to(self.space.device)
        vel, off = self.state[self.space.params[0]]["velocity"], 0
        for group in self.param_groups:  # each group's slice of the flat vector with its lr / momentum
            n = sum(p.numel() for p in group["params"])
            heavy_ball_(vel[off:off + n], grad[off:off + n], lr=group["lr"], momentum=group["momentum"])
            off += n
        self.space.add_(vel)
        return self.finish_step(closure, losses, self.kind.step_loss(losses), plan.m)


@register_builder("zo-cge", "zo-rge")
def build_full_space_zo(spec, model: nn.Module, subspace, o, run) -> FullSpaceZO:
    """Full-space ZO (``spec.variant``: cge, rge). CGE's ``coords_per_step`` defaults to the
    subspace's k when one is given (the same 2k forwards per step as SZO-CGE), else all d."""
    coords = o.coords_per_step
    if get_estimator(spec.variant).coordinate and coords is None and subspace is not None:
        # the subspace's k, at most the trained coordinates (frozen parameters are left out of d)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        coords = min(int(subspace.basis.shape[1]), trained) or None
    return FullSpaceZO(model, estimator=spec.variant, mu=o.mu, lr=o.lr, momentum=o.momentum, q=o.q,
                       coords_per_step=coords, generator=run.generator, bn_update=o.bn_update)
