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
from torch import nn
from torch.optim.adam import adam

from szo.evaluators import JVPEvaluator, check_process_group, ddp_path, jvp_closure
from szo.methods import get_method, register_builder
from szo.zo import (
    GENERATOR_COUNTERS,
    Batch,
    Field,
    ForwardOnlyBase,
    ParamSpace,
    ProbePath,
    StateCodec,
    check_hparams,
    gaussian_rows,
    heavy_ball_,
    refuse_frozen,
    unname,
)

from ..asyncfgd import split_stages, stage_tangent
from ..functional import zo as F
from ..models.forward_mode import jvp_neurons
from .subspace import COORDS, SubspaceOptimizer, check_k

__all__ = ["ForwardGradient", "SubspaceForwardGradient", "AsyncFGD", "jvp_closure"]


def _check_model(model: nn.Module | None, params: list[torch.Tensor], who: str) -> list[str]:
    if model is None:
        raise ValueError(f"{who} needs model=... (the JVP swaps dual tensors into the model's parameters)")
    named = list(model.named_parameters())
    if len(named) != len(params) or any(p is not q for (_, p), q in zip(named, params)):
        raise ValueError(f"{who} optimizes all of the model's parameters in named_parameters() order: "
                         "pass model.parameters()")
    refuse_frozen(params, model, who, "moves every parameter of its model (a forward-mode tangent over all of them)",
                  "unfreeze them, or train with a method that leaves frozen parameters out (szo-cge, zo-rge)")
    return [n for n, _ in named]


def _jvp_evaluator(model: nn.Module, names: list[str], who: str, method: str | None = "fg") -> JVPEvaluator:
    """The JVP evaluator with the LIF's forward-mode surrogate (``szo.models.forward_mode``); ``method``
    (a one-process method; None: AsyncFGD, whose stages may run on ranks of their own) is refused on a
    DistributedDataParallel model or a multi-process group, where its replicas would drift apart."""
    if method is not None:
        check_process_group(ddp_path(ProbePath(method=get_method(method)), model, who), who)
    return JVPEvaluator(model, names, who, dual_context=jvp_neurons)


class ForwardGradient(ForwardOnlyBase):
    """Full-space forward gradient descent: ``v ~ N(0, I_d)``, heavy-ball update in parameter space.

    ``opt = ForwardGradient(model.parameters(), model=model, lr=1e-3, q=1)``;
    ``loss = opt.step(lambda: loss_fn(model(x), y))``.
    """

    codecs = (StateCodec("fg", GENERATOR_COUNTERS),)  # state_dict()["fg"]: generator, forward count
    fixed_space = "every parameter of its model (the JVP swaps them all)"

    def __init__(self, params: Iterable[torch.Tensor], *, model: nn.Module, lr: float = 1e-3,
                 momentum: float = 0.9, q: int = 1, generator: torch.Generator | None = None):
        params, given = unname(list(params))  # named_parameters() pairs: torch keeps them as param_names
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        check_hparams(lr=lr, momentum=momentum, q=q)
        names = _check_model(model, params, "ForwardGradient")
        super().__init__(params if given is None else list(zip(given, params)), dict(lr=lr, momentum=momentum))
        self.model = model
        self.q = q
        self.space = ParamSpace(params)
        self.d = self.space.d
        self._init_forward_only(_jvp_evaluator(model, names, "ForwardGradient"), generator)
        self.state[params[0]]["velocity"] = torch.zeros(self.d, dtype=params[0].dtype, device=params[0].device)

    @property
    def forwards_per_step(self) -> int:
        return self.q

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        sp = self.space
        z = gaussian_rows(self.q, self.d, self.generator, dtype=torch.float32)
        with self.evaluator.session():
            losses, jvps = self.evaluator.run(closure, lambda j: sp.split(z[j].to(device=sp.device, dtype=sp.dtype)),
                                              self.q)
        g = F.forward_gradient_coefficients(jvps, z).to(device=sp.device, dtype=sp.dtype)
        group = self.param_groups[0]
        sp.add_(heavy_ball_(self.state[sp.params[0]]["velocity"], g, lr=group["lr"], momentum=group["momentum"]))
        return self.finish_step(closure, losses, sum(losses.tolist()) / self.q, self.q)


