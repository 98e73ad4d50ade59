"""Optimizers that move the parameters inside a trajectory subspace: SZO and BP-Subspace.

Both keep the subspace coordinates ``c`` (``theta = theta_0 + P (c - c_0)``, ``c_0 = 0``) and
apply paper eq. (6) to them (``szo.zo.heavy_ball_``, velocity form):

    delta_{t+1} = momentum * delta_t - lr_t * g_t,   c_{t+1} = c_t + delta_{t+1}

Because P has orthonormal columns and every gradient estimate lies in span(P), this is
exactly eq. (6) in parameter space (``theta_{t+1} = theta_t - lr g + beta (theta_t - theta_{t-1})``
with ``g = P g_c``); tests/optim/test_szo.py checks the equivalence. Only k numbers of
optimizer state are kept (``c`` and ``delta = c_t - c_{t-1}``), which is what an on-chip
implementation would store.

The parameter layout (flat order = the order of the ``params`` given, which for
``model.parameters()`` is ``named_parameters()`` order) must match the subspace's layout.

Both take the model first, ``SZO(model, subspace, ...)``, or its parameters,
``SZO(model.parameters(), subspace, ..., model=model)`` (``szo.zo.guard``). ``start``
says where training starts: ``"reference"`` (default of the model-first form) copies
``subspace.reference`` (theta_ref: the first trajectory sample for a scratch subspace, the
last for a continual one) into the parameters, ``"current"`` (default of the params form)
keeps them. Starting a scratch subspace from anywhere else is a different experiment (on
digits: 28 % instead of 90 % after 2 epochs, issue 17).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from szo.distributed import MODES as DISTRIBUTED_RUN_MODES
from szo.evaluators import build_evaluator
from szo.functional.basis import haar_basis
from szo.layout import layout_from_json, layout_mismatch, param_layout
from szo.methods import check_scale, list_methods, register_builder, step_defaults
from szo.options import probe_path
from szo.schema import DEFAULT_Q
from szo.zo import (
    ESTIMATORS,
    GENERATOR_COUNTERS,
    Batch,
    CodecOptimizer,
    Estimator,
    Field,
    ForwardOnlyBase,
    Plan,
    ProbePath,
    StateCodec,
    SubspaceSpace,
    basis_fingerprint,
    check_hparams,
    fingerprint_mismatch,
    gaussian_rows,
    get_estimator,
    heavy_ball_,
    move_to_start,
    resolve_model,
)
from szo.zo.scale import NORMALISED, coordinate_scales, normalise_, scale_record

__all__ = ["SZO", "BPSubspace", "SubspacePolicy", "Kept", "Refreshed", "subspace_policy", "SubspaceOptimizer", "check_layout", "ESTIMATORS", "DISTRIBUTED_MODES"]

DISTRIBUTED_MODES = (None,) + DISTRIBUTED_RUN_MODES


class SubspacePolicy:
    """Which basis a subspace optimizer trains on at each step: a policy ``SZO`` holds for the whole run
    (``opt.policy``) and asks before every step. ``subspace``: the entry of the first steps (its basis,
    reference, layout and eigenvalues); ``every``: steps between redraws (None: never);
    :meth:`due` says whether a redraw is due before a step and :meth:`draw` makes one. The policies:
    :class:`Kept` (a plain subspace: its basis for every step) and :class:`Refreshed`."""

    every: int | None = None

    def __init__(self, subspace):
        self.subspace = subspace

    def due(self, step: int, redraws: int) -> bool:
        """Whether a new basis is due before step ``step`` (0-based) after ``redraws`` redraws."""
        return self.every is not None and step // self.every > redraws

    def draw(self, d: int, k: int, generator: torch.Generator) -> torch.Tensor:
        """A new ``[d, k]`` basis from ``generator``."""
        raise ValueError(f"{type(self).__name__} keeps its basis: it draws none")

    def __repr__(self) -> str:
        every = "" if self.every is None else f", every={self.every}"
        return f"{type(self).__name__}({self.subspace!r}{every})"


class Kept(SubspacePolicy):
    """The stored subspace's basis for every step: what ``SZO(model, subspace)`` holds for a plain subspace."""


