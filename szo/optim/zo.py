"""Full-space zeroth-order baselines (no subspace): DeepZero-style CGE and Gaussian RGE in R^d.

These are the methods the paper shows failing on SNNs (Sec. 3, Figure 1). For a fair
comparison at a fixed forward-pass budget, CGE perturbs ``coords_per_step`` coordinates
drawn uniformly without replacement each step (sparse CGE as in DeepZero; ``None`` = all d
coordinates, 2d forwards per step), and RGE uses ``q`` Gaussian directions ``z ~ N(0, I_d)``.
The update is eq. (6) in parameter space (velocity form heavy ball).

``FullSpaceZO(model, ...)`` or ``FullSpaceZO(model.parameters(), ..., model=model)``; BN
freezing, neuron resets before every probe and ``bn_update`` as for ``szo.optim.SZO``
(``szo.optim.probes``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .probes import CounterStateMixin, ProbeGuard, check_hparams, load_flat, resolve_model

__all__ = ["FullSpaceZO"]


class FullSpaceZO(CounterStateMixin, torch.optim.Optimizer):
    """Forward-only full-space ZO optimizer (``estimator="cge"`` or ``"rge"``)."""

    forward_only = True

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
        if estimator not in ("cge", "rge"):
            raise ValueError(f"unknown estimator {estimator!r}; valid: cge, rge")
        check_hparams(lr=lr, momentum=momentum, mu=mu, q=q if estimator == "rge" else None)
        params, model = resolve_model(params, model, "FullSpaceZO")
        super().__init__(params, dict(lr=lr, momentum=momentum, mu=mu))
        self.d = sum(p.numel() for p in params)
        if coords_per_step is not None and not 1 <= coords_per_step <= self.d:
            raise ValueError(f"coords_per_step must be in [1, d={self.d}], got {coords_per_step}")
        self.estimator = estimator
        self.q = q
        self.coords_per_step = coords_per_step
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.model = model
        self.guard = ProbeGuard(model, "FullSpaceZO", bn_update=bn_update)
        self.bn = self.guard.bn
        self.bn_update = self.guard.bn_update
        self.last_outputs_unperturbed = False
        self.forward_passes = 0
        self.last_losses: torch.Tensor | None = None  # the probe losses of the last step (at theta_t)
        anchor = self.state[params[0]]
        anchor["velocity"] = torch.zeros(self.d, dtype=params[0].dtype, device=params[0].device)

    @property
    def _params(self):
        return self.param_groups[0]["params"]

    @property
    def forwards_per_step(self) -> int:
        """Probe forwards per step, plus one unperturbed BN forward under ``bn_update="recompute"``."""
        extra = int(self.guard.recomputes)
        if self.estimator == "rge":
            return 2 * self.q + extra
        return 2 * (self.coords_per_step or self.d) + extra

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _load(self, vec: torch.Tensor) -> None:
        load_flat(self._params, vec)

    @torch.no_grad()
    def _loss_at(self, closure, vec: torch.Tensor, j: int, m: int) -> float:
        self._load(vec)
        self.forward_passes += 1
        return self.guard.probe(closure, f"closure (probe {j + 1}/{m})")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("FullSpaceZO.step needs a closure that runs a forward pass and returns the loss")
        group = self.param_groups[0]
        mu = group["mu"]
        theta = self._flat()
        grad = torch.zeros_like(theta)
        losses = []
        self.bn.snapshot()
        try:
            if self.estimator == "cge":
                n = self.coords_per_step or self.d
                idx = (
                    torch.randperm(self.d, generator=self.generator)[:n]
                    if n < self.d
                    else torch.arange(self.d)
                ).to(theta.device)
                probe = theta.clone()
                for j, i in enumerate(idx.tolist()):
                    probe[i] = theta[i] + mu
                    lp = self._loss_at(closure, probe, 2 * j, 2 * n)
                    probe[i] = theta[i] - mu
                    lm = self._loss_at(closure, probe, 2 * j + 1, 2 * n)
                    probe[i] = theta[i]
                    grad[i] = (lp - lm) / (2 * mu)
                    losses += [lp, lm]
            else:
                for j in range(self.q):
                    z = torch.randn(self.d, generator=self.generator).to(theta)
                    lp = self._loss_at(closure, theta + mu * z, 2 * j, 2 * self.q)
                    lm = self._loss_at(closure, theta - mu * z, 2 * j + 1, 2 * self.q)
                    grad.add_(z, alpha=(lp - lm) / (2 * mu) / self.q)
                    losses += [lp, lm]
        except BaseException:
            self.bn.restore()
            self._load(theta)
            raise
        self.guard.end_probes()
        vel = self.state[self._params[0]]["velocity"]
        vel.mul_(group["momentum"]).add_(grad, alpha=-group["lr"])
        self._load(theta + vel)
        return self.guard.finish_step(self, closure, losses, sum(losses) / len(losses))