class SubspaceForwardGradient(ForwardOnlyBase, SubspaceOptimizer):
    """Forward gradient in the trajectory subspace: tangents ``P z``, ``z ~ N(0, I_k)``; SZO's eq. (6) on c.

    ``start`` as for the other subspace optimizers: ``"current"`` (this params form's default) keeps
    the parameters, ``"reference"`` moves them to ``subspace.reference`` (``build_optimizer``'s
    default for ``fg-subspace``, as for ``szo-cge`` and ``bp-subspace``)."""

    codecs = (StateCodec("subspace", COORDS + GENERATOR_COUNTERS, check=check_k),)

    def __init__(self, params: Iterable[torch.Tensor], subspace, *, model: nn.Module, lr: float = 1.0,
                 momentum: float = 0.9, q: int = 1, generator: torch.Generator | None = None,
                 start: str = "current"):
        params = list(params)
        check_hparams(q=q)
        names = _check_model(model, unname(params)[0], "SubspaceForwardGradient")
        SubspaceOptimizer.__init__(self, params, subspace, dict(lr=lr, momentum=momentum), model=model, start=start)
        self.q = q
        self._init_forward_only(_jvp_evaluator(model, names, "SubspaceForwardGradient", "fg-subspace"), generator)

    @property
    def forwards_per_step(self) -> int:
        return self.q

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        sp = self.space
        z = gaussian_rows(self.q, self.k, self.generator, dtype=torch.float64)
        with self.evaluator.session():
            losses, jvps = self.evaluator.run(
                closure, lambda j: sp.direction(z[j].to(device=sp.basis_t.device, dtype=sp.basis_t.dtype)), self.q)
        self.apply_update(F.forward_gradient_coefficients(jvps, z))
        return self.finish_step(closure, losses, sum(losses.tolist()) / self.q, self.q)


