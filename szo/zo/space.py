"""Spaces: which numbers a forward-only method moves, and the one place flat <-> tensors happens.

A *space* is where probe directions live and where the update lands:

* :class:`ParamSpace` -- parameters as one flat vector of dimension d (the order of the
  parameters given: ``named_parameters()`` order for ``model.parameters()``). Full-space ZO,
  forward gradient, and -- over one layer's parameters -- the layer-wise weight perturbation.
* :class:`SubspaceSpace` -- ``theta = theta_0 + P c`` for a basis ``P [d, k]`` (SZO, BP-Subspace,
  the subspace forward gradient). ``basis_t`` (``P^T``, row-contiguous ``[k, d]``) and
  ``basis_views`` (its ``[k, numel]`` column blocks per parameter) are public: the batched and
  distributed evaluators use them.
* :class:`NodeSpace` -- the pre-activations of one layer (node perturbation): a probe adds its
  direction to the layer's output through a forward hook, no parameter moves.
* :class:`HostSpace` -- float64 host coordinates mapped to the model's float32 parameters
  (``theta = origin + P c``, loaded on every move): the integer on-chip learner (``c`` in fixed
  point) and a federated client (the server's coordinates). Its ``to_params`` decides the map.

Every space gives a :class:`Mover` for a :class:`~szo.zo.plans.Plan`: ``move(j)`` puts the model at
probe ``j`` (``theta + sign_j mu D[index_j]``, or back to ``theta`` for a centre probe) and
``restore()`` puts the exact saved values back. The arithmetic of a move is the space's own and is
documented at each class: changing it changes results bit for bit (tests/optim/test_golden.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from ..precision import exact_fp32
from .plans import Coordinates, Plan

__all__ = ["basis_fingerprint", "fingerprint_mismatch", "Space", "Mover", "ParamSpace", "SubspaceSpace", "NodeSpace", "HostSpace", "Still", "START_POINTS", "adaptive_perturbation",
           "move_to_start", "trainable_layers", "LAYER_TYPES", "frozen", "refuse_frozen",
           "refuse_shared_weights"]

START_POINTS: tuple[str, ...] = ("reference", "current")


class Mover(Protocol):
    """Moves the model to the probes of one plan and back."""

    def move(self, j: int) -> None: ...

    def restore(self) -> None: ...


class Space(Protocol):
    """Where a plan's directions live: ``mover(plan)`` saves the current point and returns a :class:`Mover`."""

    def mover(self, plan: Plan) -> Mover: ...


class ParamSpace:
    """A list of parameter tensors seen as one flat vector (d entries, the tensors' order, row-major)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)  # may be empty (e.g. a pipeline stage without parameters)
        self.sizes = [p.numel() for p in self.params]
        self.d = sum(self.sizes)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------------ flat <-> tensors
    def flat(self) -> torch.Tensor:
        """A new 1-D tensor ``[d]`` holding the parameters' values."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat ``[d]`` tensor shaped like each parameter."""
        if flat.dim() != 1 or flat.numel() != self.d:
            raise ValueError(f"expected a flat tensor of d = {self.d} entries, got shape {tuple(flat.shape)}")
        return [chunk.view_as(p) for chunk, p in zip(flat.split(self.sizes), self.params)]

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        """Copy a flat vector into the parameters in place (their storage stays theirs, unlike
        ``torch.nn.utils.vector_to_parameters``, which re-points ``.data``)."""
        for p, v in zip(self.params, self.split(flat)):
            p.copy_(v)

    def save(self) -> list[torch.Tensor]:
        """Exact copies of the parameters (what a restore puts back)."""
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        for p, s in zip(self.params, saved):
            p.copy_(s)

    # ------------------------------------------------------------------ updates
    @torch.no_grad()
    def add_(self, flat: torch.Tensor, alpha: float = 1.0) -> None:
        """``theta += alpha * flat`` (``alpha = 1``: one rounding per entry, as ``theta + flat``)."""
        for p, v in zip(self.params, self.split(flat.to(device=self.device, dtype=self.dtype))):
            if alpha == 1.0:
                p.add_(v)
            else:
                p.add_(v, alpha=alpha)

    # ------------------------------------------------------------------ probes
    def mover(self, plan: Plan) -> "ParamMover":
        """Probes ``theta + (sign mu) D[i]``: dense rows are ``[d]`` vectors (one rounding of
        ``sign mu D[i]``, one of the sum: ``theta + mu * z``); a coordinate row changes one entry
        (``theta_i + sign mu``)."""
        return ParamMover(self, plan)


