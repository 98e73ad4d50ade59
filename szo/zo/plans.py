"""Plans: which probes a step makes, and how their losses combine into an estimate.

A :class:`Plan` is ``m`` probes ``theta + sign_j * mu * D[index_j]`` of a space (``index_j = -1``:
the centre ``theta`` itself), where ``D`` is either a dense ``[n, k]`` tensor of directions in the
space's coordinates or :class:`Coordinates` (basis vectors ``e_i``, never materialised).
``plan.estimate(losses)`` turns the ``m`` losses (float64, in probe order) into the gradient
estimate in the same coordinates, with the arithmetic of the plan's ``estimator``:

=================  ===========================================  ====================================
estimator          probes                                       estimate
=================  ===========================================  ====================================
``cge``            ``+mu e_i``, ``-mu e_i`` per coordinate      ``(L+ - L-) / 2mu`` (eq. 3, SZO-CGE)
``rge``            ``+mu z_j``, ``-mu z_j``                     ``1/q sum (L+ - L-) / 2mu z_j`` (eq. 4)
``one-point``      centre, ``+mu z_j``                          ``1/q sum (L+ - L0) / mu z_j``
``coord-one-point`` centre, ``+mu e_i``                          ``(L+_i - L0) / mu`` (SZO Table 13)
=================  ===========================================  ====================================

(``szo.functional.zo`` holds the coefficient formulas; the plans order the probes and pick the
losses.) The factories below build the plans of every method; the same ``Plan`` drives the loop,
the batched engine (``dense()``: the ``[m, k]`` rows ``sign_j D[index_j]``) and the
distributed evaluator. Directions are drawn from an explicit ``torch.Generator`` (or the integer
learner's XORShift32) in the order the optimizers always drew them: a checkpointed generator
state resumes the same directions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..functional import zo as F
from ..functional.xorshift import XorShift32

__all__ = ["Coordinates", "Plan", "ESTIMATORS", "INTEGER_ESTIMATORS", "Estimator", "get_estimator", "cge_plan", "rge_plan", "one_point_plan",
           "coord_one_point_plan", "gaussian_rows", "rademacher_rows"]

@dataclass(frozen=True)
class Estimator:
    """What an estimator's name stands for, in one record: ``coordinate`` (probes along the space's
    ``n`` basis vectors) or random directions (``q`` rows of ``z``); ``one_sided`` (the centre, then
    one probe per direction) or two-sided (``+mu`` and ``-mu`` per direction). Its forward count,
    plan, the step's reported loss and its calibration under a relative scale (``szo.zo.scale``)
    follow from the two (``tests/optim/test_protocol.py`` checks the count against the registry and
    the closure calls of one step)."""

    name: str
    coordinate: bool
    one_sided: bool
    integer: str | None = None  # the integer on-chip learner's estimator for this one (None: it has none)

    def probes(self, n: int, q: int) -> int:
        """Forwards of one estimate: ``n`` coordinates or ``q`` directions, one or two probes each,
        plus the centre of a one-sided estimate."""
        m = n if self.coordinate else q
        return m + 1 if self.one_sided else 2 * m

    def plan(self, coords: "int | Coordinates | None" = None, mu: float = 1.0, *, z: torch.Tensor | None = None,
             interleaved: bool = False, accumulate: str = "mean") -> "Plan":
        """This estimator's probes: along ``coords`` (coordinate estimators) or the rows of ``z``."""
        if self.coordinate:
            if self.one_sided:
                return coord_one_point_plan(coords, mu)
            return cge_plan(coords, mu, interleaved=interleaved)
        if self.one_sided:
            return one_point_plan(z, mu)
        return rge_plan(z, mu, interleaved=interleaved, accumulate=accumulate)

    def describe(self, q: int | None = None) -> str:
        """How a table names it: ``CGE``; a random-direction estimator with its ``q`` (``RGE q=2``)."""
        return self.name.upper() if self.coordinate else f"{self.name.upper()} q={q}"

    def calibration_steps(self, k: int, q: int) -> int:
        """Steps whose estimates set a normalised scale's gradient unit: one for a coordinate estimate
        (it sees every direction), ``ceil(k / q)`` for ``q`` random directions in ``k``."""
        return 1 if self.coordinate else -(-k // q)

    def signal_fraction(self, k: int, q: int) -> float:
        """The factor on a normalised estimate: 1 for a coordinate estimate; ``sqrt(q / (k + q + 1))``
        for ``q`` Gaussian directions, whose ``E|g_hat|^2 = (k + q + 1) / q |g|^2``: normalised by its
        RMS length the gradient part is that fraction of a unit step and the rest noise, and scaling by
        it once more makes the expected step ``lr q / (k + q + 1)`` along the gradient, the
        noise-optimal fraction of a coordinate estimate's step, so one relative lr serves CGE and RGE
        of any q (docs/evidence.md, "Scale-free mu and lr")."""
        return 1.0 if self.coordinate else math.sqrt(q / (k + q + 1))

    def step_loss(self, losses: torch.Tensor) -> float:
        """The loss a step reports when no unperturbed forward ran: the centre probe (one-sided
        plans start with it), else the mean of the probes."""
        return float(losses[0]) if self.one_sided else float(losses.double().mean())


    def estimate(self, plan: "Plan", losses: torch.Tensor, *, centre: float | None = None,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The gradient estimate ``[dim]`` from ``plan``'s probe losses (float64, probe order): two-sided
        differences ``(L+ - L-) / 2mu`` or one-sided ``(L+ - L0) / mu`` (``centre``: ``L0`` measured apart
        when the plan has no centre probe), on the basis vectors (coordinate estimators: scattered into a
        zero ``[dim]`` vector of ``dtype`` for a subset) or combined with the directions' rows."""
        mu, D = plan.mu, plan.directions
        if self.coordinate:
            if self.one_sided:
                c0, plus = plan.centre_and_plus(losses, centre)
                return _scatter((plus - c0) / mu, D, dtype)
            lp, lm = plan.pairs(losses)
            return _scatter(F.cge_coefficients(lp, lm, mu), D, dtype)
        if self.one_sided:
            c0, plus = plan.centre_and_plus(losses, centre)
            return F.forward_difference_coefficients(plus, c0, D, mu)
        lp, lm = plan.pairs(losses)
        if plan.accumulate == "matmul":
            return ((lp - lm) / (2 * mu)).to(D.device) @ D.to(torch.float64) / D.shape[0]
        if plan.accumulate == "sequential":
            g = torch.zeros(D.shape[1], dtype=D.dtype, device=D.device)
            q = D.shape[0]
            for j in range(q):
                g.add_(D[j], alpha=(float(lp[j]) - float(lm[j])) / (2 * mu) / q)
            return g
        return F.rge_coefficients(lp, lm, D, mu)


_ESTIMATORS = {e.name: e for e in (Estimator("cge", True, False, integer="cge"),
                                   Estimator("rge", False, False, integer="rademacher"),
                                   Estimator("one-point", False, True), Estimator("coord-one-point", True, True),
                                   # the integer learner's: random +-1 directions from XORShift32 (seed 004)
                                   Estimator("rademacher", False, False, integer="rademacher"))}
ESTIMATORS: tuple[str, ...] = tuple(n for n in _ESTIMATORS if n != "rademacher")
"""The float optimizers' estimators (``rademacher``: the integer learner's, ``INTEGER_ESTIMATORS``)."""
INTEGER_ESTIMATORS: tuple[str, ...] = tuple(dict.fromkeys(e.integer for e in _ESTIMATORS.values() if e.integer))


def get_estimator(name: "str | Estimator", valid: "tuple[str, ...] | None" = None) -> Estimator:
    """The :class:`Estimator` record of ``name`` (an :class:`Estimator` stands for itself); one ValueError
    listing ``valid`` (default: :data:`ESTIMATORS`) otherwise."""
    valid = ESTIMATORS if valid is None else valid
    if isinstance(name, Estimator):
        name = name.name
    if name not in valid:
        raise ValueError(f"unknown estimator {name!r}; valid: {', '.join(valid)}")
    return _ESTIMATORS[name]


@dataclass(frozen=True)
class Coordinates:
    """Directions ``e_i`` for ``i`` in ``indices`` (a long tensor ``[n]``) of a space of dimension ``dim``."""

    indices: torch.Tensor
    dim: int


@dataclass(frozen=True, eq=False)
class Plan:
    """``m`` probes ``theta + sign[j] * mu * directions[index[j]]`` (``index[j] == -1``: the centre).

    ``accumulate``: how the RGE estimate sums its directions: ``"mean"`` (one vectorised
    float64 mean, the subspace methods), ``"sequential"`` (direction by direction into one
    ``[dim]`` buffer in the directions' dtype: no ``[q, d]`` temporary, the full-space methods)
    or ``"matmul"`` (``differences @ D / q`` in float64, the integer learner's).
    """

    estimator: Estimator
    directions: torch.Tensor | Coordinates
    index: tuple[int, ...]
    sign: tuple[float, ...]
    mu: float
    accumulate: str = "mean"

    def __post_init__(self) -> None:
        if not isinstance(self.estimator, Estimator):
            raise ValueError(f"a plan's estimator is an Estimator record (szo.zo.get_estimator), got {self.estimator!r}")
        if len(self.index) != len(self.sign):
            raise ValueError("a plan needs one sign per probe")
        if not self.mu > 0:
            raise ValueError(f"mu must be > 0, got {self.mu}")

    @property
    def m(self) -> int:
        """Probes (forward passes) of the plan."""
        return len(self.index)

    @property
    def dim(self) -> int:
        D = self.directions
        return D.dim if isinstance(D, Coordinates) else int(D.shape[-1])

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``U [m, dim]``: row ``j`` is ``sign[j] * D[index[j]]`` (zeros for a centre probe)."""
        U = torch.zeros(self.m, self.dim, dtype=dtype)
        D = self.directions
        for j, (i, s) in enumerate(zip(self.index, self.sign)):
            if i < 0:
                continue
            if isinstance(D, Coordinates):
                U[j, int(D.indices[i])] = s
            else:
                U[j] = D[i].to(dtype) if s > 0 else -D[i].to(dtype)
        return U

    # ------------------------------------------------------------------ losses -> estimate
    def pairs(self, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L+, L-)`` per direction of a two-sided plan (float64 ``[n]`` each)."""
        n = len(self.directions.indices) if isinstance(self.directions, Coordinates) else self.directions.shape[0]
        lp = torch.empty(n, dtype=torch.float64)
        lm = torch.empty(n, dtype=torch.float64)
        for j, (i, s) in enumerate(zip(self.index, self.sign)):
            (lp if s > 0 else lm)[i] = losses[j]
        return lp, lm

    def centre_and_plus(self, losses: torch.Tensor, centre: float | None) -> tuple[float, torch.Tensor]:
        """``(L0, L+)`` of a one-sided plan: the centre probe's loss (or ``centre``, measured apart) and
        the losses of the other probes (float64, plan order)."""
        if centre is None:
            if -1 not in self.index:
                raise ValueError(f"a {self.estimator.name} plan without a centre probe needs centre= (the loss at "
                                 "theta)")
            centre = float(losses[self.index.index(-1)])
        plus = torch.tensor([float(losses[j]) for j, i in enumerate(self.index) if i >= 0], dtype=torch.float64)
        return centre, plus

    def estimate(self, losses: torch.Tensor, *, centre: float | None = None,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The gradient estimate ``[dim]`` from the probe losses (float64, probe order): the plan's
        estimator's arithmetic (:meth:`Estimator.estimate`)."""
        return self.estimator.estimate(self, losses, centre=centre, dtype=dtype)


def _scatter(coef: torch.Tensor, D: torch.Tensor | Coordinates, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(D, Coordinates):
        raise ValueError("coordinate estimators need Coordinates directions")
    if len(D.indices) == D.dim and torch.equal(D.indices, torch.arange(D.dim)):
        return coef.to(dtype)
    out = torch.zeros(D.dim, dtype=dtype)
    out[D.indices] = coef.to(dtype)
    return out


# ---------------------------------------------------------------------- directions
def gaussian_rows(q: int, k: int, generator: torch.Generator | None, *, dtype=torch.float64,
                  one_at_a_time: bool = False) -> torch.Tensor:
    """``q`` draws of ``z ~ N(0, I_k)`` ``[q, k]``: one ``[q, k]`` draw, or (``one_at_a_time``) ``q``
    draws of ``[k]`` in a row -- the stream of a method that drew one direction per probe pair."""
    if one_at_a_time:
        return torch.stack([torch.randn(k, generator=generator, dtype=dtype) for _ in range(q)])
    return F.sample_gaussian(q, k, generator, dtype=dtype)


def rademacher_rows(rng: XorShift32, q: int, k: int) -> torch.Tensor:
    """``q`` Rademacher rows ``[q, k]`` (int64 in {-1, +1}) from one 32-bit draw of ``rng`` that
    seeds the step (seed 004: perturbations regenerated from a seed, never stored)."""
    g = XorShift32(rng.next())
    return torch.stack([g.rademacher(k) for _ in range(q)])


# ---------------------------------------------------------------------- plans
def _signed(n: int, interleaved: bool) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if interleaved:  # +0, -0, +1, -1, ...
        return tuple(i for i in range(n) for _ in (0, 1)), tuple(s for _ in range(n) for s in (1.0, -1.0))
    return tuple(range(n)) * 2, (1.0,) * n + (-1.0,) * n  # +0 .. +(n-1), -0 .. -(n-1)


def cge_plan(coords: Coordinates | int, mu: float, *, interleaved: bool = False) -> Plan:
    """Two-sided coordinate probes: ``2n`` forwards (``coords``: all ``k`` coordinates, or a subset)."""
    if isinstance(coords, int):
        coords = Coordinates(torch.arange(coords), coords)
    index, sign = _signed(len(coords.indices), interleaved)
    return Plan(_ESTIMATORS["cge"], coords, index, sign, float(mu))


def rge_plan(z: torch.Tensor, mu: float, *, interleaved: bool = False, accumulate: str = "mean") -> Plan:
    """Two-sided random-direction probes along the rows of ``z [q, k]``: ``2q`` forwards."""
    index, sign = _signed(z.shape[0], interleaved)
    return Plan(_ESTIMATORS["rge"], z, index, sign, float(mu), accumulate)


def one_point_plan(z: torch.Tensor, mu: float, *, centre: bool = True) -> Plan:
    """One-sided probes along the rows of ``z [q, k]``, after the centre (``centre``): ``q + 1`` forwards."""
    q = z.shape[0]
    return Plan(_ESTIMATORS["one-point"], z, ((-1,) if centre else ()) + tuple(range(q)), (1.0,) * (q + int(centre)), float(mu))


def coord_one_point_plan(coords: int | Coordinates, mu: float) -> Plan:
    """The centre, then ``+mu e_i`` for each coordinate (``coords``: all ``k``, or a subset):
    ``n + 1`` forwards (SZO's one-point CGE, paper Table 13; seed 000's CGE, eq. 2 with N = d)."""
    if isinstance(coords, int):
        coords = Coordinates(torch.arange(coords), coords)
    n = len(coords.indices)
    return Plan(_ESTIMATORS["coord-one-point"], coords, (-1,) + tuple(range(n)), (1.0,) * (n + 1), float(mu))
