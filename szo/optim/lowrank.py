"""SubZero and LOZO as published: per-layer low-rank perturbations, one two-point probe per step.

* **SubZero** (Yu et al. 2024, "Random Subspace Zeroth-Order Optimization for Memory-Efficient LLM
  Fine-Tuning"; its ``large_models/trainer.py``, ``subzero_sgd``): every ``T0`` steps (``refresh``,
  the code's ``update_interval``) each matrix parameter draws orthonormal ``U_l [m, r]``, ``V_l [n, r]``
  (``rank``, ``gauss_rank``); every step a fresh Gaussian core ``S_l [r, r]`` gives
  ``Z_l = sqrt(mn / r^2) U_l S_l V_l^T``, every other parameter a dense Gaussian block. One two-point
  probe ``g = (L(theta + mu Z) - L(theta - mu Z)) / 2mu`` and ``torch.optim.SGD``'s step on
  ``grad = g Z`` (``lr``, ``momentum``; 0: plain ZO-SGD).
* **LOZO** (Chen et al. 2024, "Enhancing Zeroth-order Fine-tuning for Language Models with Low-rank
  Structures"; its ``LOZOtrainer.py``): ``V_l [n, r]`` Gaussian, kept ``nu`` steps (``refresh``, the
  code's ``step_interval``), ``U_l [m, r]`` Gaussian and fresh every step, ``Z_l = U_l V_l^T``; the same
  probe and ``theta <- theta - lr g Z`` (``lowrank_zo_update``).
* **LOZO-M** (the same paper's Algorithm 2, ``lowrank_zo_update_momentum``): a momentum ``N_l [m, r]``
  per matrix parameter, ``N_l <- beta N_l + (1 - beta) g U_l`` and ``W_l <- W_l - lr N_l V_l^T``; at a
  redraw of ``V_l`` the momentum is re-projected onto the new one,
  ``N_l <- beta N_l V_old^T V_l / n + (1 - beta) g U_l``; the first step sets ``N_l = g U_l``. Every
  other parameter keeps a dense momentum of its shape (``g z`` at the first step, then the same
  average). ``beta`` is ``momentum``.

Composition (``szo.zo``): the directions are :class:`~szo.zo.lowrank.LayerFactors`' (the perturbation's
structure), the probe is an RGE plan with one direction (``q = 1``, two forwards) over a
:class:`~szo.zo.ParamSpace`, run by the loop evaluator (BN frozen or recomputed, neurons reset); SubZero's
and LOZO's update is :func:`~szo.zo.heavy_ball_` on a ``[d]`` velocity (torch's SGD momentum in
velocity form, identical for a constant lr); LOZO-M's average is ``torch.lerp_``. The direction is
materialised as one ``[d]`` vector (the memory the LLM codes save by regenerating it from a seed is not
the point at these sizes).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from szo.evaluators import build_evaluator
from szo.methods import register_builder
from szo.zo import (
    GENERATOR_COUNTERS,
    LOWRANK_FORMS,
    Batch,
    Field,
    ForwardOnlyBase,
    LayerFactors,
    ParamSpace,
    ProbePath,
    StateCodec,
    check_hparams,
    get_estimator,
    heavy_ball_,
    resolve_model,
    without_frozen,
)

__all__ = ["LowRankZO", "LOWRANK_DEFAULTS"]

LOWRANK_DEFAULTS: dict[str, dict[str, float]] = {
    # the codes' own defaults: SubZero's run.py (gauss_rank 8, update_interval 2000, zo_eps 1e-3), LOZO's
    # large_models/run_lozo.py (rank_r 2, step_interval 50, zo_eps 1e-3) and medium_models' beta1 0.9
    "subzero": {"rank": 8, "refresh": 2000, "mu": 1e-3},
    "lozo": {"rank": 2, "refresh": 50, "mu": 1e-3},
}


class LowRankZO(ForwardOnlyBase):
    """Forward-only ZO with per-layer low-rank perturbations (module docstring): ``form`` ``"subzero"``
    or ``"lozo"``; ``lozo_momentum``: LOZO-M's factor momentum (``momentum`` is its beta). One param
    group (its ``lr`` and ``momentum`` are read at every step, so LR schedulers work). State: the
    factors and momenta per parameter (``state[p]``: ``U``, ``V``, ``V_prev``, ``momentum``), the
    ``[d]`` velocity (``state[first]["velocity"]``), the generator and the step count."""

    codecs = (StateCodec("zo", GENERATOR_COUNTERS + (Field("steps", "int", default=0),)),)
    fixed_space = "the parameters it was built with (each matrix with its own factors)"

    def __init__(self, params, *, form: str = "subzero", rank: int | None = None, refresh: int | None = None,
                 mu: float | None = None, lr: float = 1e-3, momentum: float = 0.0, lozo_momentum: bool = False,
                 model: nn.Module | None = None, generator: torch.Generator | None = None,
                 bn_update: str = "recompute"):
        if form not in LOWRANK_FORMS:
            raise ValueError(f"unknown low-rank form {form!r}; valid: {', '.join(LOWRANK_FORMS)}")
        if lozo_momentum and form != "lozo":
            raise ValueError("lozo_momentum (LOZO-M's factor momentum) needs form='lozo'")
        d = LOWRANK_DEFAULTS[form]
        rank = int(d["rank"]) if rank is None else rank
        refresh = int(d["refresh"]) if refresh is None else refresh
        mu = float(d["mu"]) if mu is None else mu
        check_hparams(lr=lr, momentum=momentum, mu=mu, q=1)
        if lozo_momentum and not 0.0 <= momentum < 1.0:
            raise ValueError(f"LOZO-M's momentum (beta) must be in [0, 1), got {momentum}")
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
            raise ValueError(f"refresh must be an int >= 1 (steps between redraws: SubZero's T0, LOZO's nu), got {refresh!r}")
        params, model, names = resolve_model(params, model, "LowRankZO")

        if form == "lozo" and not lozo_momentum and momentum:
            raise ValueError(f"LOZO takes no momentum (its update is plain ZO-SGD; LOZO-M is form='lozo', "
                             f"lozo_momentum=True); set momentum=0 (got {momentum})")
        # LOZO has no momentum to schedule: param_groups carry none (OneCycleLR refuses it in torch's line)
        defaults = dict(lr=lr, mu=mu) if form == "lozo" and not lozo_momentum else dict(lr=lr, momentum=momentum, mu=mu)
        # named parameters ((name, tensor) pairs, torch >= 2.6): torch keeps the names as "param_names";
        # every parameter frozen: steps that move nothing (torch's rule)
        super().__init__(params if names is None else list(zip(names, params)), defaults)
        self.space = ParamSpace([p for g in self.param_groups for p in g["params"]])
        if len(self.param_groups) > 1:
            raise ValueError("LowRankZO takes one parameter group (its lr and momentum)")
        self.d = self.space.d
        self.form, self.rank, self.refresh, self.lozo_momentum = form, rank, refresh, lozo_momentum
        self.factors = LayerFactors(self.space.params, rank, form)
        self.kind = get_estimator("rge")
        self.estimator, self.q = self.kind.name, 1  # one two-point probe along one direction
        self.model = model
        self.steps = 0
        if not lozo_momentum and self.d:
            self.state[self.space.params[0]]["velocity"] = torch.zeros(self.d, dtype=self.space.dtype,
                                                                       device=self.space.device)
        self._init_forward_only(build_evaluator(ProbePath(bn_update=bn_update), model, "LowRankZO"), generator)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with frozen parameters (``requires_grad=False``) left out: never probed nor moved."""
        super().add_param_group(without_frozen(param_group))

    @property
    def forwards_per_step(self) -> int:
        """Two probe forwards, plus one unperturbed BN forward under ``bn_update="recompute"``."""
        return 2 + int(self.recomputes)

    # ------------------------------------------------------------------ the step's draws
    def _bases(self) -> list:
        """This step's ``(U, V)`` per parameter: redrawn when ``steps % refresh == 0`` (the old ``V`` kept
        as ``V_prev`` for LOZO-M's re-projection)."""
        params = self.space.params
        if self.steps % self.refresh == 0:
            for p, b in zip(params, self.factors.draw_bases(self.generator, self.space.dtype)):
                if b is None:
                    continue
                st = self.state[p]
                if "V" in st:
                    st["V_prev"] = st["V"]
                U, V = b
                if U is not None:
                    st["U"] = U.to(p.device)
                st["V"] = V.to(p.device)
        return [None if not lr else (self.state[p].get("U"), self.state[p]["V"])
                for p, lr in zip(params, self.factors.low_rank)]

    def draw(self) -> tuple[list, list[torch.Tensor], torch.Tensor]:
        """``(bases, cores, z)``: this step's factors, fresh draws and flat direction ``[d]``."""
        bases = self._bases()
        cores = [c.to(self.space.device) for c in self.factors.draw_cores(self.generator, self.space.dtype)]
        return bases, cores, self.factors.direction(bases, cores)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        if not self.d:
            return self.idle_step(closure)
        group = self.param_groups[0]
        bases, cores, z = self.draw()
        plan = self.kind.plan(mu=group["mu"], z=z[None], interleaved=True, accumulate="sequential")
        with self.evaluator.session():
            losses = self.evaluator.run(closure, self.space, plan, batch=batch)
        if self.lozo_momentum:
            lp, lm = plan.pairs(losses)
            self._lozo_m_update(float(lp[0] - lm[0]) / (2 * plan.mu), bases, cores, group)
        else:
            grad = plan.estimate(losses, dtype=self.space.dtype).to(self.space.device)  # g z
            vel = self.state[self.space.params[0]]["velocity"]
            heavy_ball_(vel, grad, lr=group["lr"], momentum=group.get("momentum", 0.0))
            self.space.add_(vel)
        self.steps += 1
        return self.finish_step(closure, losses, self.kind.step_loss(losses), plan.m)

    def _lozo_m_update(self, g: float, bases: list, cores: list[torch.Tensor], group: dict) -> None:
        """LOZO-M (Algorithm 2): each parameter's momentum, then ``theta <- theta - lr N V^T`` (dense: ``- lr N``)."""
        beta, t = group["momentum"], self.steps
        blocks = []
        for p, base, core in zip(self.space.params, bases, cores):
            st = self.state[p]
            fresh = g * core  # g U_l (low-rank) or g z_l (full space)
            if "momentum" not in st:  # the first step: N = g U
                st["momentum"] = fresh.clone()
            elif base is not None and t % self.refresh == 0:  # V was redrawn: re-project onto it
                V_old, V = st["V_prev"], base[1]
                st["momentum"] = beta * (st["momentum"] @ V_old.t() @ V) / V_old.shape[0] + (1 - beta) * fresh
            else:
                st["momentum"].lerp_(fresh, 1 - beta)
            N = st["momentum"]
            blocks.append((N if base is None else N @ base[1].t()).reshape(-1))
        self.space.add_(torch.cat(blocks), alpha=-float(group["lr"]))  # a one-element tensor lr: its number


@register_builder("subzero", "lozo", "lozo-m")
def build_lowrank_zo(spec, model: nn.Module, subspace, o, run) -> LowRankZO:
    """SubZero / LOZO / LOZO-M (``spec.variant``: subzero, lozo, lozo-m): ``rank`` and ``refresh`` (T0 / nu)
    default to the codes' own (:data:`LOWRANK_DEFAULTS`)."""
    form = "lozo" if spec.variant.startswith("lozo") else "subzero"
    return LowRankZO(model, form=form, rank=o.rank, refresh=o.refresh, mu=o.mu, lr=o.lr, momentum=o.momentum,
                     lozo_momentum=spec.variant == "lozo-m", generator=run.generator, bn_update=o.bn_update)