class _SavingMover:
    """A mover over parameters: saves them, puts them back on ``restore`` (and for a centre probe)."""

    def __init__(self, space: "ParamSpace", plan: Plan, dim: int, what: str):
        self.space, self.plan = space, plan
        self.saved = space.save()
        D = plan.directions
        if not isinstance(D, Coordinates) and (D.dim() != 2 or D.shape[1] != dim):
            raise ValueError(f"plan directions must be [n, {what}] with {what} = {dim}, got {tuple(D.shape)}")

    @torch.no_grad()
    def move(self, j: int) -> None:
        i = self.plan.index[j]
        if i < 0:
            self.restore()
        else:
            self._move(i, self.plan.sign[j] * self.plan.mu)

    def _move(self, i: int, alpha: float) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        self.space.restore(self.saved)


class ParamMover(_SavingMover):
    def __init__(self, space: ParamSpace, plan: Plan):
        super().__init__(space, plan, space.d, "d")
        D = plan.directions
        if isinstance(D, Coordinates):
            bounds, off = [], 0
            for n in space.sizes:
                bounds.append(off)
                off += n
            self._where = [_locate(int(i), bounds) for i in D.indices.tolist()]
        else:
            self._rows = D.to(device=space.device, dtype=space.dtype)

    def _move(self, i: int, alpha: float) -> None:
        sp = self.space
        if isinstance(self.plan.directions, Coordinates):
            sp.restore(self.saved)
            t, off = self._where[i]
            sp.params[t].view(-1)[off] = self.saved[t].view(-1)[off] + alpha
            return
        step = alpha * self._rows[i]
        for p, s, v in zip(sp.params, self.saved, sp.split(step)):
            torch.add(s, v, out=p.data)


def _locate(i: int, bounds: list[int]) -> tuple[int, int]:
    """(parameter index, offset inside it) of flat coordinate ``i``."""
    t = max(k for k, b in enumerate(bounds) if b <= i)
    return t, i - bounds[t]


_SKETCH_SEED = 20260049
FINGERPRINT_TOL = 1e-3
"""How far two fingerprints' projections may differ (relative to 1, a projection's scale) and still name
the same basis / point: float rounding of one basis on another device or CPU moves them by ~1e-6; another
basis of the same k moves every one by ~1."""


@torch.no_grad()
def basis_fingerprint(basis: torch.Tensor, reference: torch.Tensor | None = None) -> dict[str, Any]:
    """What an optimizer's state is bound to: the basis ``[d, k]`` (and the reference point ``[d']``) as
    a few numbers -- ``r^T P / sqrt(d)`` for one fixed pseudo-random ``r`` (k values of order 1 for
    orthonormal columns), the reference's ``r^T theta / |theta|`` and RMS. Two bases differ in them
    unless they are the same directions (signs included), to float rounding; unlike a hash of the
    bytes, the same basis on another device or machine matches (:data:`FINGERPRINT_TOL`)."""
    d, k = basis.shape
    r = torch.randn(d, generator=torch.Generator().manual_seed(_SKETCH_SEED)).to(basis.device)
    out: dict[str, Any] = {"d": int(d), "k": int(k),
                           "basis": [float(v) for v in (r @ basis.float()).double().cpu() / math.sqrt(d)]}
    if reference is not None:
        ref = reference.detach().reshape(-1).float()
        r = torch.randn(ref.numel(), generator=torch.Generator().manual_seed(_SKETCH_SEED)).to(ref.device)
        norm = float(ref.double().norm())
        out["reference"] = [float((r @ ref).double()) / max(norm, 1e-30), norm / math.sqrt(max(ref.numel(), 1))]
    return out


