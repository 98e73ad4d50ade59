"""Forward-gradient optimizers (FGD: Baydin et al. 2022; AsyncFGD, seed 001 eq. 3): full space and subspace.

One step draws q seeded tangents ``v_j`` and runs q forward passes with forward-mode AD
(``torch.autograd.forward_ad`` dual tensors swapped into the model with
``torch.func.functional_call``), each giving the loss and its directional derivative
``grad L . v_j`` through the surrogate (``szo.models.forward_mode``); the estimate is
``g = (1/q) sum_j (grad L . v_j) v_j`` (``szo.functional.zo.forward_gradient_coefficients``).

* ``ForwardGradient``: ``v ~ N(0, I_d)`` over all d parameters (``method=fg``).
* ``SubspaceForwardGradient``: ``v = P z``, ``z ~ N(0, I_k)`` in the trajectory subspace
  (``method=fg-subspace``); the update is SZO's eq. (6) on the k coordinates.
* ``AsyncFGD``: the iterates of AsyncFGD's K-stage asynchronous pipeline (seed 001,
  Algorithm 1) in one process (``method=asyncfgd``): every stage runs with the parameters the
  pipeline's stage would hold, ``K - 1 - k`` updates stale; plain SGD. The pipeline itself,
  one process per stage and its speed-up, is ``szo.asyncfgd`` / ``bench/asyncfgd.py``.

Why dual tensors rather than ``torch.func.jvp``: a training forward mutates buffers in place
(BN running statistics, LIF membrane state), which ``torch.func.jvp`` forbids for captured
tensors; with dual tensors the model's ordinary forward runs unchanged and the result is the
same JVP (tests/optim/test_fg.py checks it against autograd to 1e-5).

Counting: one JVP pass is one forward pass in ``forward_passes`` (#FP); it computes the
tangent alongside the primal, so it costs more than a plain forward (docs/methods.md gives
the measured ratio). No backward pass, no stored activations. BN statistics are handled as
in SZO (``BNStatsFreezer``: q passes, running statistics averaged over them, committed once).

The closure is the usual forward-only closure (``loss_fn(model(x), y)``, no backward); it
is called inside the dual-tensor context, so it must not detach the loss.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.autograd.forward_ad as fwAD
from spikingjelly.activation_based import functional as sjf
from torch import nn
from torch.func import functional_call

from ..asyncfgd import split_stages, stage_tangent
from ..functional import zo as F
from ..models.forward_mode import jvp_neurons
from .bn import BNStatsFreezer
from .probes import CounterStateMixin, check_hparams, counter_state, load_counter_state
from .subspace import SubspaceOptimizer

__all__ = ["ForwardGradient", "SubspaceForwardGradient", "AsyncFGD", "jvp_closure"]


class _CallClosure(nn.Module):
    """``functional_call`` target: holds the model, its forward calls the user's closure."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, closure):
        return closure()


def _check_model(model: nn.Module | None, params: list[torch.Tensor], who: str) -> list[str]:
    if model is None:
        raise ValueError(f"{who} needs model=... (the JVP swaps dual tensors into the model's parameters)")
    named = list(model.named_parameters())
    if len(named) != len(params) or any(p is not q for (_, p), q in zip(named, params)):
        raise ValueError(f"{who} optimizes all of the model's parameters in named_parameters() order: "
                         "pass model.parameters()")
    return [n for n, _ in named]


def jvp_closure(model: nn.Module, names: list[str], closure: Callable[[], torch.Tensor],
                tangents: list[torch.Tensor], where: str = "closure") -> tuple[float, float]:
    """``(L(theta), grad L . v)`` from one forward pass with tangent ``v`` (one tensor per parameter)."""
    if getattr(model, "time_chunk", None) is not None:
        raise ValueError("forward gradients need the multi-step forward: the JVP through a time-chunked "
                         "(streaming) forward is not exact; call model.set_streaming(None)")
    wrapper = _CallClosure(model)
    with jvp_neurons(model), fwAD.dual_level():
        duals = {f"model.{n}": fwAD.make_dual(p.detach(), t.to(p.dtype))
                 for n, p, t in zip(names, model.parameters(), tangents)}
        value = functional_call(wrapper, duals, (closure,))
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where} must return the loss as a tensor for a forward gradient, "
                             f"got {type(value).__name__}")
        primal, tangent = fwAD.unpack_dual(value)
        loss = F.check_loss(primal, where)
        if tangent is None:
            raise ValueError(f"{where}'s loss does not depend on the parameters in forward mode "
                             "(did the closure detach it or call .item()?)")
        return loss, F.check_loss(tangent, f"{where} (directional derivative)")


