"""Hybrid zeroth-order optimizer of the tensor-train ZO paper (seed 000 Sec. 3.2): ZO-signRGE, then ZO-CGE.

Used on a TT-parameterised model (``szo.models.tt.tt_parametrize``) it is ``method=tt-zo``:
ZO in TT-factor space. Two phases over the same parameters:

1. **ZO-signRGE coarse training**: ``N = sign_q`` Gaussian directions ``xi_i``, one-sided
   differences from ``L(theta)`` (``N + 1`` forwards), and only the sign of the estimate:
   ``theta <- theta - sign_lr * sign((1/N) sum_i (L(theta + mu xi_i) - L(theta)) / mu xi_i)``
   (paper: N = 10, mu = 0.1).
2. **ZO-CGE fine-tuning with momentum** (``FullSpaceZO``): the paper's CGE is eq. (2) with
   N = d, one-sided differences from ``L(theta)`` -- ``d + 1`` forwards per step (``cge="one-sided"``,
   the default); ``cge="central"`` is szo's earlier variant, 2 forwards per coordinate.
   ``coords_per_step`` coordinates per step, all by default; paper: mu = 0.01, momentum 0.9.

BN statistics in both phases as in ``FullSpaceZO`` / ``SZO`` (``bn_update``, ``szo.zo.bn``):
every probe (the signRGE centre ``L(theta)`` included) starts from the step's statistics; under
``"recompute"`` (default) one unperturbed train-mode forward of theta_{t+1} then updates them
(+1 forward per step, counted; ``step`` returns its loss), under ``"probe-mean"`` they become
the mean over the probes. The plateau rule reads the centre losses ``L(theta_t)`` in both modes.

The switch happens "when the coarse training fails to learn": every ``window`` signRGE steps
the mean of ``L(theta)`` over the window is compared with the previous window's, and when it
improved by less than ``tol`` (relative) the optimizer switches to CGE for good
(``switch_step`` forces the switch at that step instead).

Each param group steps by its own lr in both phases. The signRGE phase's step of a group is
``sign_lr * lr / sign_lr_at``: ``sign_lr`` and ``sign_lr_at`` (the lr at which the sign step is
``sign_lr``: the group's lr when it was added) are keys of the group, so a scheduler, or an lr
of 0 set in ``param_groups``, scales that group's sign step as it scales its CGE step, and no
group's step depends on another group's lr or on a scheduler's ``initial_lr`` (OneCycleLR's is
``max_lr / 25``).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from szo.methods import register_builder
from szo.models.tt import tt_layers
from szo.zo import GENERATOR_COUNTERS, Batch, Field, StateCodec, gaussian_rows, one_point_plan, sign_descent_

from .fullspace import FullSpaceZO

__all__ = ["HybridZO", "PHASES"]

PHASES = ("sign-rge", "cge")
CGE_KINDS = ("one-sided", "central")
"""The CGE phase's differences: seed 000's eq. (2) (``d + 1`` forwards) or central (``2d``)."""


def _check_phase(opt, section: dict) -> None:
    if section.get("phase") not in PHASES:
        raise ValueError(f"optimizer state has phase {section.get('phase')!r}; valid: {', '.join(PHASES)}")


class HybridZO(FullSpaceZO):
    """ZO-signRGE until the loss plateaus (or ``switch_step``), then ZO-CGE with momentum."""

    codecs = (StateCodec("zo", GENERATOR_COUNTERS),
              StateCodec("hybrid", (Field("phase", "plain"), Field("steps", "int", "hybrid_state.steps"),
                                    Field("window_losses", "plain", "hybrid_state.window_losses"),
                                    Field("previous_mean", "plain", "hybrid_state.previous_mean"),
                                    Field("switched_at", "plain", "hybrid_state.switched_at")), check=_check_phase))

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float = 1e-3,
        momentum: float = 0.9,
        mu: float = 0.01,
        coords_per_step: int | None = None,
        sign_lr: float = 1e-3,
        sign_q: int = 10,
        sign_mu: float = 0.1,
        window: int = 20,
        tol: float = 0.01,
        switch_step: int | None = None,
        model: nn.Module | None = None,
        generator: torch.Generator | None = None,
        bn_update: str = "recompute",
        cge: str = "one-sided",
    ):
        if cge not in CGE_KINDS:
            raise ValueError(f"unknown CGE kind {cge!r}; valid: {', '.join(CGE_KINDS)}")
        if isinstance(sign_q, bool) or not isinstance(sign_q, int) or sign_q < 1:
            raise ValueError(f"sign_q must be an integer >= 1, got {sign_q!r}")
        if not sign_mu > 0:
            raise ValueError(f"sign_mu must be > 0, got {sign_mu}")
        if not sign_lr >= 0:
            raise ValueError(f"sign_lr must be >= 0, got {sign_lr}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if not tol >= 0:
            raise ValueError(f"tol must be >= 0, got {tol}")
        if switch_step is not None and (isinstance(switch_step, bool) or not isinstance(switch_step, int)
                                        or switch_step < 0):
            raise ValueError(f"switch_step must be null or an integer >= 0, got {switch_step!r}")
        self.sign_lr = float(sign_lr)  # each group's default sign_lr (add_param_group)
        super().__init__(params, estimator="coord-one-point" if cge == "one-sided" else "cge", mu=mu, lr=lr,
                         momentum=momentum,
                         coords_per_step=coords_per_step, model=model, generator=generator, bn_update=bn_update)
        self.sign_q, self.sign_mu = sign_q, float(sign_mu)
        self.window, self.tol, self.switch_step = window, float(tol), switch_step
        self.phase = "sign-rge" if switch_step != 0 else "cge"
        self.hybrid_state = {"steps": 0, "window_losses": [], "previous_mean": None, "switched_at": None}

    def result_fields(self) -> dict:
        """``{"tt": {"switched_at_step": ...}}``: when the run left signRGE for CGE, None if it never
        did (``szo.zo.ReportsResults``)."""
        return {"tt": {"switched_at_step": self.hybrid_state["switched_at"]}}

    @property
    def forwards_per_step(self) -> int:
        """signRGE: the centre and ``sign_q`` probes; CGE: ``FullSpaceZO``'s; each plus the BN
        forward under ``bn_update="recompute"`` with BN in train mode."""
        if self.phase == "sign-rge":
            return self.sign_q + 1 + int(self.guard.recomputes)
        return super().forwards_per_step

    def add_param_group(self, param_group: dict) -> None:
        """``FullSpaceZO``'s, and the group's signRGE step: ``sign_lr`` (the optimizer's unless the group
        sets its own) at ``sign_lr_at``, the group's lr now."""
        group = dict(param_group)
        group.setdefault("sign_lr", getattr(self, "sign_lr", None))
        group.setdefault("sign_lr_at", float(group.get("lr", self.defaults["lr"])))
        super().add_param_group(group)

    def load_state_dict(self, state_dict):
        """As ``FullSpaceZO``'s; a state saved before groups kept their sign step (no ``sign_lr`` /
        ``sign_lr_at``) continues as it ran then: the optimizer's ``sign_lr`` at the scheduler's
        ``initial_lr``, else the lr the optimizer was built with."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("sign_lr", self.sign_lr)
            group.setdefault("sign_lr_at", float(group.get("initial_lr", self.defaults["lr"])))

    def sign_step(self, group: dict) -> float:
        """The signRGE step of ``group``: its ``sign_lr`` times its lr over ``sign_lr_at`` (a group
        added at lr 0 steps by ``sign_lr`` once its lr is above 0)."""
        lr, at = float(group["lr"]), float(group["sign_lr_at"])
        return float(group["sign_lr"]) * (lr / at if at > 0 else float(lr > 0))

    def _switch(self) -> None:
        self.phase = "cge"
        self.hybrid_state["switched_at"] = self.hybrid_state["steps"]
        self.state[self.space.params[0]]["velocity"].zero_()  # b^0 = g^0 (paper)

    def _plateau(self, loss: float) -> bool:
        st = self.hybrid_state
        st["window_losses"].append(loss)
        if len(st["window_losses"]) < self.window:
            return False
        mean = sum(st["window_losses"]) / len(st["window_losses"])
        prev, st["previous_mean"], st["window_losses"] = st["previous_mean"], mean, []
        return prev is not None and prev - mean < self.tol * abs(prev)

    @torch.no_grad()
    def _sign_step(self, closure: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """One signRGE step: (what ``step`` returns, the centre loss ``L(theta_t)``)."""
        xi = gaussian_rows(self.sign_q, self.d, self.generator, dtype=self.space.dtype).to(self.space.device)
        plan = one_point_plan(xi, self.sign_mu)
        with self.evaluator.session():
            losses = self.evaluator.run(closure, self.space, plan)
        center = float(losses[0])
        grad = plan.estimate(losses).to(device=self.space.device, dtype=self.space.dtype)
        theta, off = self.space.flat(), 0
        for group in self.param_groups:  # each group's slice of the flat vector, by its own sign step
            n = sum(p.numel() for p in group["params"])
            theta[off:off + n] = sign_descent_(theta[off:off + n], grad[off:off + n], self.sign_step(group))
            off += n
        self.space.load(theta)
        return self.finish_step(closure, losses, center, plan.m), center

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        if not self.d:
            return self.idle_step(closure)
        st = self.hybrid_state
        if self.phase == "sign-rge":
            loss, center = self._sign_step(closure)
            st["steps"] += 1
            if (self.switch_step is not None and st["steps"] >= self.switch_step) or (
                    self.switch_step is None and self._plateau(center)):
                self._switch()
            return loss
        st["steps"] += 1
        return super().step(closure)


@register_builder("tt-zo")
def build_tt_zo(spec, model: nn.Module, subspace, o, run) -> HybridZO:
    """HybridZO on the parameters of a TT-parameterised model (the TT cores and the small dense tensors)."""
    if not tt_layers(model):
        raise ValueError("method 'tt-zo' trains TT cores: TT-parameterise the model first "
                         "(szo.models.tt.tt_parametrize(model, rank=...))")
    t = o.tt
    return HybridZO(list(model.parameters()), lr=o.lr, momentum=o.momentum, mu=o.mu, coords_per_step=o.coords_per_step,
                    model=model, generator=run.generator, bn_update=o.bn_update, sign_lr=t.sign_lr,
                    sign_q=t.sign_q, sign_mu=t.sign_mu, window=t.window, tol=t.tol, switch_step=t.switch_step,
                    cge=t.cge)