def fingerprint_mismatch(saved: Any, mine: dict[str, Any]) -> str | None:
    """Why a state's fingerprint (``saved``) is not this optimizer's (``mine``), or None when it is
    (or the state has none: written before fingerprints)."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("basis"), list):
        return f"its basis fingerprint is not one ({type(saved).__name__})"
    if saved.get("d") != mine["d"] or saved.get("k") != mine["k"]:
        return f"it was made on a basis of d = {saved.get('d')}, k = {saved.get('k')}, this one is {mine['d']} x {mine['k']}"
    try:
        far = max(abs(float(a) - b) for a, b in zip(saved["basis"], mine["basis"]))
    except (TypeError, ValueError):
        return "its basis fingerprint is not a list of numbers"
    if len(saved["basis"]) != mine["k"] or far > FINGERPRINT_TOL:
        return (f"it was made on another basis (same d = {mine['d']} and k = {mine['k']}, other directions: its "
                f"fingerprint differs by {far:.3g})")
    ref, mine_ref = saved.get("reference"), mine.get("reference")
    if ref is not None and mine_ref is not None:
        try:
            cos, rms = (float(v) for v in ref)
        except (TypeError, ValueError):
            return "its reference-point fingerprint is not two numbers"
        if abs(cos - mine_ref[0]) > FINGERPRINT_TOL or abs(rms - mine_ref[1]) > FINGERPRINT_TOL * max(rms, mine_ref[1]):
            return "it was made at another reference point theta_0 (the same basis, another subspace.reference)"
    return None


class SubspaceSpace(ParamSpace):
    """``theta = theta_0 + P c``: probes and updates move the parameters along ``P``'s columns.

    ``scales`` (``s [k]``, ``szo.zo.scale``): coordinates in units of ``s``, i.e. the space's basis
    is ``P diag(s)`` (``basis_t`` its rows); None keeps ``P`` itself.

    ``basis_t`` is ``P^T`` on the parameters' device and dtype, row-contiguous, so that direction
    ``i`` is one contiguous row; ``basis_views[t]`` is its ``[k, numel]`` block of parameter ``t``.
    A probe is ``torch.add(theta, (u @ P^T_t), alpha=sign mu)`` per parameter (the basis row itself
    for a coordinate probe: ``e_i @ P^T`` is that row exactly).
    """

    def __init__(self, params: Sequence[torch.Tensor], basis: torch.Tensor, scales: torch.Tensor | None = None):
        super().__init__(params)
        if basis.dim() != 2 or basis.shape[0] != self.d:
            raise ValueError(f"basis must be [d, k] with d = {self.d}, got {tuple(basis.shape)}")
        bt = basis.detach().t()
        if scales is not None:  # coordinates in the subspace's units (szo.zo.scale): rows of (P S)^T, a new tensor
            scales = torch.as_tensor(scales, dtype=torch.float64).reshape(-1)
            if scales.numel() != bt.shape[0] or not bool((scales > 0).all()):
                raise ValueError(f"scales must be [k] = [{bt.shape[0]}] positive units, got {tuple(scales.shape)}")
            bt = bt.to(device=self.device, dtype=self.dtype) * scales.to(device=self.device, dtype=self.dtype)[:, None]
        self.basis_t = (bt if bt.is_contiguous() else bt.contiguous()).to(device=self.device, dtype=self.dtype)
        self.k = int(self.basis_t.shape[0])
        self.basis_views: list[torch.Tensor] = []
        off = 0
        for n in self.sizes:
            self.basis_views.append(self.basis_t[:, off:off + n])
            off += n

    def exact(self):
        """The scope of the space's own products with ``P`` (moves, updates, projections): the
        parameters' dtype in IEEE arithmetic whatever precision scope the step runs in (a user's
        autocast would compute ``u @ P^T`` in bf16, TF32 would round it on CUDA; ``szo.precision``)."""
        return exact_fp32(self.basis_t.device.type)

    @torch.no_grad()
    def add_coords(self, coeffs: torch.Tensor, scale: float = 1.0) -> None:
        """``theta += scale * P @ coeffs``, parameter by parameter."""
        coeffs = coeffs.to(self.basis_t.dtype).to(self.basis_t.device)
        with self.exact():
            for p, pt in zip(self.params, self.basis_views):
                p.add_((coeffs @ pt).view_as(p), alpha=scale)

    def direction(self, u: torch.Tensor) -> list[torch.Tensor]:
        """``P u`` as one tensor per parameter (``u`` on the basis' device and dtype)."""
        with self.exact():
            return [(u @ pt).view_as(p) for p, pt in zip(self.params, self.basis_views)]

    def project(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """``P^T g`` for a gradient given per parameter (None counts as zero), on the basis' device."""
        g = torch.zeros(self.k, dtype=self.basis_t.dtype, device=self.basis_t.device)
        with self.exact():
            for t, pt in zip(tensors, self.basis_views):
                if t is not None:  # a sparse gradient (nn.Embedding(sparse=True)) as its dense values
                    g += pt @ (t.to_dense() if t.layout != torch.strided else t).reshape(-1).to(pt.dtype)
        return g

    def mover(self, plan: Plan) -> "SubspaceMover":  # type: ignore[override]
        return SubspaceMover(self, plan)


class SubspaceMover(_SavingMover):
    def __init__(self, space: SubspaceSpace, plan: Plan):
        super().__init__(space, plan, space.k, "k")
        D = plan.directions
        self._coord = D.indices.tolist() if isinstance(D, Coordinates) else None
        # on the basis' device once: a per-probe transfer would synchronise a GPU every probe
        self._rows = None if self._coord is not None else D.to(device=space.basis_t.device,
                                                                 dtype=space.basis_t.dtype)

    def _move(self, i: int, alpha: float) -> None:
        sp = self.space
        if self._coord is not None:
            c = self._coord[i]
            for p, s, pt in zip(sp.params, self.saved, sp.basis_views):
                torch.add(s, pt[c].view_as(p), alpha=alpha, out=p.data)
            return
        u = self._rows[i]
        with sp.exact():
            for p, s, pt in zip(sp.params, self.saved, sp.basis_views):
                torch.add(s, (u @ pt).view_as(p), alpha=alpha, out=p.data)


class NodeSpace:
    """The output (pre-activation) of one module: a probe adds ``sign mu D[i]`` (shaped like the
    output) through a forward hook, removed by ``restore``. No parameter moves."""

    def __init__(self, module: nn.Module, shape: torch.Size):
        self.module = module
        self.shape = torch.Size(shape)

    def mover(self, plan: Plan) -> "NodeMover":
        return NodeMover(self, plan)


class NodeMover:
    def __init__(self, space: NodeSpace, plan: Plan):
        self.space, self.plan = space, plan
        self._handle = None

    def move(self, j: int) -> None:
        self.restore()
        i = self.plan.index[j]
        if i < 0:
            return
        scale = self.plan.sign[j] * self.plan.mu
        xi = self.plan.directions[i].view(self.space.shape)
        self._handle = self.space.module.register_forward_hook(lambda mod, args, out: out + scale * xi.to(out))

    def restore(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class Still:
    """The space in which nothing moves: every probe of a plan is the current point (the clean
    forward of a step, :meth:`szo.evaluators.LoopEvaluator.centre`). Its own mover."""

    def mover(self, plan: Plan) -> "Still":
        return self

    def move(self, j: int) -> None:
        pass

    def restore(self) -> None:
        pass


class HostSpace:
    """Host-side coordinates ``c`` (float64, or int64 fixed point) loaded into the model on every move.

    ``to_params(c)`` gives the model's parameters for coordinates ``c`` (float64 ``[d]``); a load
    writes them into ``model.parameters()`` in the parameters' dtype (one rounding). ``probe="coords"``: a probe
    moves the coordinates, ``c + sign mu D[i]`` (integer arithmetic for int64 ``c``), then
    ``clip`` (e.g. the integer learner's counted saturation); ``probe="params"``: a probe moves
    the parameters around ``theta = to_params(c)``, ``theta + sign mu u_i`` with
    ``u_i = basis @ D[i]`` (``basis`` None: ``u_i = D[i]``), float64, then loaded (a federated
    client probing around the server's point).
    """

    PROBES = ("coords", "params")

    def __init__(self, model: nn.Module, to_params: Callable[[torch.Tensor], torch.Tensor], c: torch.Tensor, *,
                 probe: str = "coords", clip: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 basis: torch.Tensor | None = None):
        if probe not in self.PROBES:
            raise ValueError(f"unknown probe kind {probe!r}; valid: {', '.join(self.PROBES)}")
        self.model = model
        self.to_params = to_params
        self.c = c
        self.probe = probe
        self.clip = clip
        self.basis = basis
        self.params = ParamSpace(list(model.parameters()))

    def load(self, c: torch.Tensor) -> None:
        self.load_params(self.to_params(c))

    def load_params(self, theta: torch.Tensor) -> None:
        """Parameters := ``theta`` (a float64 ``[d]``), rounded once to their dtype."""
        self.params.load(theta.to(self.params.dtype))

    def mover(self, plan: Plan) -> "HostMover":
        return HostMover(self, plan)


class HostMover:
    def __init__(self, space: HostSpace, plan: Plan):
        self.space, self.plan = space, plan
        self._theta = space.to_params(space.c) if space.probe == "params" else None

    def move(self, j: int) -> None:
        sp, plan = self.space, self.plan
        i = plan.index[j]
        if i < 0:
            sp.load(sp.c)
            return
        D = plan.directions
        if isinstance(D, Coordinates):
            z = torch.zeros(D.dim, dtype=sp.c.dtype)
            z[int(D.indices[i])] = 1
        else:
            z = D[i]
        if self._theta is not None:
            u = (sp.basis @ z if sp.basis is not None else z).to(self._theta.dtype)
            sp.load_params(self._theta + (plan.sign[j] * plan.mu) * u)
            return
        if sp.c.is_floating_point():
            probe = sp.c + (plan.sign[j] * plan.mu) * z
        else:  # fixed point: exact integer arithmetic (mu an integer number of LSBs, directions integers)
            probe = sp.c + int(plan.sign[j]) * int(plan.mu) * z.to(sp.c.dtype)
        sp.load(sp.clip(probe) if sp.clip is not None else probe)

    def restore(self) -> None:
        self.space.load(self.space.c)


LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def adaptive_perturbation(d_w: int, d_a: int) -> str:
    """Seed 004's adaptive rule (Sec. 3.2.2), one home for the float and the integer learner: weight
    perturbation for a layer whose weight dimension ``d_w`` is smaller than its node dimension ``d_a``
    (one sample's nodes, what one difference drives), otherwise node perturbation -- ties included."""
    return "weight" if d_w < d_a else "node"


def trainable_layers(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The linear / convolution layers of ``model`` by module name (``names``: a subset, in model order)."""
    found = {n: m for n, m in model.named_modules() if isinstance(m, LAYER_TYPES)}
    if not found:
        raise ValueError("the model has no nn.Linear / nn.Conv layer to perturb")
    if names is None:
        return found
    names = list(names)
    unknown = [n for n in names if n not in found]
    if unknown or not names:
        raise ValueError(f"unknown layer name(s) {unknown or names!r}; valid: {', '.join(found)}")
    return {n: m for n, m in found.items() if n in names}


def refuse_shared_weights(layers: dict[str, nn.Module], who: str) -> None:
    """One ValueError when two of ``layers`` share a weight: a layer-wise learner perturbs and
    updates each layer on its own, so a tied weight would be estimated and stepped once per layer."""
    owner: dict[int, str] = {}
    for n, m in layers.items():
        for p in m.parameters(recurse=False):
            if id(p) in owner:
                raise ValueError(f"{who}: layers {owner[id(p)]!r} and {n!r} share one parameter, which a layer-wise "
                                 "learner would estimate and step once per layer: untie it, or train one of them "
                                 "(layers=)")
            owner[id(p)] = n


def frozen(params: Sequence[torch.Tensor], model: nn.Module | None = None) -> list[str]:
    """The parameters among ``params`` with ``requires_grad=False`` (which no optimizer changes),
    by their name in ``model`` (``param[i]`` without one)."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return [names.get(id(p), f"param[{i}]") for i, p in enumerate(params) if not p.requires_grad]


def refuse_frozen(params: Sequence[torch.Tensor], model: nn.Module | None, who: str, why: str,
                  instead: str) -> None:
    """One ValueError naming the frozen parameters of ``params``, for a learner that moves every
    parameter it is given (``why``: how it moves them; ``instead``: what to do)."""
    names = frozen(params, model)
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"{who} {why}; {shown} {'has' if len(names) == 1 else 'have'} requires_grad=False, which "
                         f"an optimizer never changes: {instead}")


@torch.no_grad()
def move_to_start(params: list[torch.Tensor], subspace, start: str, who: str) -> None:
    """``start="reference"``: copy ``subspace.reference`` (theta_ref, where subspace training
    starts) into the parameters (``params`` covers the reference: all of them, the frozen ones,
    ``requires_grad=False``, left as they are); ``"current"``: leave them as they are."""
    if start not in START_POINTS:
        raise ValueError(f"{who}: unknown start {start!r}; valid: reference (move the parameters to the "
                         "subspace's reference point), current (keep them)")
    if start == "current":
        return
    ref = getattr(subspace, "reference", None)
    if not isinstance(ref, torch.Tensor):
        raise ValueError(f"{who}: start='reference' needs subspace.reference (a [d] tensor); this subspace has "
                         "none: pass start='current' to train from the parameters as they are")
    d = sum(p.numel() for p in params)
    if ref.dim() != 1 or ref.numel() != d:
        raise ValueError(f"{who}: subspace.reference has shape {tuple(ref.shape)}, the parameters d = {d}")
    for p, chunk in zip(params, ref.split([p.numel() for p in params])):
        if p.requires_grad:
            p.copy_(chunk.view_as(p))