class Refreshed(SubspacePolicy):
    """A subspace that is redrawn: ``subspace`` for the first ``every`` steps, then a fresh Haar-random
    orthonormal basis of the same k before every ``every``-th step (SubZero's lazy refresh, T0;
    with SZO-RGE LOZO's kept-V / fresh-U sampling). ``SZO(model, Refreshed(sub, every=10))``; the
    recipes' ``szo.refresh: T0``. A policy the optimizer holds (``opt.policy``), not a stored entry:
    the redraws come from the optimizer's generator."""

    def __init__(self, subspace, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"refresh must be None (keep the basis) or a number of steps >= 1, got {every!r}")
        super().__init__(subspace)
        self.every = every

    def draw(self, d: int, k: int, generator: torch.Generator) -> torch.Tensor:
        return haar_basis(d, k, generator)


def subspace_policy(subspace, refresh: int | None = None) -> SubspacePolicy:
    """The policy of ``subspace`` (a policy given is taken as it is; a stored subspace is :class:`Kept`,
    or :class:`Refreshed` every ``refresh`` steps: a recipe's ``szo.refresh``)."""
    if isinstance(subspace, SubspacePolicy):
        if refresh is not None:
            raise ValueError(f"refresh={refresh} given with a subspace policy ({subspace!r}): give one of them")
        return subspace
    return Kept(subspace) if refresh is None else Refreshed(subspace, refresh)


def check_layout(subspace, params: list[torch.Tensor], model: nn.Module | None = None) -> None:
    """Raise one clear ValueError if the subspace does not fit these parameters."""
    if isinstance(subspace, SubspacePolicy):
        raise ValueError(f"a subspace policy ({type(subspace).__name__}) is SZO's: only SZO trains under one; pass "
                         f"the subspace itself ({type(subspace).__name__}(...).subspace) to this optimizer")
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


def _eigenvalues(subspace, scale: str) -> torch.Tensor:
    """The subspace's covariance eigenvalues, which a relative ``scale`` (the default) takes its units from."""
    try:
        return subspace.eigenvalues
    except AttributeError:
        raise ValueError(f"scale {scale!r} (the default: mu / lr in units of the subspace's spread) needs the "
                         "subspace's eigenvalues, which a subspace store entry carries; this subspace has none: "
                         "pass scale='absolute' (the paper's units, mu / lr 1.0 by default)") from None