def _jvp_passes(opt, closure: Callable[[], torch.Tensor],
                tangents: Callable[[int], list[torch.Tensor]]) -> tuple[list[float], torch.Tensor]:
    """``opt.q`` JVP passes (losses, directional derivatives), BN statistics handled as in SZO."""
    jvps = torch.empty(opt.q, dtype=torch.float64)
    losses = []
    opt.bn.snapshot()
    try:
        for j in range(opt.q):
            opt.bn.restore()
            lj, jvps[j] = jvp_closure(opt.model, opt._names, closure, tangents(j), f"closure (tangent {j + 1}/{opt.q})")
            opt.forward_passes += 1
            losses.append(lj)
            opt.bn.accumulate()
    except BaseException:
        opt.bn.restore()
        raise
    opt.bn.commit()
    return losses, jvps


class ForwardGradient(CounterStateMixin, torch.optim.Optimizer):
    """Full-space forward gradient descent: ``v ~ N(0, I_d)``, heavy-ball update in parameter space.

    ``opt = ForwardGradient(model.parameters(), model=model, lr=1e-3, q=1)``;
    ``loss = opt.step(lambda: loss_fn(model(x), y))``.
    """

    _state_key = "fg"  # state_dict()["fg"]: generator, forward count

    forward_only = True

    def __init__(self, params: Iterable[torch.Tensor], *, model: nn.Module, lr: float = 1e-3,
                 momentum: float = 0.9, q: int = 1, generator: torch.Generator | None = None):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        check_hparams(lr=lr, momentum=momentum, q=q)
        self._names = _check_model(model, params, "ForwardGradient")
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.model = model
        self.q = q
        self.d = sum(p.numel() for p in params)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.bn = BNStatsFreezer(model)
        self.forward_passes = 0
        self.state[params[0]]["velocity"] = torch.zeros(self.d, dtype=params[0].dtype, device=params[0].device)

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    @property
    def forwards_per_step(self) -> int:
        return self.q

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for p in self._params:
            out.append(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("ForwardGradient.step needs a closure that runs a forward pass and returns the loss")
        p0 = self._params[0]
        z = F.sample_gaussian(self.q, self.d, self.generator, dtype=torch.float32)
        losses, jvps = _jvp_passes(self, closure, lambda j: self._split(z[j].to(device=p0.device, dtype=p0.dtype)))
        g = F.forward_gradient_coefficients(jvps, z).to(device=p0.device, dtype=p0.dtype)
        group = self.param_groups[0]
        vel = self.state[p0]["velocity"]
        vel.mul_(group["momentum"]).add_(g, alpha=-group["lr"])
        for p, dv in zip(self._params, self._split(vel)):
            p.add_(dv)
        return torch.tensor(sum(losses) / len(losses))



class SubspaceForwardGradient(SubspaceOptimizer):
    """Forward gradient in the trajectory subspace: tangents ``P z``, ``z ~ N(0, I_k)``; SZO's eq. (6) on c."""

    forward_only = True

    def __init__(self, params: Iterable[torch.Tensor], subspace, *, model: nn.Module, lr: float = 1.0,
                 momentum: float = 0.9, q: int = 1, generator: torch.Generator | None = None):
        params = list(params)
        check_hparams(q=q)
        names = _check_model(model, params, "SubspaceForwardGradient")
        super().__init__(params, subspace, dict(lr=lr, momentum=momentum), model=model)
        self._names = names
        self.q = q
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.bn = BNStatsFreezer(model)
        self.forward_passes = 0

    @property
    def forwards_per_step(self) -> int:
        return self.q

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("SubspaceForwardGradient.step needs a closure that runs a forward pass and returns "
                             "the loss")
        z = F.sample_gaussian(self.q, self.k, self.generator, dtype=torch.float64)

        def tangents(j: int) -> list[torch.Tensor]:
            u = z[j].to(device=self._Pt.device, dtype=self._Pt.dtype)
            return [(u @ pt).view_as(p) for p, pt in zip(self._params, self._Pt_views)]

        losses, jvps = _jvp_passes(self, closure, tangents)
        self._apply_update(F.forward_gradient_coefficients(jvps, z))
        return torch.tensor(sum(losses) / len(losses))

    def _extra_state(self) -> dict:
        return counter_state(self)

    def _load_extra_state(self, extra: dict) -> None:
        load_counter_state(self, extra)


class AsyncFGD(CounterStateMixin, torch.optim.Optimizer):
    """AsyncFGD (seed 001, Algorithm 1) as the K-stage pipeline computes it, in one process.

    The model's children, in registration order, are cut into ``stages`` = K consecutive stages
    with even parameter counts (``szo.asyncfgd.split_stages``). Step ``i`` (micro-batch ``i``)
    runs one JVP pass (``jvp_closure``) in which stage ``k`` holds its parameters after
    ``max(0, i + k - K + 1)`` updates, i.e. ``K - 1 - k`` updates stale, with the tangent
    ``u_k(i)`` of ``szo.asyncfgd.stage_tangent``; then every stage takes the plain SGD step
    ``w_k <- w_k - lr * (grad L . u(i)) * u_k(i)`` (no momentum: Algorithm 1). These are the
    iterates of ``szo.asyncfgd.run_stage`` on K processes (both are tested against
    ``reference_async_fgd``); one process gives the staleness's effect on training, not the
    pipeline's speed-up (``bench/asyncfgd.py`` measures that). ``stages=1`` is vanilla FGD.

    State: the last ``K - 1 - k`` versions of stage ``k``'s parameters (checkpointed, so a resumed
    run continues exactly). Tangents come from ``seed`` and the step index, not from a generator
    stream; ``seed`` defaults to ``generator.initial_seed()`` (the run's seed under ``fit``).
    """

    _state_key = "asyncfgd"  # state_dict()["asyncfgd"]: forward count, step index, stale versions

    forward_only = True

    def __init__(self, model: nn.Module, *, stages: int = 2, lr: float = 1e-3, momentum: float = 0.0,
                 seed: int | None = None, generator: torch.Generator | None = None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"AsyncFGD takes the model (its children are cut into stages), got {type(model).__name__}")
        if momentum:
            raise ValueError(f"AsyncFGD is plain SGD (seed 001, Algorithm 1: the pipeline keeps no optimizer "
                             f"state); got momentum={momentum}: use 0")
        check_hparams(lr=lr)
        children = list(model.children())
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= len(children):
            raise ValueError(f"AsyncFGD: stages must be an integer in [1, {len(children)}] (the child modules of "
                             f"{type(model).__name__}, cut into consecutive stages), got {stages!r}")
        params = list(model.parameters())
        if not params:
            raise ValueError(f"AsyncFGD: the model ({type(model).__name__}) has no parameters to train")
        self._names = _check_model(model, params, "AsyncFGD")
        self.stages = split_stages(model, stages)
        where = {id(p): (k, n) for k, st in enumerate(self.stages) for n, p in st.named_parameters()}
        if len(where) != len(params) or any(id(p) not in where for p in params):
            raise ValueError("AsyncFGD cuts the model's child modules into stages: every parameter must belong to "
                             "exactly one child (no parameters on the model itself, none shared between children)")
        self._where = [where[id(p)] for p in params]
        super().__init__(params, dict(lr=lr))
        self.model = model
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.seed = int(seed) if seed is not None else int(self.generator.initial_seed())
        self.steps = 0
        self.forward_passes = 0
        self.last_losses: torch.Tensor | None = None
        self.last_jvp: float | None = None
        self._stage_params = [list(st.parameters()) for st in self.stages]
        # history[k]: versions max(0, i - lag_k) .. i - 1 of stage k's parameters, lag_k = K - 1 - k
        self.history: list[list[list[torch.Tensor]]] = [[] for _ in self.stages]

    @property
    def K(self) -> int:
        return len(self.stages)

    @property
    def forwards_per_step(self) -> int:
        return 1

    def _lag(self, k: int) -> int:
        return self.K - 1 - k

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("AsyncFGD.step needs a closure that runs a forward pass and returns the loss")
        i = self.steps
        u = [stage_tangent(st, self.seed, i, k) for k, st in enumerate(self.stages)]
        current: list[list[torch.Tensor] | None] = []
        for ps, old in zip(self._stage_params, self.history):
            # the oldest kept version is the one the pipeline's stage holds (version 0 before any update)
            current.append([p.detach().clone() for p in ps] if old else None)
            for p, v in zip(ps, old[0] if old else ()):
                p.copy_(v)
        try:
            sjf.reset_net(self.model)
            loss, d = jvp_closure(self.model, self._names, closure, [u[k][n] for k, n in self._where],
                                  f"closure (micro-batch {i})")
        finally:
            for ps, now in zip(self._stage_params, current):
                for p, v in zip(ps, now or ()):
                    p.copy_(v)
        self.forward_passes += 1
        self.last_losses = torch.tensor([loss], dtype=torch.float64)  # L of micro-batch i, stale stages
        self.last_jvp = d
        lr = self.param_groups[0]["lr"]
        for k, (st, ps) in enumerate(zip(self.stages, self._stage_params)):
            if self._lag(k) > 0:
                self.history[k].append(current[k] if current[k] is not None else [p.detach().clone() for p in ps])
                del self.history[k][: -self._lag(k)]
            for n, p in st.named_parameters():
                p.add_(u[k][n], alpha=-lr * d)
        self.steps += 1
        return torch.tensor(loss)

    def _extra_state(self) -> dict:
        return {"steps": self.steps, "seed": self.seed, "stages": self.K,
                "history": [[[t.clone() for t in v] for v in h] for h in self.history]}

    def _load_extra_state(self, extra: dict) -> None:
        if "stages" in extra and int(extra["stages"]) != self.K:
            raise ValueError(f"optimizer state is for {int(extra['stages'])} AsyncFGD stages, this optimizer has {self.K}")
        self.steps = int(extra.get("steps", 0))
        self.seed = int(extra.get("seed", self.seed))
        self.history = [[[t.clone() for t in v] for v in h] for h in extra.get("history", [[] for _ in self.stages])]
