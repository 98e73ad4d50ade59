"""SZO through the fixed-point forward: quantised basis, fixed-point coordinates, integer estimator.

Two ways to train on the fixed-point backend:

1. ``szo.optim.SZO`` unchanged on ``net = to_fixed(model)``: SZO perturbs ``net``'s float
   master parameters (theta = theta_ref + P c), every forward re-quantises ``W = Q(theta)``
   and runs in integers. Use :func:`quantized_subspace` to give it the int8/int4 basis.
2. :class:`OnChipSZO`: the state an on-chip learner would keep, in integers. ``theta_ref``
   stored at ``ref_bits`` (per-tensor exponent), ``P`` at ``basis_bits`` with a per-column
   scale, coordinates ``c`` and momentum ``delta`` as ``coord_bits`` signed fixed point with
   ``coord_frac`` fractional bits (c = c_int / 2**coord_frac), momentum factor as an 8-bit
   fraction (``MOMENTUM_SHIFT``). Estimators: ``"cge"`` (2k probes +/- mu e_i) or
   ``"rademacher"`` (seed-004 style: 2q probes +/- mu z, z in {-1, +1}^k from XORShift32,
   regenerated from a 32-bit seed instead of stored). mu is an integer number of coordinate
   LSBs. The loss is computed on the host from the integer readout (a float).
   ``rule="eq8"`` (method ``qzo-subspace``) is seed 004's quantized ZO instead: one clean forward and q
   XORShift32 Rademacher forward differences of ``mu_lsb`` LSBs (eq. 6), then the rounded,
   clipped integer update of eq. 8 (:func:`quantized_zo_update`), no momentum (no optimizer state).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from szo.config import LEARNER_WIDTHS
from szo.evaluators import build_evaluator
from szo.functional.xorshift import XorShift32
from szo.hw.convert import FixedPointNetwork, to_fixed
from szo.hw.fixed import BitWidths, SaturationCounter, int_range, quantize_weight, saturate
from szo.methods import register_builder
from szo.train.trainer import evaluate_sums
from szo.zo import (
    INTEGER_ESTIMATORS,
    Batch,
    Field,
    ForwardOnlyBase,
    HostSpace,
    Plan,
    ProbePath,
    StateCodec,
    basis_fingerprint,
    check_hparams,
    fingerprint_mismatch,
    get_estimator,
    integer_heavy_ball,
    one_point_plan,
    quantized_zo_update,
    rademacher_rows,
    refuse_frozen,
    refuse_meta,
)

__all__ = ["MOMENTUM_SHIFT", "ON_CHIP_RULES", "LEARNER_WIDTHS", "OnChipSZO", "quantized_zo_update", "basis_error",
           "check_learner_widths", "dequantize_basis", "evaluate_fixed", "learner_state_bits", "quantize_basis",
           "quantized_subspace"]

MOMENTUM_SHIFT: int = 8
"""The momentum factor is stored as ``round(beta * 2**8)`` (0.9 -> 230/256 = 0.8984)."""
ON_CHIP_ESTIMATORS: tuple[str, ...] = INTEGER_ESTIMATORS  # cge, rademacher (szo.zo.plans)
ON_CHIP_RULES: tuple[str, ...] = ("momentum", "eq8")


def check_learner_widths(**widths: int) -> None:
    """One ValueError naming the width and its valid range unless every given width (of
    :data:`LEARNER_WIDTHS`) is an int in its range."""
    for name, v in widths.items():
        lo, hi = LEARNER_WIDTHS[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")


def learner_state_bits(d: int, k: int, *, basis_bits: int = 8, coord_bits: int = 32,
                       ref_bits: int = 16) -> dict[str, int]:
    """Bits of the on-chip SZO learner state: int P ``[d, k]``, a 32-bit scale per column,
    theta_ref at ``ref_bits``, coordinates c and momentum delta at ``coord_bits``, a 32-bit seed."""
    check_learner_widths(basis_bits=basis_bits, coord_bits=coord_bits, ref_bits=ref_bits)
    return {"basis_P": d * k * basis_bits, "basis_scale": 32 * k, "theta_ref": d * ref_bits,
            "coordinates": k * coord_bits, "momentum": k * coord_bits, "seed": 32}


def quantize_basis(P: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``P [d, k]`` -> ``(P_int [d, k] int64 in signed ``bits``, scale [k] float64)``; P ~= P_int * scale.

    Symmetric per-column scale ``max|P[:, j]| / (2**(bits-1) - 1)``, round to nearest.
    """
    if not isinstance(P, torch.Tensor) or P.dim() != 2 or not P.is_floating_point():
        raise ValueError(f"P must be a float [d, k] tensor, got {getattr(P, 'shape', type(P))}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"basis bits must be an int in [2, 16] (e.g. 8 or 4), got {bits!r}")
    lo, hi = int_range(bits)
    P64 = P.detach().to(torch.float64)
    amax = P64.abs().amax(0)
    scale = torch.where(amax > 0, amax / hi, torch.ones_like(amax))
    P_int = torch.round(P64 / scale).clamp(lo, hi).to(torch.int64)  # |P/scale| <= hi: the clamp never binds
    return P_int, scale


def dequantize_basis(P_int: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return P_int.to(torch.float64) * scale.to(torch.float64)


def basis_error(P: torch.Tensor, bits: int = 8) -> float:
    """Relative Frobenius error ``||P - deq(Q(P))||_F / ||P||_F`` of the quantised basis."""
    P_int, scale = quantize_basis(P, bits)
    P64 = P.detach().to(torch.float64)
    return float(torch.linalg.norm(P64 - dequantize_basis(P_int, scale)) / torch.linalg.norm(P64))


def quantized_subspace(subspace: Any, bits: int = 8) -> Any:
    """A copy of a ``subspace_store.Subspace`` whose basis is ``deq(Q(P))`` (for ``szo.optim.SZO``)."""
    P_int, scale = quantize_basis(subspace.basis, bits)
    prov = dict(getattr(subspace, "provenance", {}) or {})
    prov["basis_quantization"] = {"bits": bits, "per_column_scale": True,
                                  "rel_frobenius_error": basis_error(subspace.basis, bits)}
    return dataclasses.replace(subspace, basis=dequantize_basis(P_int, scale).to(subspace.basis.dtype),
                               provenance=prov)


class _IntegerReadout(nn.Module):
    """The fixed-point network seen as a one-step model whose output is its integer readout
    summed over T (exact in float64), so that the trainer's ``out.mean(0).argmax(1)`` is the
    argmax of the integer readout."""

    def __init__(self, net: FixedPointNetwork) -> None:
        super().__init__()
        self.net = net
        self.train(net.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        acc = self.net.last_readout_sum  # None when the network does not end in a readout current
        return out if acc is None else acc.to(torch.float64).unsqueeze(0)


@torch.no_grad()
def evaluate_fixed(model: nn.Module, loader: Iterable, *, widths: BitWidths | None = None,
                   device: str | torch.device | None = None) -> float:
    """Top-1 accuracy of the fixed-point forward (prediction = argmax of the integer readout summed over T).

    ``model``: a :class:`FixedPointNetwork` or a szo model (converted with ``to_fixed``).
    ``loader`` yields ``(x, y)`` batches; they are moved to ``device`` (default: the network's).
    The evaluation loop is the trainer's (``szo.train.evaluate_sums``).
    """
    net = model if isinstance(model, FixedPointNetwork) else to_fixed(model, widths=widths)
    if device is None:
        device = next((p.device for p in net.parameters()), torch.device("cpu"))
    _, correct, seen = evaluate_sums(_IntegerReadout(net), loader, lambda out, y: 0.0, device)
    if seen == 0:
        raise ValueError("loader yielded no samples")
    return correct / seen


def _check_coords(opt: "OnChipSZO", section: dict) -> None:
    c = section.get("c")
    if c is None or tuple(c.shape) != (opt.k,):
        got = "none" if c is None else f"k = {c.shape[0]}"
        raise ValueError(f"optimizer state has {got} coordinates, this optimizer has k = {opt.k}")
    origin = section.get("origin")
    if origin is not None and (not isinstance(origin, torch.Tensor) or tuple(origin.shape) != (opt.d,)):
        got = tuple(origin.shape) if isinstance(origin, torch.Tensor) else type(origin).__name__
        raise ValueError(f"optimizer state has an origin theta_ref of shape {got}, this optimizer's parameters "
                         f"are d = {opt.d}")
    why = fingerprint_mismatch(section.get("fingerprint"), opt.basis_fingerprint)
    if why is not None:
        raise ValueError(f"optimizer state does not belong to this OnChipSZO's subspace: {why}; load it into an "
                         "optimizer built on the subspace it was saved with")


class OnChipSZO(ForwardOnlyBase):
    """Integer-state SZO driving a (fixed-point) model's float master parameters.

    A forward-only ``torch.optim.Optimizer`` (like ``szo.optim.SZO``), so ``szo.train.fit``,
    LR schedulers and checkpoints drive it: ``step(closure)`` runs the probes (each: set
    theta = deq(theta_ref_q) + deq(P) c_probe, call ``closure()``), estimates the coordinate
    gradient and applies the integer update ``delta <- round(-lr g 2**f) + (delta * m_int >> 8)``,
    ``c <- sat(c + delta)``. ``lr`` is read from ``param_groups[0]`` each step (host-side
    schedule); everything the chip keeps between steps is an integer (:meth:`state_bits`).

    Composed from the forward-only core: a :class:`~szo.zo.HostSpace` over the integer
    coordinates (probes saturated, loaded as float32 parameters), CGE / XORShift32-Rademacher /
    one-point plans, the loop evaluator, and the integer update rules of ``szo.zo.update``.
    """

    # the origin theta_ref (quantised from the parameters the learner was built on) is state: the
    # parameters are origin + P c, so a resume puts them back in either order; checkpoints written
    # before it have none and keep the origin the constructor quantised
    codecs = (StateCodec("on_chip", (Field("c", "int64"), Field("delta", "int64"), Field("rng_state", "xorshift", "rng"),
                                     Field("forward_passes", "int", default=0), Field("step_count", "int", default=0),
                                     Field("origin", "float64", "theta_ref"),
                                     Field("saturations", "counter", "counter"),
                                     # the quantised basis P the coordinates are on (szo.zo.basis_fingerprint)
                                     Field("fingerprint", "plain", "basis_fingerprint", record_only=True)),
                         check=_check_coords),)
    fixed_space = "every parameter of its network (theta_ref + P c)"

    def __init__(self, model: nn.Module, subspace: Any, *, lr: float = 1.0, momentum: float = 0.9,
                 mu_lsb: int = 1 << 12, estimator: str = "cge", q: int = 1, seed: int = 1,
                 basis_bits: int = 8, coord_bits: int = 32, coord_frac: int = 16, ref_bits: int = 16,
                 rule: str = "momentum") -> None:
        kind = get_estimator(estimator, ON_CHIP_ESTIMATORS)
        if rule not in ON_CHIP_RULES:
            raise ValueError(f"unknown update rule {rule!r}; valid: {list(ON_CHIP_RULES)}")
        if rule == "eq8" and kind.coordinate:
            raise ValueError("rule 'eq8' (seed-004 quantized ZO) uses Rademacher forward differences: "
                             "valid estimator for it: 'rademacher'")
        check_hparams(lr=lr, momentum=momentum, q=q)
        if isinstance(mu_lsb, bool) or not isinstance(mu_lsb, int) or mu_lsb < 1:
            raise ValueError(f"mu_lsb must be a positive int (coordinate LSBs), got {mu_lsb!r}")
        check_learner_widths(basis_bits=basis_bits, coord_bits=coord_bits, ref_bits=ref_bits)
        if isinstance(coord_frac, bool) or not isinstance(coord_frac, int) or not 0 <= coord_frac < coord_bits:
            raise ValueError(f"need 0 <= coord_frac < coord_bits = {coord_bits}, got {coord_frac!r}")
        if not hasattr(model, "flat_params") or not hasattr(model, "load_flat_params"):
            raise ValueError("model must provide flat_params()/load_flat_params() (a szo model or FixedPointNetwork)")
        refuse_meta(list(model.parameters()), "OnChipSZO")
        refuse_frozen(list(model.parameters()), model, "OnChipSZO",
                      "moves every parameter of its network (theta_ref + P c)",
                      "unfreeze them, or train with the float learner (szo-cge), which leaves them out")
        theta = model.flat_params().to("cpu", torch.float64)  # learner state on the host
        if subspace.basis.shape[0] != theta.numel():
            raise ValueError(f"subspace d = {subspace.basis.shape[0]} does not match the model's d = {theta.numel()}")
        super().__init__(model.parameters(), dict(lr=float(lr), momentum=float(momentum)))
        self.model = model
        self.mu_lsb = mu_lsb
        self.kind, self.q, self.rule = kind, q, rule
        self.estimator = kind.name
        self.coord_bits, self.coord_frac = coord_bits, coord_frac
        self.basis_bits, self.ref_bits = basis_bits, ref_bits
        P_int, self.P_scale = quantize_basis(subspace.basis.detach().cpu(), basis_bits)
        self.P = dequantize_basis(P_int, self.P_scale)  # the values the chip's int P stands for
        del P_int  # [d, k] int64: only P is used
        self.d, self.k = self.P.shape
        self.counter = SaturationCounter()
        self.theta_ref = self._quantize_ref(model, theta)
        self.delta = torch.zeros(self.k, dtype=torch.int64)
        self.rng = XorShift32(seed)
        self.step_count = 0
        self.space = HostSpace(model, self.parameters_at, torch.zeros(self.k, dtype=torch.int64), probe="coords",
                               clip=self._clip_probe)
        # the fixed-point forward keeps no BN statistics to freeze; its neurons are reset before every probe
        self._init_forward_only(build_evaluator(ProbePath(freeze_bn=False), model, "OnChipSZO"))
        self.space.load(self.c)

    @property
    def basis_fingerprint(self) -> dict:
        """The quantised basis it was built on (:func:`szo.zo.basis_fingerprint`); ``state_dict()`` carries
        it and ``load_state_dict`` refuses a state made on another basis."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = basis_fingerprint(self.P)
        return self._fingerprint

    def _clip_probe(self, c: torch.Tensor) -> torch.Tensor:
        """A probe's coordinates saturated to ``coord_bits`` (clamps counted)."""
        return saturate(c, self.coord_bits, self.counter, "coords", "probe")

    @property
    def c(self) -> torch.Tensor:
        """The integer coordinates (int64 ``[k]``; c = c_int / 2**coord_frac)."""
        return self.space.c

    @c.setter
    def c(self, value: torch.Tensor) -> None:
        self.space.c = value

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def momentum(self) -> float:
        return float(self.param_groups[0]["momentum"])

    @property
    def momentum_int(self) -> int:
        """The momentum factor as the chip stores it, ``round(momentum * 2**8)``, from ``param_groups``
        each step (a scheduler's momentum, e.g. OneCycleLR's cycle, applies)."""
        return int(round(self.momentum * (1 << MOMENTUM_SHIFT)))

    def _finish_load(self, prepared: Any) -> None:
        """After the state: the parameters put at ``origin + P c`` (the point the state stands at)."""
        self.space.load(self.c)

    def _quantize_ref(self, model: nn.Module, theta: torch.Tensor) -> torch.Tensor:
        """theta_ref as ``ref_bits`` mantissas with one exponent per parameter tensor (what the chip stores).

        Clamped mantissas are counted in ``self.counter`` as ``(parameter name, "theta_ref")``.
        """
        prec = BitWidths(weight_bits=self.ref_bits, weight_exp_min=-12, weight_exp_max=16)
        out, off = [], 0
        for name, p in model.named_parameters():
            n = p.numel()
            w_int, e, n_sat = quantize_weight(theta[off:off + n], prec)
            self.counter.add(name, "theta_ref", n_sat)
            out.append(w_int.to(torch.float64) * 2.0 ** e)
            off += n
        return torch.cat(out)

    @property
    def forwards_per_step(self) -> int:
        if self.rule == "eq8":
            return 1 + self.q  # clean forward + q forward differences (eq. 6)
        return self.kind.probes(self.k, self.q)

    @property
    def coordinates(self) -> torch.Tensor:
        """c as float64 (c_int / 2**coord_frac)."""
        return self.c.to(torch.float64) / (1 << self.coord_frac)

    def parameters_at(self, c_int: torch.Tensor) -> torch.Tensor:
        """The model's parameters (float64 ``[d]``) at integer coordinates ``c_int``."""
        return self.theta_ref + self.P @ (c_int.to(torch.float64) / (1 << self.coord_frac))

    def plan(self) -> Plan:
        """This step's probes in integer coordinate units (``mu_lsb`` LSBs): CGE (``+-e_i``,
        interleaved), Rademacher ``+-z_j`` (one XORShift32 draw seeds the step: regenerated, not
        stored), or for ``rule="eq8"`` the centre and ``+z_j`` (eq. 6)."""
        if self.kind.coordinate:
            return self.kind.plan(self.k, self.mu_lsb, interleaved=True)
        Z = rademacher_rows(self.rng, self.q, self.k).to(torch.float64)
        if self.rule == "eq8":
            return one_point_plan(Z, self.mu_lsb)
        return self.kind.plan(mu=self.mu_lsb, z=Z, interleaved=True, accumulate="matmul")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *,  # type: ignore[override]
             batch: Batch | None = None) -> torch.Tensor:
        closure = self.check_closure(closure, batch)
        if self.rule == "eq8" and self.momentum != self.defaults["momentum"]:  # a momentum schedule: nothing to apply to
            raise ValueError(f"OnChipSZO rule 'eq8' (seed 004's quantized ZO) takes no momentum, but param_groups "
                             f"changed it to {self.momentum:g}: leave it (a scheduler: OneCycleLR(cycle_momentum=False))")
        plan = self.plan()
        with self.evaluator.session():
            losses = self.evaluator.run(closure, self.space, plan)
        g = plan.estimate(losses)  # per integer unit of c
        if self.rule == "eq8":  # seed 004: eq. 8 on c, no momentum (no optimizer state)
            self.c = quantized_zo_update(self.c, g, lr=self.lr, scale=2.0 ** -self.coord_frac, n=1, q=self.q,
                                         d=self.k, bits=self.coord_bits, counter=self.counter, layer="coords",
                                         quantity="c")
            fallback = float(losses[0])
        else:
            g = g * (1 << self.coord_frac)  # per unit of c = c_int / 2**f
            self.delta = integer_heavy_ball(self.delta, g, lr=self.lr, frac_bits=self.coord_frac,
                                            momentum_int=self.momentum_int, shift=MOMENTUM_SHIFT,
                                            bits=self.coord_bits, counter=self.counter)
            self.c = saturate(self.c + self.delta, self.coord_bits, self.counter, "coords", "c")
            lp, lm = plan.pairs(losses)
            fallback = float((lp.mean() + lm.mean()) / 2)
        self.step_count += 1
        self.space.load(self.c)
        return self.finish_step(closure, losses, fallback, plan.m)

    def state_bits(self) -> dict[str, int]:
        """On-chip learner state in bits (P, scales, theta_ref, c, delta, seed): :func:`learner_state_bits`
        (``rule="eq8"`` keeps no momentum)."""
        bits = learner_state_bits(self.d, self.k, basis_bits=self.basis_bits, coord_bits=self.coord_bits,
                                  ref_bits=self.ref_bits)
        if self.rule == "eq8":
            del bits["momentum"]
        return bits


@register_builder("szo-cge", "szo-rge", "qzo-subspace", integer=True)
def build_on_chip(spec, model: nn.Module, subspace: Any, o, run) -> OnChipSZO:
    """The integer learner of a method (``o.integer`` gives the widths and the XORShift32 seed):
    ``szo-cge`` -> CGE with integer momentum, ``szo-rge`` -> Rademacher (seed 004) with integer
    momentum, ``qzo-subspace`` -> seed 004's eq. 8 (no momentum). ``mu`` in coordinate units becomes
    ``round(mu 2**coord_frac)`` LSBs."""
    h = o.integer
    # the record says which rule: with momentum the integer counterpart of the method's estimator, without
    # it seed 004's eq. 8, which is Rademacher's rule (its variant names the rule, not a float estimator)
    rule = "momentum" if spec.momentum else "eq8"
    estimator = get_estimator(spec.variant).integer if spec.momentum else "rademacher"
    if estimator is None:
        raise ValueError(f"method {spec.name!r} (estimator {spec.variant!r}) has no integer on-chip learner; "
                         f"its estimators: {', '.join(ON_CHIP_ESTIMATORS)}")
    return OnChipSZO(model, subspace, lr=o.lr, momentum=o.momentum, mu_lsb=max(1, round(o.mu * 2 ** h.coord_frac)),
                     estimator=estimator, q=o.q, seed=h.seed,
                     basis_bits=h.basis_bits, coord_bits=h.coord_bits, coord_frac=h.coord_frac, ref_bits=h.ref_bits,
                     rule=rule)