def point_error(opt, value) -> str | None:
    """Why ``value`` cannot be the point of ``opt``'s parameters (a float ``[d]`` tensor), or None."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == opt.space.d \
            and value.is_floating_point():
        return None
    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    return (f"optimizer state: the point must be a float [d] = [{opt.space.d}] tensor (the parameters it stands at), "
            f"got {got}")


def check_k(opt, section: dict) -> None:
    """A subspace optimizer's section fits ``opt``: k coordinates, the point's shape, the basis (and
    reference point) it was made on (the fingerprint, when the state has one)."""
    c = section.get("c")
    if c is None or section.get("delta") is None:
        raise ValueError("optimizer state of a subspace optimizer needs its coordinates c and momentum delta")
    if not isinstance(c, torch.Tensor) or tuple(c.shape) != (opt.k,):
        got = f"k = {c.shape[0]}" if isinstance(c, torch.Tensor) and c.dim() == 1 else repr(c)[:80]
        raise ValueError(f"optimizer state has {got} coordinates, this optimizer has k = {opt.k}")
    if section.get("point") is not None and point_error(opt, section["point"]) is not None:
        raise ValueError(point_error(opt, section["point"]))
    why = fingerprint_mismatch(section.get("fingerprint"), opt.basis_fingerprint)
    if why is not None:
        raise ValueError(f"optimizer state does not belong to this {type(opt).__name__}'s subspace: {why}; load it into "
                         "an optimizer built on the subspace it was saved with")


COORDS = (Field("c", "float64", "subspace_state.c"), Field("delta", "float64", "subspace_state.delta"),
           Field("step", "int", "subspace_state.step"),
           Field("calibration", "plain", "subspace_state.calibration", optional=True),
           # where the parameters stand (theta_0 + P c as the steps accumulated it, in the parameters'
           # dtype): a resume puts them there in either order (SubspaceOptimizer.point); checkpoints
           # written before it have none and leave the parameters as they are
           Field("point", "tensor", "point"),
           # the basis (over the trained rows) and subspace.reference the coordinates are on, as a few numbers
           # (szo.zo.basis_fingerprint): a state is refused on another basis of the same k and layout
           Field("fingerprint", "plain", "basis_fingerprint", record_only=True))


class SubspaceOptimizer(CodecOptimizer):
    """Shared machinery: the subspace space (basis views per parameter), coordinate state, the eq. (6) update."""

    forward_only = False
    codecs = (StateCodec("subspace", COORDS, check=check_k),)
    fixed_space = "the parameters of the subspace it was built with (theta_0 + P c)"

    def __init__(self, params, subspace, defaults: dict, model: nn.Module | None = None,
                 start: str | None = None, scale: str = "absolute"):
        model_first = isinstance(params, nn.Module)
        params, model, names = resolve_model(params, model, type(self).__name__)
        if isinstance(params[0], dict):
            raise ValueError("subspace optimizers take one flat list of parameters (no param groups)")
        check_hparams(lr=defaults["lr"], momentum=defaults["momentum"])
        check_layout(subspace, params, model)
        # the coordinates' units (None: absolute, the paper's arithmetic); coordinate_scales refuses an unknown scale
        units = None if scale == "absolute" else coordinate_scales(_eigenvalues(subspace, scale), scale)
        # where training starts: theta_ref for the model-first form unless told otherwise
        move_to_start(params, subspace, start or ("reference" if model_first else "current"), type(self).__name__)
        # a frozen parameter (requires_grad=False) is never moved: its rows of P are left out
        rows = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in params])
        # every parameter frozen: torch's rule, a step that moves nothing (the closure still runs once); the
        # space keeps them all with a zero basis, so its state and state_dict are those of any subspace optimizer
        self.trains = bool(rows.any())
        if not self.trains:
            basis = torch.zeros_like(subspace.basis)
        else:
            basis = subspace.basis if bool(rows.all()) else subspace.basis[rows.to(subspace.basis.device)]
            keep = [p.requires_grad for p in params]
            params = [p for p, k in zip(params, keep) if k]
            names = None if names is None else [n for n, k in zip(names, keep) if k]
        super().__init__(params if names is None else list(zip(names, params)), defaults)
        self.model = model
        self.scale = scale
        self.units = units
        self.space = SubspaceSpace(params, basis, scales=units)
        self.initial_basis = basis  # P over the trained rows ([d, k]): the basis it was built on
        reference = getattr(subspace, "reference", None)
        self._reference = reference if isinstance(reference, torch.Tensor) else None
        self._fingerprint: dict | None = None  # basis_fingerprint, computed at the first state_dict / load
        self.k = self.space.k
        # Optimizer state lives here rather than in self.state: torch casts per-parameter
        # state to the parameter dtype on load, and c / delta are kept in float64.
        self.subspace_state: dict = {
            "c": torch.zeros(self.k, dtype=torch.float64),
            "delta": torch.zeros(self.k, dtype=torch.float64),
            "step": 0,
            # a normalised scale (szo.zo.scale.NORMALISED): the RMS gradient length of the first steps
            "calibration": {"n": 0, "sq": 0.0} if scale in NORMALISED else None,
        }

    @property
    def calibration_steps(self) -> int:
        """Steps whose estimates set a normalised scale's gradient unit (one: an exact or coordinate-wise
        estimate sees every direction in one step)."""
        return 1

    @property
    def signal_fraction(self) -> float:
        """Under a normalised scale, the factor on the normalised estimate: 1 for an estimate that is
        the gradient along every direction (BP-Subspace, CGE)."""
        return 1.0

    @property
    def scale_info(self) -> dict:
        """The units mu and lr are expressed in (results.json ``scale``: the rule, each direction's unit)."""
        return scale_record(self.scale, self.units, self.subspace_state["calibration"])

    def result_fields(self) -> dict:
        """``{"scale": ...}``: the units its mu / lr were in (``szo.zo.ReportsResults``)."""
        return {"scale": self.scale_info}

    @property
    def coordinates(self) -> torch.Tensor:
        """Current subspace coordinates c (float64 [k]); theta = theta_0 + P c."""
        return self.subspace_state["c"].clone()

    @property
    def point(self) -> torch.Tensor:
        """Where the parameters stand: a flat ``[d]`` copy in their dtype (``theta_0 + P c`` as the
        steps accumulated it). ``state_dict()`` carries it and ``load_state_dict`` puts the parameters
        back there, so a resume continues from the checkpoint's point whether the weights were loaded
        before the optimizer was built (which moves them to ``subspace.reference``) or after."""
        return self.space.flat()

    @point.setter
    def point(self, value: torch.Tensor) -> None:
        why = point_error(self, value)
        if why is not None:
            raise ValueError(why)
        self.space.load(value.to(device=self.space.device, dtype=self.space.dtype))

    @property
    def basis_fingerprint(self) -> dict:
        """The basis it was built on (over the trained rows) and ``subspace.reference``, as
        :func:`szo.zo.basis_fingerprint` writes them: ``state_dict()`` carries it and
        ``load_state_dict`` refuses a state made on another basis or reference point."""
        if self._fingerprint is None:
            self._fingerprint = basis_fingerprint(self.initial_basis, self._reference)
        return self._fingerprint

    def set_basis(self, basis: torch.Tensor) -> None:
        """The space on ``basis`` (``[d, k]``) in the same units; coordinates and momentum left as they are."""
        if tuple(basis.shape) != (self.space.d, self.k):
            raise ValueError(f"a new basis must be [d, k] = [{self.space.d}, {self.k}], got {tuple(basis.shape)}")
        self.space = SubspaceSpace(self.space.params, basis, scales=self.units)

    @torch.no_grad()
    def rebase_(self, basis: torch.Tensor) -> None:
        """Train on ``basis`` (``[d, k]``, orthonormal columns) from here on: the coordinates are re-based
        at the current point (``theta_0 := theta_t``, ``c := 0``) in the same units, and the momentum, the
        parameter-space velocity ``P S delta``, is projected onto the new basis (``delta := S^-1 P'^T P S
        delta``: LOZO's reprojection of its momentum factor at a subspace change). No parameter moves."""
        st = self.subspace_state
        velocity = st["delta"].to(self.space.basis_t) @ self.space.basis_t  # [d]: P S delta
        self.set_basis(basis)
        units_sq = 1.0 if self.units is None else self.units.pow(2)
        st["delta"] = (self.space.basis_t @ velocity).to("cpu", torch.float64) / units_sq  # rows of (P' S)^T
        st["c"] = torch.zeros(self.k, dtype=torch.float64)

    @torch.no_grad()
    def apply_update(self, g_c: torch.Tensor) -> None:
        """Eq. (6) in coordinates (heavy ball on delta), then theta += P delta."""
        group = self.param_groups[0]
        st = self.subspace_state
        g = g_c.to(torch.float64)
        if st["calibration"] is not None:  # lr is a step length in the subspace's units
            g = normalise_(st["calibration"], g, self.calibration_steps) * self.signal_fraction
        heavy_ball_(st["delta"], g, lr=group["lr"], momentum=group["momentum"])
        st["c"] += st["delta"]
        st["step"] += 1
        self.space.add_coords(st["delta"])


class SZO(ForwardOnlyBase, SubspaceOptimizer):
    """Subspace zeroth-order optimizer (paper eq. 5-6, Algorithm 1).

    Use it like ``torch.optim.LBFGS``::

        opt = SZO(model, subspace, estimator="cge")   # scale-free defaults: mu 0.3, lr 0.03 of the spread
        def closure():
            return loss_fn(model(x), y)          # forward only; called under no_grad
        loss = opt.step(closure)

    Defaults: one per setting, the ones ``build_optimizer`` and the recipes take
    (``szo.methods.step_defaults``): ``scale="trajectory"`` with ``mu=0.3`` (the probe's length) and
    ``lr=0.03`` (the first step's length), both in units of the subspace's spread, which the
    subspace's eigenvalues give (``szo.zo.scale``; docs/evidence.md, "Scale-free mu and lr"). The
    paper's absolute units are one setting away: ``scale="absolute"`` takes App. G's ``mu=1.0``,
    ``lr=1.0`` (and a subspace without eigenvalues needs it).

    ``SZO(model, subspace)`` moves the parameters to ``subspace.reference`` (``start="current"``
    keeps them), freezes the model's BN statistics across the probes and resets its neurons
    (SpikingJelly ``functional.reset_net``) before every probe, so a model whose ``forward``
    does not reset itself gets the right update. ``SZO(model.parameters(), subspace,
    model=model)`` is the same with ``start="current"``; without ``model=`` the first step
    refuses (ValueError) a closure that runs train-mode BN or stateful neurons
    (``szo.zo.guard``).

    ``bn_update`` (``szo.zo.bn``): ``"recompute"`` (default) -- the probes leave the BN
    running statistics as they were, and after the update one unperturbed train-mode forward
    of theta_{t+1} on the same batch (the closure, called once more) updates them; it is
    counted in ``forward_passes`` / ``forwards_per_step`` and its loss is what ``step``
    returns (``last_outputs_unperturbed`` is True then). No BN layer in train mode: no extra
    forward. ``"probe-mean"`` -- the statistics become the mean over the probes and ``step``
    returns the mean probe loss (free, biased: docs/bn.md).

    * ``estimator="cge"``: 2k probes ``theta +/- mu v_i`` along the basis vectors.
    * ``estimator="rge"``: 2q probes ``theta +/- mu P z_j``, ``z_j ~ N(0, I_k)`` from ``generator``.
    * ``estimator="one-point"``: q + 1 probes, one-sided differences along ``P z_j`` (szo's
      random-direction variant; method ``szo-1pt``).
    * ``estimator="coord-one-point"``: k + 1 probes, the centre and ``theta + mu v_i``: the paper's
      one-point CGE ablation (Table 13, "SZO-CGE (one-point)"; method ``szo-cge-1pt``).

    ``probes`` (``szo.zo.ProbePath``) says how the probes run and checks the combination once:
    the engine (``ProbePath(engine="batched", chunk=...)`` evaluates a step's probes as perturbed
    copies folded into one forward per ``chunk`` of probes, ``szo.evaluators``; equal to the loop to
    1e-5; it never calls the closure and needs the batch: ``opt.step(batch=Batch(x, y, loss_fn))``,
    or ``opt.step(closure, batch=...)``, ``szo.train.fit`` passes it; the default ``"loop"`` calls
    the closure once per probe), the BN statistics (``freeze_bn``,
    ``bn_update``) and the torchrun mode. The model's own forward settings (``model.set_compile``,
    ``model.set_cuda_graphs``, ``model.set_streaming``, see ``szo.models``) are read from the model
    and checked with it.

    Each probe perturbs the parameters in place, calls ``closure()`` and restores them by
    copying back the saved values (bit-exact restore).

    The second argument is a subspace or a subspace policy (:class:`SubspacePolicy`), which the
    optimizer holds as ``opt.policy`` and asks before every step: a plain subspace is :class:`Kept`.
    ``SZO(model, Refreshed(subspace, every=T0))`` (a refreshed random subspace, SubZero's lazy refresh; with ``estimator="rge"``
    LOZO's kept-V / fresh-U sampling: docs/methods.md): before steps T0, 2 T0, ... the basis is
    replaced by a Haar-random orthonormal ``[d, k]`` one (``szo.functional.basis.haar_basis``) drawn
    from ``generator``, and the coordinates are re-based there (:meth:`rebase_`: ``c := 0``, the momentum
    projected, the units kept). The given subspace is the basis of the first T0 steps. ``state_dict()``
    carries the number of redraws and the generator state before the last one (``refresh`` in the
    ``subspace`` section), from which :meth:`load_state_dict` redraws the current basis.

    ``SZO(DistributedDataParallel(model), subspace)`` runs data mode on DDP's process group by itself;
    a plain model on one rank of several processes (Lightning ``ddp`` / ``ddp_spawn``) is refused in one
    line, since its replicas would drift apart (``szo.evaluators.distributed``).
    ``ProbePath(distributed="data")`` (every rank: all probes on its shard of the batch, the closure
    returning the shard's MEAN loss; the step averages the ranks' losses, so unequal shards weight
    their mean by ``W * n_shard / n``) or ``"perturbation"`` (every rank: probes
    ``rank, rank + W, ...`` on the full batch) runs on an initialised torch.distributed group
    (``process_group`` or the default one). Per step the m probe losses (float64) and, with BN,
    the running-statistic sums (once) are all-reduced; in data mode with ``sync_bn`` and BN in
    train mode also each BN layer's batch statistics per probe (``szo.distributed.SyncBatchNorm``),
    so that the step computes the one-process objective with the whole batch (the same numbers
    up to float summation order, docs/distributed.md). ``bytes_communicated`` counts
    these payloads; ``forward_passes`` counts forwards of the whole batch over all ranks.
    """

    codecs = (StateCodec("subspace", COORDS + GENERATOR_COUNTERS + (
        Field("bytes_communicated", "int", default=0),
        # refresh=T0 only: {"count": redraws so far, "draw_state": the generator's state before the last one}
        Field("refresh", "plain", "refresh_state", optional=True)), check=check_k),)

    def __init__(
        self,
        params,
        subspace,
        *,
        mu: float | None = None,
        lr: float | None = None,
        momentum: float = 0.9,
        estimator: str | Estimator = "cge",
        q: int = DEFAULT_Q["train"],
        model: nn.Module | None = None,
        generator: torch.Generator | None = None,
        start: str | None = None,
        scale: str | None = None,
        probes: ProbePath | None = None,
    ):
        # which basis each step trains on: a policy held for the run (Kept: the stored one; Refreshed: redrawn)
        self.policy = subspace_policy(subspace)
        if self.policy.every is not None and generator is not None and generator.device.type != "cpu":
            raise ValueError("refresh draws the new bases from the generator on the CPU: pass a CPU torch.Generator")
        kind = estimator if isinstance(estimator, Estimator) else get_estimator(estimator)
        # scale / mu / lr left None: the defaults build_optimizer and the recipes take (szo.methods.step_defaults)
        # of the method with this estimator (the SZO methods' shared ones for an estimator of one's own)
        methods = list_methods(family="subspace-zo", variant=kind.name) or list_methods(family="subspace-zo")
        check_scale(methods, scale)
        scale, mu, lr = step_defaults(methods, scale, mu, lr)
        check_hparams(mu=mu, q=None if kind.coordinate else q)
        SubspaceOptimizer.__init__(self, params, self.policy.subspace, dict(lr=lr, momentum=momentum, mu=mu),
                                   model=model, start=start, scale=scale)
        self.estimator = kind.name
        self.kind = kind
        self.q = q
        # how the probes run (the loop, the batched engine, torch.distributed: "data" = every rank
        # evaluates all probes on its shard of the batch, "perturbation" = a slice of the probes on the
        # full batch; either way only the m probe losses and BN statistics cross the network and every
        # rank applies the identical update), every combination checked by the record
        self.probes = ProbePath() if probes is None else probes
        self._init_forward_only(build_evaluator(self.probes, self.model, "SZO"), generator)

        self.refresh_state: dict | None = None if self.policy.every is None else {"count": 0, "draw_state": None}

    @property
    def refresh(self) -> int | None:
        """Steps between redraws of the basis (its policy's ``every``; None: the basis is kept)."""
        return self.policy.every

    @property
    def engine(self) -> str:
        """The probe engine its path runs (``self.probes.engine``: ``loop`` or ``batched``)."""
        return self.probes.engine

    @property
    def forwards_per_step(self) -> int:
        """Forwards of the batch per step: the probes, plus one unperturbed BN forward
        (``bn_update="recompute"`` with BN in train mode)."""
        return self.kind.probes(self.k, self.q) + int(self.recomputes)

    @property
    def calibration_steps(self) -> int:
        return self.kind.calibration_steps(self.k, self.q)

    @property
    def signal_fraction(self) -> float:
        return self.kind.signal_fraction(self.k, self.q)

    def plan(self) -> Plan:
        """This step's probes (draws the RGE / one-point directions from ``generator``).

        CGE: ``+mu v_i`` for all i, then ``-mu v_i``; RGE: ``+mu P z_j`` for all j, then
        ``-mu P z_j``; one-point: the centre, then ``+mu P z_j``; coordinate one-point: the
        centre, then ``+mu v_i`` for all i.
        """
        mu = self.param_groups[0]["mu"]
        if self.kind.coordinate:
            return self.kind.plan(self.k, mu)
        z = gaussian_rows(self.q, self.k, self.generator)
        if self.units is not None:  # relative scale: mu is the probe's length in units, as for CGE (E|z|^2 = k)
            mu = mu / math.sqrt(self.k)
        return self.kind.plan(mu=mu, z=z)

    def probe_plan(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's probes as ``(U [m, k], z)`` (``theta + mu P U[j]``; ``z`` None for CGE)."""
        plan = self.plan()
        return plan.dense(), None if self.kind.coordinate else plan.directions

    @torch.no_grad()
    def evaluate(self, closure: Callable[[], torch.Tensor], plan: Plan, batch: Batch | None = None) -> torch.Tensor:
        """The losses of ``plan``'s probes with this optimizer's evaluator (a step's probe phase:
        BN statistics handled as ``bn_update`` says; ``batch``: the step's, which the batched engine
        folds the probes over), the parameters restored exactly afterwards."""
        with self.evaluator.session():
            return self.evaluator.run(closure, self.space, plan, batch=batch)

    def _draw_basis(self, generator: torch.Generator) -> torch.Tensor:
        return self.policy.draw(self.space.d, self.k, generator)

    @torch.no_grad()
    def refresh_basis(self) -> None:
        """Redraw the basis now (what ``Refreshed(subspace, every=T0)`` does before every T0-th step): a Haar-random one from
        ``generator``, the coordinates re-based at the current point (:meth:`rebase_`)."""
        if self.refresh_state is None:
            raise ValueError("refresh_basis needs an SZO built on Refreshed(subspace, every=T0) (steps between redraws)")
        state = self.generator.get_state()
        self.rebase_(self._draw_basis(self.generator))
        self.refresh_state = {"count": self.refresh_state["count"] + 1, "draw_state": state}

    def _prepare_load(self, sections: dict) -> torch.Tensor | None:
        """A :class:`Refreshed` subspace: the basis of the state being loaded, checked before anything
        changes -- the first one before any redraw, else the last redraw again, from the generator state
        saved before it (a corrupt one is refused in one line, nothing loaded)."""
        refresh = sections.get("subspace", {}).get("refresh")
        if self.refresh_state is None:
            if refresh is not None:
                raise ValueError("optimizer state was saved by an SZO on a Refreshed subspace (a basis redrawn every "
                                 "few steps); this one keeps its basis: build it on Refreshed(subspace, every=T0)")
            return None
        refresh = self.refresh_state if refresh is None else refresh
        if not isinstance(refresh, dict) or isinstance(refresh.get("count"), bool) or not isinstance(
                refresh.get("count"), int) or refresh["count"] < 0:
            raise ValueError("optimizer state: subspace.refresh must be {'count': redraws so far (an int >= 0), "
                             f"'draw_state': the generator state before the last one}}, got {refresh!r:.200}")
        saved = refresh.get("draw_state")
        if saved is None:
            return self.initial_basis
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"optimizer state: subspace.refresh.draw_state must be a torch.Generator state (a uint8 "
                             f"tensor), got {type(saved).__name__}")
        try:
            g = torch.Generator().set_state(saved.to(torch.uint8))
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"optimizer state: subspace.refresh.draw_state is not a state of a torch.Generator on "
                             f"cpu ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return self._draw_basis(g)

    def _finish_load(self, basis: torch.Tensor | None) -> None:
        if basis is not None:
            self.set_basis(basis)  # the saved coordinates and momentum are already in its units

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        if not self.trains:
            return self.idle_step(closure)
        if self.refresh_state is not None and self.policy.due(self.subspace_state["step"], self.refresh_state["count"]):
            self.refresh_basis()
        plan = self.plan()
        losses = self.evaluate(closure, plan, batch)
        self.apply_update(plan.estimate(losses))
        fallback = self.kind.step_loss(losses)
        return self.finish_step(closure, losses, fallback, plan.m)


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
        lr: float | None = None,
        momentum: float = 0.9,
        model: nn.Module | None = None,
        start: str | None = None,
        scale: str | None = None,
    ):
        methods = list_methods(subspace=True, backprop=True)  # its record: the defaults build_optimizer takes
        check_scale(methods, scale)
        scale, _, lr = step_defaults(methods, scale, None, lr)
        super().__init__(params, subspace, dict(lr=lr, momentum=momentum), model=model, start=start, scale=scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.trains:  # every parameter frozen: nothing moves (torch's rule)
            return loss
        g_c = self.space.project([p.grad for p in self.space.params])
        self.apply_update(g_c.to(torch.float64).cpu())
        self.count_step()
        return loss


# ---------------------------------------------------------------------- registry builders
@register_builder("bp-subspace")
def build_bp_subspace(spec, model: nn.Module, subspace, o, run) -> BPSubspace:
    return BPSubspace(model, subspace, lr=o.lr, momentum=o.momentum, start=run.start, scale=o.scale)


@register_builder("szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt")
def build_szo(spec, model: nn.Module, subspace, o, run) -> SZO:
    """SZO with the method's estimator (``spec.variant``: cge, rge, one-point, coord-one-point)."""
    return SZO(model, subspace_policy(subspace, o.refresh), mu=o.mu, lr=o.lr, momentum=o.momentum, estimator=spec.variant, q=o.q,
               generator=run.generator, start=run.start, scale=o.scale, probes=probe_path(o, run, spec))