class AsyncFGD(ForwardOnlyBase):
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

    ``update="adam"`` is Algorithm 2 (AsyncFGD-Adam, the paper's experiments): "minimal changes
    on Adam by substituting the gradient with the forward-gradient estimator", i.e. Adam
    (beta1 0.9, beta2 0.999, eta 1e-8, bias-corrected) on ``g_k = (grad L . u) u_k``. The
    algorithm as printed swaps the betas in the moment updates and omits the square and the root;
    szo implements the Adam it says it is (docs/methods.md).

    State: the last ``K - 1 - k`` versions of stage ``k``'s parameters (checkpointed, so a resumed
    run continues exactly), and Adam's state (``torch.optim.Adam``). Tangents come from ``seed`` and the step index, not from a generator
    stream; ``seed`` defaults to ``generator.initial_seed()`` (the run's seed under ``fit``).
    """

    # state_dict()["asyncfgd"]: forward count, step index, stale versions
    codecs = (StateCodec("asyncfgd", GENERATOR_COUNTERS + (Field("steps", "int", default=0), Field("seed", "int"),
                                                 Field("stages", "int", "K", record_only=True),
                                                 Field("history", "versions"),
                                                 Field("adam", "plain", "adam_state", optional=True)),
                         check=lambda opt, sec: opt.check_stages(sec)),)
    fixed_space = "its model's parameters, cut into pipeline stages"

    def __init__(self, model: nn.Module, *, stages: int = 2, lr: float = 1e-3, momentum: float = 0.0,
                 seed: int | None = None, generator: torch.Generator | None = None, update: str = "sgd",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if update not in ASYNCFGD_UPDATES:
            raise ValueError(f"unknown AsyncFGD update {update!r}; valid: {', '.join(ASYNCFGD_UPDATES)}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1 and eps > 0):
            raise ValueError(f"need 0 <= beta1, beta2 < 1 and eps > 0, got betas={betas}, eps={eps}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"AsyncFGD takes the model (its children are cut into stages), got {type(model).__name__}")
        if momentum:
            raise ValueError(f"AsyncFGD takes no momentum (Algorithm 1: plain SGD; Algorithm 2: Adam's own "
                             f"moments); got momentum={momentum}: use 0")
        check_hparams(lr=lr)
        children = list(model.children())
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= len(children):
            raise ValueError(f"AsyncFGD: stages must be an integer in [1, {len(children)}] (the child modules of "
                             f"{type(model).__name__}, cut into consecutive stages), got {stages!r}")
        params = list(model.parameters())
        if not params:
            raise ValueError(f"AsyncFGD: the model ({type(model).__name__}) has no parameters to train")
        names = _check_model(model, params, "AsyncFGD")
        self.stages = split_stages(model, stages)
        where = {id(p): (k, n) for k, st in enumerate(self.stages) for n, p in st.named_parameters()}
        if len(where) != len(params) or any(id(p) not in where for p in params):
            raise ValueError("AsyncFGD cuts the model's child modules into stages: every parameter must belong to "
                             "exactly one child (no parameters on the model itself, none shared between children)")
        self._where = [where[id(p)] for p in params]
        super().__init__(params, dict(lr=lr))
        self.model = model
        self._init_forward_only(_jvp_evaluator(model, names, "AsyncFGD", None), generator)
        self.seed = int(seed) if seed is not None else int(self.generator.initial_seed())
        self.steps = 0
        self.last_jvp: float | None = None
        self._stage_spaces = [ParamSpace(list(st.parameters())) for st in self.stages]
        # history[k]: versions max(0, i - lag_k) .. i - 1 of stage k's parameters, lag_k = K - 1 - k
        self.history: list[list[list[torch.Tensor]]] = [[] for _ in self.stages]
        self.update, self.betas, self.eps = update, (float(betas[0]), float(betas[1])), float(eps)
        # Algorithm 2: torch's Adam on the forward-gradient estimate (the federated server's Adam too)
        self.adam = torch.optim.Adam(params, lr=lr, betas=self.betas, eps=self.eps) if update == "adam" else None

    @property
    def K(self) -> int:
        return len(self.stages)

    def check_stages(self, section: dict) -> None:
        """The section fits this pipeline: its number of stages, each stage's kept versions (at most its
        lag, each one tensor per parameter of the stage's shape) and Adam's state (its groups and moments
        of the parameters' shapes), all checked before anything is loaded."""
        stages = section.get("stages", self.K)
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise ValueError(f"optimizer state: asyncfgd.stages must be an integer, got {type(stages).__name__}")
        if stages != self.K:
            raise ValueError(f"optimizer state is for {stages} AsyncFGD stages, this optimizer has {self.K}")
        history = section.get("history")
        if history is not None:
            shapes = [[tuple(p.shape) for p in sp.params] for sp in self._stage_spaces]
            ok = isinstance(history, (list, tuple)) and len(history) == self.K and all(
                isinstance(vs, (list, tuple)) and len(vs) <= max(self._lag(k), 0) and all(
                    isinstance(v, (list, tuple)) and [tuple(t.shape) if isinstance(t, torch.Tensor) else None
                                                      for t in v] == shapes[k] for v in vs)
                for k, vs in enumerate(history))
            if not ok:
                raise ValueError(f"optimizer state: asyncfgd.history must hold, per stage ({self.K}), up to its lag of "
                                 "stale versions, each one tensor per parameter of the stage's shape")
        adam = section.get("adam")
        if adam is not None and self.adam is not None:
            mine = self.adam.param_groups
            groups = adam.get("param_groups") if isinstance(adam, dict) else None
            state = adam.get("state") if isinstance(adam, dict) else None
            ok = isinstance(groups, list) and isinstance(state, dict) and len(groups) == len(mine) and all(
                isinstance(g, dict) and len(g.get("params", ())) == len(m["params"]) for g, m in zip(groups, mine))
            if ok:
                params = {i: p for g, m in zip(groups, mine) for i, p in zip(g["params"], m["params"])}
                ok = all(i in params and isinstance(st, dict) and all(
                    not isinstance(v, torch.Tensor) or v.dim() == 0 or tuple(v.shape) == tuple(params[i].shape)
                    for v in st.values()) for i, st in state.items())
            if not ok:
                raise ValueError("optimizer state: asyncfgd.adam is not the state of this optimizer's Adam (its "
                                 "param groups and moments of the parameters' shapes)")

    @property
    def forwards_per_step(self) -> int:
        return 1

    def _lag(self, k: int) -> int:
        return self.K - 1 - k

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        i = self.steps
        u = [stage_tangent(st, self.seed, i, k) for k, st in enumerate(self.stages)]
        current: list[list[torch.Tensor] | None] = []
        for sp, old in zip(self._stage_spaces, self.history):
            # the oldest kept version is the one the pipeline's stage holds (version 0 before any update)
            current.append(sp.save() if old else None)
            if old:
                sp.restore(old[0])
        try:
            with self.evaluator.session():
                losses, jvps = self.evaluator.run(closure, lambda j: [u[k][n] for k, n in self._where], 1,
                                                  label="micro-batch")
        finally:
            for sp, now in zip(self._stage_spaces, current):
                if now is not None:
                    sp.restore(now)
        loss, d = float(losses[0]), float(jvps[0])
        self.last_jvp = d
        lr = float(self.param_groups[0]["lr"])  # a number, or the one-element tensor torch allows
        for k, (st, sp) in enumerate(zip(self.stages, self._stage_spaces)):
            if self._lag(k) > 0:
                self.history[k].append(current[k] if current[k] is not None else sp.save())
                del self.history[k][: -self._lag(k)]
        if self.update == "adam":
            self._adam_step(u, d, lr)
        else:
            for k, st in enumerate(self.stages):
                for n, p in st.named_parameters():
                    p.add_(u[k][n], alpha=-lr * d)  # plain SGD along the stage's tangent (Algorithm 1)
        self.steps += 1
        return self.finish_step(closure, losses, loss, 1)


    def _adam_step(self, u: list[dict[str, torch.Tensor]], d: float, lr: float) -> None:
        """Algorithm 2: Adam on the forward-gradient estimate ``g = d u`` of every parameter: torch's
        functional ``adam`` on the moments ``self.adam`` keeps (its state, created as ``Adam.step``
        creates it, and its settings), so that the step hooks fire once, for this optimizer's step,
        not again for an inner ``Adam.step`` (issue 40 item 16)."""
        params = self.param_groups[0]["params"]
        group = self.adam.param_groups[0]
        group["lr"] = lr
        for p in params:
            st = self.adam.state[p]
            if not st:  # as Adam._init_group: a CPU step counter, zero moments
                st["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                          else torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.adam.state[p] for p in params]
        adam(params, [u[k][n] * d for k, n in self._where], [s["exp_avg"] for s in states],
             [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=group["foreach"],
             capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
             decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
             beta1=group["betas"][0], beta2=group["betas"][1], lr=lr, weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"])

    @property
    def adam_state(self) -> dict | None:
        """Adam's moments and step count (``torch.optim.Adam.state_dict()``), None for plain SGD."""
        return None if self.adam is None else self.adam.state_dict()

    @adam_state.setter
    def adam_state(self, value: dict | None) -> None:
        if value is not None and self.adam is not None:
            self.adam.load_state_dict(value)


ASYNCFGD_UPDATES = ("sgd", "adam")


# ---------------------------------------------------------------------- registry builders
@register_builder("fg")
def build_fg(spec, model: nn.Module, subspace, o, run) -> ForwardGradient:
    return ForwardGradient(model.parameters(), model=model, lr=o.lr, momentum=o.momentum, q=o.q,
                           generator=run.generator)


@register_builder("fg-subspace")
def build_fg_subspace(spec, model: nn.Module, subspace, o, run) -> SubspaceForwardGradient:
    """Starts where the other subspace methods start: ``subspace.reference`` unless ``start="current"``."""
    return SubspaceForwardGradient(model.parameters(), subspace, model=model, lr=o.lr, momentum=o.momentum, q=o.q,
                                   generator=run.generator, start=run.start)


@register_builder("asyncfgd", "asyncfgd-adam")
def build_asyncfgd(spec, model: nn.Module, subspace, o, run) -> AsyncFGD:
    return AsyncFGD(model, stages=2 if o.stages is None else o.stages, lr=o.lr, momentum=o.momentum,
                    generator=run.generator, update=spec.variant or "sgd")
