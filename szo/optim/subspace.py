"""Optimizers that move the parameters inside a trajectory subspace: SZO and BP-Subspace.

Both keep the subspace coordinates ``c`` (``theta = theta_0 + P (c - c_0)``, ``c_0 = 0``) and
apply paper eq. (6) to them:

    c_{t+1} = c_t - lr_t * g_t + momentum * (c_t - c_{t-1})

Because P has orthonormal columns and every gradient estimate lies in span(P), this is
exactly eq. (6) in parameter space (``theta_{t+1} = theta_t - lr g + beta (theta_t - theta_{t-1})``
with ``g = P g_c``); tests/optim/test_szo.py checks the equivalence. Only k numbers of
optimizer state are kept (``c`` and ``delta = c_t - c_{t-1}``), which is what an on-chip
implementation would store.

The parameter layout (flat order = the order of the ``params`` given, which for
``model.parameters()`` is ``named_parameters()`` order) must match the subspace's layout.

Both take the model first, ``SZO(model, subspace, ...)``, or its parameters,
``SZO(model.parameters(), subspace, ..., model=model)`` (``szo.optim.probes``). ``start``
says where training starts: ``"reference"`` (default of the model-first form) copies
``subspace.reference`` (theta_ref: the first trajectory sample for a scratch subspace, the
last for a continual one) into the parameters, ``"current"`` (default of the params form)
keeps them. Starting a scratch subspace from anywhere else is a different experiment (on
digits: 28 % instead of 90 % after 2 epochs, issue 17).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from szo.layout import layout_from_json, layout_mismatch, param_layout

from ..functional import zo as F
from .probes import ProbeGuard, check_hparams, counter_state, load_counter_state, move_to_start, resolve_model

__all__ = ["SZO", "BPSubspace", "SubspaceOptimizer", "check_layout"]

ESTIMATORS = ("cge", "rge", "one-point")
DISTRIBUTED_MODES = (None, "data", "perturbation")


def check_layout(subspace, params: list[torch.Tensor], model: nn.Module | None = None) -> None:
    """Raise one clear ValueError if the subspace does not fit these parameters."""
    d = sum(p.numel() for p in params)
    basis = subspace.basis
    if basis.dim() != 2:
        raise ValueError(f"subspace basis must be [d, k], got shape {tuple(basis.shape)}")
    if basis.shape[1] < 1:
        raise ValueError("subspace has k = 0 directions; build it with k >= 1")
    layout = getattr(subspace, "layout", None)
    if layout:
        entries = layout_from_json(layout)
        if model is not None:
            found = param_layout(model)
        else:
            found = [(entries[i][0] if i < len(entries) else f"param[{i}]", tuple(p.shape)) for i, p in enumerate(params)]
        msg = layout_mismatch(entries, found)
        if msg is not None:
            raise ValueError(f"the subspace does not fit these parameters: {msg}")
    if basis.shape[0] != d:
        raise ValueError(f"subspace dimension d = {basis.shape[0]} does not match the parameters' d = {d}")


class SubspaceOptimizer(torch.optim.Optimizer):
    """Shared machinery: basis views per parameter, coordinate state, the eq. (6) update."""

    forward_only = False

    def __init__(self, params, subspace, defaults: dict, model: nn.Module | None = None,
                 start: str | None = None):
        model_first = isinstance(params, nn.Module)
        params, model = resolve_model(params, model, type(self).__name__)
        if isinstance(params[0], dict):
            raise ValueError("subspace optimizers take one flat list of parameters (no param groups)")
        check_hparams(lr=defaults["lr"], momentum=defaults["momentum"])
        check_layout(subspace, params, model)
        # where training starts: theta_ref for the model-first form unless told otherwise
        move_to_start(params, subspace, start or ("reference" if model_first else "current"), type(self).__name__)
        super().__init__(params, defaults)
        self.model = model
        basis = subspace.basis.detach()
        dev, dt = params[0].device, params[0].dtype
        # P^T stored row-contiguous: one direction v_i is a contiguous row of length d.
        bt = basis.t()
        self._Pt = (bt if bt.is_contiguous() else bt.contiguous()).to(device=dev, dtype=dt)
        self.k = self._Pt.shape[0]
        # per-parameter views into P^T: [k, numel]
        self._Pt_views = []
        off = 0
        for p in params:
            n = p.numel()
            self._Pt_views.append(self._Pt[:, off : off + n])
            off += n
        # Optimizer state lives here rather than in self.state: torch casts per-parameter
        # state to the parameter dtype on load, and c / delta are kept in float64.
        self.subspace_state: dict = {
            "c": torch.zeros(self.k, dtype=torch.float64),
            "delta": torch.zeros(self.k, dtype=torch.float64),
            "step": 0,
        }

    # ----- helpers -------------------------------------------------------------------
    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    @property
    def _anchor(self) -> dict:
        return self.subspace_state

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def state_dict(self):
        sd = super().state_dict()
        st = self.subspace_state
        sd["subspace"] = {"c": st["c"].clone(), "delta": st["delta"].clone(), "step": st["step"], **self._extra_state()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = dict(state_dict.pop("subspace", {}))
        super().load_state_dict(state_dict)
        if extra:
            c, delta = extra.pop("c"), extra.pop("delta")
            if c.shape != (self.k,):
                raise ValueError(f"optimizer state has k = {c.shape[0]} coordinates, this optimizer has k = {self.k}")
            self.subspace_state = {"c": c.to(torch.float64), "delta": delta.to(torch.float64), "step": int(extra.pop("step"))}
            self._load_extra_state(extra)

    @property
    def coordinates(self) -> torch.Tensor:
        """Current subspace coordinates c (float64 [k]); theta = theta_0 + P c."""
        return self._anchor["c"].clone()

    @torch.no_grad()
    def _add_direction(self, coeffs: torch.Tensor, scale: float = 1.0) -> None:
        """theta += scale * P @ coeffs, parameter by parameter."""
        coeffs = coeffs.to(self._Pt.dtype).to(self._Pt.device)
        for p, pt in zip(self._params, self._Pt_views):
            p.add_((coeffs @ pt).view_as(p), alpha=scale)

    @torch.no_grad()
    def _apply_update(self, g_c: torch.Tensor) -> None:
        """Eq. (6) in coordinates, then theta += P (c_{t+1} - c_t)."""
        group = self.param_groups[0]
        st = self._anchor
        new_delta = -group["lr"] * g_c.to(torch.float64) + group["momentum"] * st["delta"]
        st["c"] += new_delta
        st["delta"] = new_delta
        st["step"] += 1
        self._add_direction(new_delta)


class SZO(SubspaceOptimizer):
    """Subspace zeroth-order optimizer (paper eq. 5-6, Algorithm 1).

    Use it like ``torch.optim.LBFGS``::

        opt = SZO(model, subspace, mu=1.0, lr=1.0, momentum=0.9, estimator="cge")
        def closure():
            return loss_fn(model(x), y)          # forward only; called under no_grad
        loss = opt.step(closure)

    ``SZO(model, subspace)`` moves the parameters to ``subspace.reference`` (``start="current"``
    keeps them), freezes the model's BN statistics across the probes and resets its neurons
    (SpikingJelly ``functional.reset_net``) before every probe, so a model whose ``forward``
    does not reset itself gets the right update. ``SZO(model.parameters(), subspace,
    model=model)`` is the same with ``start="current"``; without ``model=`` the first step
    refuses (ValueError) a closure that runs train-mode BN or stateful neurons
    (``szo.optim.probes``).

    ``bn_update`` (``szo.optim.bn``): ``"recompute"`` (default) -- the probes leave the BN
    running statistics as they were, and after the update one unperturbed train-mode forward
    of theta_{t+1} on the same batch (the closure, called once more) updates them; it is
    counted in ``forward_passes`` / ``forwards_per_step`` and its loss is what ``step``
    returns (``last_outputs_unperturbed`` is True then). No BN layer in train mode: no extra
    forward. ``"probe-mean"`` -- the statistics become the mean over the probes and ``step``
    returns the mean probe loss (free, biased: docs/bn.md).

    * ``estimator="cge"``: 2k probes ``theta +/- mu v_i`` along the basis vectors.
    * ``estimator="rge"``: 2q probes ``theta +/- mu P z_j``, ``z_j ~ N(0, I_k)`` from ``generator``.
    * ``estimator="one-point"``: q + 1 probes, one-sided differences (paper App. F).

    ``engine="batched"`` evaluates the probes of a step as perturbed copies folded into one
    forward per ``chunk`` of probes (``szo.engine``; equal to the loop to 1e-5) instead of one
    closure call each. It needs the batch, so the closure must carry it:
    ``closure.batch = (x, y, loss_fn)`` (``szo.engine.batch_closure(model, loss_fn, x, y)``
    builds such a closure; ``szo.train.fit`` sets it). The default ``"loop"`` calls the
    closure once per probe.

    ``compile=True`` runs the model's forward through ``torch.compile``
    (``model.set_compile(True)``, see ``szo.models.compiled``): compiled once per input shape,
    no recompilation when the probes perturb the parameters in place.

    Each probe perturbs the parameters in place, calls ``closure()`` and restores them by
    copying back the saved values (bit-exact restore).

    ``distributed="data"`` (every rank: all probes on its shard of the batch, the closure
    returning the shard's share of the batch loss) or ``"perturbation"`` (every rank: probes
    ``rank, rank + W, ...`` on the full batch) runs on an initialised torch.distributed group
    (``process_group`` or the default one). Per step the m probe losses (float64) and, with BN,
    the running-statistic sums (once) are all-reduced; in data mode with ``sync_bn`` and BN in
    train mode also each BN layer's batch statistics per probe (``szo.distributed.SyncBatchNorm``),
    so that the step computes the one-process objective with the whole batch (the same numbers
    up to float summation order, docs/distributed.md). ``bytes_communicated`` counts
    these payloads; ``forward_passes`` counts forwards of the whole batch over all ranks.
    """

    forward_only = True

    def __init__(
        self,
        params,
        subspace,
        *,
        mu: float = 1.0,
        lr: float = 1.0,
        momentum: float = 0.9,
        estimator: str = "cge",
        q: int = 1,
        model: nn.Module | None = None,
        generator: torch.Generator | None = None,
        freeze_bn: bool = True,
        distributed: str | None = None,
        process_group=None,
        sync_bn: bool = True,
        engine: str = "loop",
        chunk: int | None = None,
        compile: bool = False,
        bn_update: str = "recompute",
        start: str | None = None,
    ):
        from szo.engine import ENGINES

        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
        if engine == "batched" and ((model is None and not isinstance(params, nn.Module)) or distributed is not None
                                    or not freeze_bn):
            raise ValueError("engine='batched' needs the model (SZO(model, ...)), runs in one process "
                             "(distributed=None) and keeps BN statistics frozen across the probes (freeze_bn=True); "
                             "use engine='loop'")
        if distributed not in DISTRIBUTED_MODES:
            raise ValueError(f"unknown distributed mode {distributed!r}; valid: None, 'data', 'perturbation'")
        if distributed is not None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"distributed={distributed!r} needs an initialised torch.distributed process "
                                 "group (dist.init_process_group, or launch with torchrun)")
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
        check_hparams(mu=mu, q=q if estimator != "cge" else None)
        super().__init__(params, subspace, dict(lr=lr, momentum=momentum, mu=mu), model=model, start=start)
        model = self.model
        if distributed == "data" and sync_bn and model is not None and any(
                getattr(m, "bn_time", "shared") == "per-step" for m in model.modules()):
            raise ValueError("distributed='data' with sync_bn synchronises BN statistics over the T*N samples of a "
                             "forward; per-time-step BN (bn_time='per-step') is not supported there: use "
                             "bn_time='shared', sync_bn=False or distributed='perturbation'")
        if compile:  # the probe forwards run model.forward_seq through torch.compile (szo.models.compiled)
            if model is None or not callable(getattr(model, "set_compile", None)) or engine != "loop":
                raise ValueError("compile=True compiles the model's forward: it needs model=<a szo.models.SpikingModel> "
                                 "and engine='loop' (the batched engine folds the copies itself)")
            model.set_compile(True)
        if distributed == "data" and sync_bn and getattr(model, "compile_opts", None) is not None:
            raise ValueError("distributed='data' with sync_bn synchronises BN through forward hooks, which a compiled "
                             "forward does not see: use model.set_compile(False), sync_bn=False or "
                             "distributed='perturbation'")
        self.estimator = estimator
        self.q = q
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.guard = ProbeGuard(model, "SZO", bn_update=bn_update, freeze_bn=freeze_bn)
        self.bn = self.guard.bn
        self.bn_update = self.guard.bn_update
        self.last_outputs_unperturbed = False  # the last closure call of the last step was the BN forward
        self.forward_passes = 0
        self.last_losses: torch.Tensor | None = None
        # torch.distributed: "data" = every rank evaluates all probes on its shard of the
        # batch, losses are averaged; "perturbation" = every rank evaluates a slice of the
        # probes on the full batch. Either way only the m probe losses (and BN statistics)
        # cross the network; every rank applies the identical update (same RGE generator
        # seed on all ranks), so parameters stay in sync without broadcasting weights.
        # sync_bn (data mode, model given, BN in train mode): BN layers normalise with the
        # global batch statistics (one all-reduce of 2C + 1 float64 per BN layer and probe),
        # so the data-parallel run equals the one-process run with the global batch; False
        # normalises each shard with its own statistics (fewer bytes, a different objective).
        self.distributed = distributed
        self.process_group = process_group
        self.sync_bn = bool(sync_bn)
        self.bytes_communicated = 0
        # engine="batched": all probes of a step in folded forwards (szo.engine), which needs the
        # batch itself rather than an opaque closure: the closure carries it as closure.batch
        self.engine = engine
        self._batched = None
        if engine == "batched":
            from szo.engine import make_plan_evaluator

            self._batched = make_plan_evaluator("batched", model, chunk=chunk)

    @property
    def forwards_per_step(self) -> int:
        """Forwards of the batch per step: the probes, plus one unperturbed BN forward
        (``bn_update="recompute"`` with BN in train mode)."""
        probes = {"cge": 2 * self.k, "rge": 2 * self.q, "one-point": self.q + 1}[self.estimator]
        return probes + int(self.guard.recomputes)

    def probe_plan(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Directions in coordinate space for this step: ``U [m, k]`` and ``z`` (None for CGE).

        Probes are ``theta + mu * P @ U[j]``. For CGE/RGE ``U = [+D; -D]`` (first half plus,
        second half minus); for one-point ``U = [0; Z]``.
        """
        if self.estimator == "cge":
            eye = torch.eye(self.k, dtype=torch.float64)
            return torch.cat([eye, -eye]), None
        z = F.sample_gaussian(self.q, self.k, self.generator, dtype=torch.float64)
        if self.estimator == "rge":
            return torch.cat([z, -z]), z
        return torch.cat([torch.zeros(1, self.k, dtype=torch.float64), z]), z

    def combine(self, losses: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """Gradient estimate in coordinates from the probe losses (same order as ``probe_plan``)."""
        mu = self.param_groups[0]["mu"]
        if self.estimator == "cge":
            return F.cge_coefficients(losses[: self.k], losses[self.k :], mu)
        if self.estimator == "rge":
            return F.rge_coefficients(losses[: self.q], losses[self.q :], z, mu)
        return F.forward_difference_coefficients(losses[1:], float(losses[0]), z, mu)

    @torch.no_grad()
    def evaluate_plan(self, closure: Callable[[], torch.Tensor], U: torch.Tensor) -> torch.Tensor:
        """Loss at ``theta + mu P U[j]`` for each row, parameters restored exactly afterwards."""
        mu = self.param_groups[0]["mu"]
        params = self._params
        saved = [p.detach().clone() for p in params]
        losses = torch.zeros(U.shape[0], dtype=torch.float64)
        rows = range(U.shape[0])
        sync = contextlib.nullcontext()
        if self.distributed is not None:
            import torch.distributed as dist

            from szo.distributed import SyncBatchNorm

            rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
            if self.distributed == "perturbation":
                rows = range(rank, U.shape[0], world)
            elif self.sync_bn and self.model is not None:
                sbn = SyncBatchNorm(self.model, self.process_group)
                if sbn.active:
                    sync = sbn
        # directions on the basis' device once; which rows are zero is decided on the CPU copy
        # (a per-probe .any() on a GPU tensor would synchronise the device every probe)
        U_dev = U.to(device=self._Pt.device, dtype=self._Pt.dtype)
        nonzero = U.ne(0).any(dim=1).tolist()
        self.bn.snapshot()
        try:
            with sync, self.guard.watch():
                for j in rows:
                    self.bn.restore()
                    self.guard.reset()
                    if nonzero[j]:
                        u = U_dev[j]
                        for p, s, pt in zip(params, saved, self._Pt_views):
                            torch.add(s, (u @ pt).view_as(p), alpha=mu, out=p.data)
                    else:
                        for p, s in zip(params, saved):
                            p.data.copy_(s)
                    value = closure()
                    self.forward_passes += 1
                    losses[j] = F.check_loss(value, f"closure (probe {j + 1}/{U.shape[0]})")
                    if self.guard.probe_mean:
                        self.bn.accumulate()
        except BaseException:
            self.bn.restore()
            raise
        finally:
            for p, s in zip(params, saved):
                p.data.copy_(s)
        if self.distributed is not None:
            from szo.distributed import all_reduce_

            if isinstance(sync, SyncBatchNorm):
                self.bytes_communicated += sync.bytes
            # m probe loss values per step: never a gradient or a weight tensor
            self.bytes_communicated += all_reduce_(losses, self.process_group)
            if self.distributed == "data":
                losses /= world
            else:  # count forwards of the (global) batch over all ranks, as one process would
                self.forward_passes += U.shape[0] - len(rows)
            if self.guard.probe_mean:
                self.bytes_communicated += self.bn.commit(True, self.process_group)
            else:
                self.bn.restore()
        else:  # probe-mean: the mean over the probes; recompute: as they were (the BN forward comes later)
            self.guard.end_probes()
        return losses

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("SZO.step needs a closure that runs a forward pass and returns the loss")
        U, z = self.probe_plan()
        if self._batched is not None:
            batch = getattr(closure, "batch", None)
            if batch is None:
                raise ValueError("engine='batched' needs the batch: pass szo.engine.batch_closure(model, loss_fn, x, y) "
                                 "or set closure.batch = (x, y, loss_fn)")
            losses = self._batched(self, U, batch=batch)
        else:
            losses = self.evaluate_plan(closure, U)
        self.last_losses = losses
        g_c = self.combine(losses, z)
        self._apply_update(g_c)
        self.last_outputs_unperturbed = self.guard.recomputes
        if self.last_outputs_unperturbed:
            return torch.tensor(self._bn_forward(closure))
        return torch.tensor(float(losses.mean()) if self.estimator != "one-point" else float(losses[0]))

    @torch.no_grad()
    def _bn_forward(self, closure: Callable[[], torch.Tensor]) -> float:
        """``bn_update="recompute"``: one unperturbed train-mode forward of theta_{t+1} (the BN
        running-statistics update); its loss (the batch's, all-reduced in data mode)."""
        sync, dist_bn = None, False
        if self.distributed == "data":
            from szo.distributed import SyncBatchNorm

            sbn = SyncBatchNorm(self.model, self.process_group) if self.sync_bn else None
            sync = sbn if sbn is not None and sbn.active else None
            dist_bn = sync is None  # every rank saw its shard only: average the statistics
        loss = self.guard.unperturbed_forward(closure, distributed=dist_bn, process_group=self.process_group,
                                              sync=sync)
        self.forward_passes += 1
        if self.distributed == "data":
            import torch.distributed as dist

            from szo.distributed import all_reduce_

            if sync is not None:
                self.bytes_communicated += sync.bytes
            buf = torch.tensor([loss], dtype=torch.float64)
            self.bytes_communicated += all_reduce_(buf, self.process_group)
            loss = float(buf[0]) / dist.get_world_size(self.process_group)
        return loss

    # the RGE generator is part of the optimizer state so checkpoints resume bit-exactly
    def _extra_state(self) -> dict:
        return {**counter_state(self), "bytes_communicated": self.bytes_communicated}

    def _load_extra_state(self, extra: dict) -> None:
        load_counter_state(self, extra)
        self.bytes_communicated = int(extra.get("bytes_communicated", 0))


class BPSubspace(SubspaceOptimizer):
    """BP-Subspace baseline: the BPTT gradient projected onto P, then the same eq. (6) update.

    ``loss.backward(); opt.step()`` as with any torch optimizer; gradient ``g_c = P^T grad``.
    ``BPSubspace(model, subspace)`` starts at ``subspace.reference`` as ``SZO(model, subspace)`` does.
    """

    forward_only = False

    def __init__(
        self,
        params,
        subspace,
        *,
        lr: float = 1.0,
        momentum: float = 0.9,
        model: nn.Module | None = None,
        start: str | None = None,
    ):
        super().__init__(params, subspace, dict(lr=lr, momentum=momentum), model=model, start=start)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        g_c = torch.zeros(self.k, dtype=self._Pt.dtype, device=self._Pt.device)
        for p, pt in zip(self._params, self._Pt_views):
            if p.grad is not None:
                g_c += pt @ p.grad.reshape(-1)
        self._apply_update(g_c.to(torch.float64).cpu())
        return loss
