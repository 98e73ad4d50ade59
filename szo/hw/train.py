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
   ``rule="eq8"`` (method ``qzo``) is seed 004's quantized ZO instead: one clean forward and q
   XORShift32 Rademacher forward differences of ``mu_lsb`` LSBs (eq. 6), then the rounded,
   clipped integer update of eq. 8 (:func:`quantized_zo_update`), no momentum (no optimizer state).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from szo.hw.convert import FixedPointNetwork, to_fixed
from szo.hw.fixed import Precision, SaturationCounter, int_range, quantize_weight, right_shift_to_zero, saturate
from szo.functional.zo import check_loss, forward_difference_coefficients
from szo.hw.xorshift import XorShift32
from szo.optim.probes import check_hparams

__all__ = ["MOMENTUM_SHIFT", "ON_CHIP_RULES", "OnChipSZO", "quantized_zo_update", "basis_error", "dequantize_basis", "evaluate_fixed",
           "learner_state_bits", "quantize_basis", "quantized_subspace"]

MOMENTUM_SHIFT: int = 8
"""The momentum factor is stored as ``round(beta * 2**8)`` (0.9 -> 230/256 = 0.8984)."""
ON_CHIP_ESTIMATORS: tuple[str, ...] = ("cge", "rademacher")
ON_CHIP_RULES: tuple[str, ...] = ("momentum", "eq8")


def quantized_zo_update(theta_int: torch.Tensor, grad: torch.Tensor, *, lr: float, scale: float, n: int, q: int,
                        d: int, bits: int, counter: SaturationCounter | None = None, layer: str = "",
                        quantity: str = "") -> torch.Tensor:
    """Seed-004 eq. 8: ``clip(theta_int - round(N Q / (N Q + d - 1) * lr / s**2 * grad), -Q_N, Q_P)``.

    ``theta_int``: the integer (quantised, scaled) variables, int64; ``grad``: the ZO estimate of
    the gradient with respect to them (eq. 6, loss per integer unit); ``scale`` = ``s``, the value
    of one integer unit (quantization-aware scaling ``1 / s**2``, App. B); ``n * q`` perturbed
    evaluations over ``d`` variables (gradient-norm scaling ``NQ / (NQ + d - 1)``, Sec. 3.1.2);
    ``bits``: the signed width, ``-Q_N = -2**(bits-1)``, ``Q_P = 2**(bits-1) - 1``. Rounding is to
    nearest (ties to even); clipped elements are counted in ``counter``.
    """
    if not isinstance(theta_int, torch.Tensor) or theta_int.dtype != torch.int64:
        raise ValueError("theta_int must be an int64 tensor (the quantised variables)")
    for name, v in (("n", n), ("q", q), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not scale > 0 or not lr >= 0:
        raise ValueError(f"need scale > 0 and lr >= 0, got scale={scale}, lr={lr}")
    factor = n * q / (n * q + d - 1) * lr / scale ** 2
    step = torch.round(factor * grad.to(torch.float64)).to(torch.int64)  # [.]: round to nearest
    return saturate(theta_int - step, bits, counter, layer, quantity)  # clip(., -Q_N, Q_P)


def learner_state_bits(d: int, k: int, *, basis_bits: int = 8, coord_bits: int = 32,
                       ref_bits: int = 16) -> dict[str, int]:
    """Bits of the on-chip SZO learner state: int P ``[d, k]``, a 32-bit scale per column,
    theta_ref at ``ref_bits``, coordinates c and momentum delta at ``coord_bits``, a 32-bit seed."""
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
def evaluate_fixed(model: nn.Module, loader: Iterable, *, precision: Precision | None = None,
                   device: str | torch.device | None = None) -> float:
    """Top-1 accuracy of the fixed-point forward (prediction = argmax of the integer readout summed over T).

    ``model``: a :class:`FixedPointNetwork` or a szo model (converted with ``to_fixed``).
    ``loader`` yields ``(x, y)`` batches; they are moved to ``device`` (default: the network's).
    The evaluation loop is the trainer's (``szo.train.trainer._evaluate_sums``).
    """
    from szo.train.trainer import _evaluate_sums

    net = model if isinstance(model, FixedPointNetwork) else to_fixed(model, precision=precision)
    if device is None:
        device = next((p.device for p in net.parameters()), torch.device("cpu"))
    _, correct, seen = _evaluate_sums(_IntegerReadout(net), loader, lambda out, y: 0.0, device)
    if seen == 0:
        raise ValueError("loader yielded no samples")
    return correct / seen


class OnChipSZO(torch.optim.Optimizer):
    """Integer-state SZO driving a (fixed-point) model's float master parameters.

    A ``torch.optim.Optimizer`` (forward-only, like ``szo.optim.SZO``), so ``szo.train.fit``,
    LR schedulers and checkpoints drive it: ``step(closure)`` runs the probes (each: set
    theta = deq(theta_ref_q) + deq(P) c_probe, call ``closure()``), estimates the coordinate
    gradient and applies the integer update ``delta <- round(-lr g 2**f) + (delta * m_int >> 8)``,
    ``c <- sat(c + delta)``. ``lr`` is read from ``param_groups[0]`` each step (host-side
    schedule); everything the chip keeps between steps is an integer (:meth:`state_bits`).
    """

    forward_only = True

    def __init__(self, model: nn.Module, subspace: Any, *, lr: float = 1.0, momentum: float = 0.9,
                 mu_lsb: int = 1 << 12, estimator: str = "cge", q: int = 1, seed: int = 1,
                 basis_bits: int = 8, coord_bits: int = 32, coord_frac: int = 16, ref_bits: int = 16,
                 rule: str = "momentum") -> None:
        if estimator not in ON_CHIP_ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; valid: {list(ON_CHIP_ESTIMATORS)}")
        if rule not in ON_CHIP_RULES:
            raise ValueError(f"unknown update rule {rule!r}; valid: {list(ON_CHIP_RULES)}")
        if rule == "eq8" and estimator != "rademacher":
            raise ValueError("rule 'eq8' (seed-004 quantized ZO) uses Rademacher forward differences: "
                             "valid estimator for it: 'rademacher'")
        check_hparams(lr=lr, momentum=momentum, q=q)
        if isinstance(mu_lsb, bool) or not isinstance(mu_lsb, int) or mu_lsb < 1:
            raise ValueError(f"mu_lsb must be a positive int (coordinate LSBs), got {mu_lsb!r}")
        if not 8 <= coord_bits <= 48 or not 0 <= coord_frac < coord_bits:
            raise ValueError(f"need 8 <= coord_bits <= 48 and 0 <= coord_frac < coord_bits, got {coord_bits}, {coord_frac}")
        if not hasattr(model, "flat_params") or not hasattr(model, "load_flat_params"):
            raise ValueError("model must provide flat_params()/load_flat_params() (a szo model or FixedPointNetwork)")
        theta = model.flat_params().to("cpu", torch.float64)  # learner state on the host, as _P
        if subspace.basis.shape[0] != theta.numel():
            raise ValueError(f"subspace d = {subspace.basis.shape[0]} does not match the model's d = {theta.numel()}")
        super().__init__(model.parameters(), dict(lr=float(lr), momentum=float(momentum)))
        self.model = model
        self.mu_lsb = mu_lsb
        self.estimator, self.q, self.rule = estimator, q, rule
        self.coord_bits, self.coord_frac = coord_bits, coord_frac
        self.basis_bits, self.ref_bits = basis_bits, ref_bits
        P_int, self.P_scale = quantize_basis(subspace.basis.detach().cpu(), basis_bits)
        self._P = dequantize_basis(P_int, self.P_scale)  # the values the integer P stands for
        del P_int  # [d, k] int64: only _P is used (the chip's int P is what _P stands for)
        self.d, self.k = self._P.shape
        self.counter = SaturationCounter()
        self.theta_ref = self._quantize_ref(model, theta)
        self.momentum_int = int(round(momentum * (1 << MOMENTUM_SHIFT)))
        self.c = torch.zeros(self.k, dtype=torch.int64)
        self.delta = torch.zeros(self.k, dtype=torch.int64)
        self.rng = XorShift32(seed)
        self.forward_passes = 0
        self.step_count = 0
        self._load(self.c)

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def momentum(self) -> float:
        return float(self.param_groups[0]["momentum"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["on_chip"] = {"c": self.c.clone(), "delta": self.delta.clone(),
                         "rng_state": torch.tensor([self.rng.state], dtype=torch.int64),
                         "forward_passes": self.forward_passes, "step_count": self.step_count}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("on_chip", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            c = extra["c"].to(torch.int64)
            if c.shape != (self.k,):
                raise ValueError(f"optimizer state has k = {c.shape[0]} coordinates, this optimizer has k = {self.k}")
            self.c, self.delta = c, extra["delta"].to(torch.int64)
            self.rng.state = int(extra["rng_state"][0])
            self.forward_passes, self.step_count = int(extra["forward_passes"]), int(extra["step_count"])
            self._load(self.c)

    def _quantize_ref(self, model: nn.Module, theta: torch.Tensor) -> torch.Tensor:
        """theta_ref as ``ref_bits`` mantissas with one exponent per parameter tensor (what the chip stores).

        Clamped mantissas are counted in ``self.counter`` as ``(parameter name, "theta_ref")``.
        """
        prec = Precision(weight_bits=self.ref_bits, weight_exp_min=-12, weight_exp_max=16)
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
        return 2 * self.k if self.estimator == "cge" else 2 * self.q

    @property
    def coordinates(self) -> torch.Tensor:
        """c as float64 (c_int / 2**coord_frac)."""
        return self.c.to(torch.float64) / (1 << self.coord_frac)

    def _load(self, c_int: torch.Tensor) -> None:
        theta = self.theta_ref + self._P @ (c_int.to(torch.float64) / (1 << self.coord_frac))
        self.model.load_flat_params(theta.to(torch.float32))

    def _directions(self) -> torch.Tensor:
        if self.estimator == "cge":
            return torch.eye(self.k, dtype=torch.int64)
        # one 32-bit draw per step seeds the step's perturbations; they are regenerated, not stored
        step_seed = self.rng.next()
        g = XorShift32(step_seed)
        return torch.stack([g.rademacher(self.k) for _ in range(self.q)])

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("OnChipSZO.step needs a closure that runs a forward pass and returns the loss")
        Z = self._directions()  # [m, k] integer directions
        if self.rule == "eq8":
            return self._step_eq8(closure, Z)
        plus, minus = [], []
        try:
            for z in Z:
                for sign, store in ((1, plus), (-1, minus)):
                    probe = saturate(self.c + sign * self.mu_lsb * z, self.coord_bits, self.counter, "coords", "probe")
                    self._load(probe)
                    store.append(check_loss(closure(), f"closure (probe {self.forward_passes + 1})"))
                    self.forward_passes += 1
        except BaseException:
            self._load(self.c)  # a failed probe leaves the parameters at c, not at the probe
            raise
        lp, lm = torch.tensor(plus, dtype=torch.float64), torch.tensor(minus, dtype=torch.float64)
        mu = self.mu_lsb / (1 << self.coord_frac)
        g = ((lp - lm) / (2 * mu)) @ Z.to(torch.float64)  # coordinate gradient estimate
        if self.estimator == "rademacher":
            g = g / self.q
        step_int = torch.round(-self.lr * g * (1 << self.coord_frac)).to(torch.int64)  # round to nearest LSB
        step_int = saturate(step_int, self.coord_bits, self.counter, "coords", "step")
        mom = right_shift_to_zero(self.delta * self.momentum_int, MOMENTUM_SHIFT)  # toward zero
        self.delta = saturate(step_int + mom, self.coord_bits, self.counter, "coords", "delta")
        self.c = saturate(self.c + self.delta, self.coord_bits, self.counter, "coords", "c")
        self.step_count += 1
        self._load(self.c)
        return torch.tensor(float((lp.mean() + lm.mean()) / 2))

    def _probe(self, closure, c_int: torch.Tensor) -> float:
        self._load(c_int)
        out = check_loss(closure(), f"closure (probe {self.forward_passes + 1})")
        self.forward_passes += 1
        return out

    def _step_eq8(self, closure, Z: torch.Tensor) -> torch.Tensor:
        """Seed-004 quantized ZO: eq. 6 (one-sided, mu = mu_lsb integer units), then eq. 8 on c."""
        try:
            l0 = self._probe(closure, self.c)
            lq = [self._probe(closure, saturate(self.c + self.mu_lsb * z, self.coord_bits, self.counter,
                                                "coords", "probe")) for z in Z]
        except BaseException:
            self._load(self.c)
            raise
        g = forward_difference_coefficients(torch.tensor(lq, dtype=torch.float64), l0, Z.to(torch.float64),
                                            float(self.mu_lsb))  # per integer unit of c
        self.c = quantized_zo_update(self.c, g, lr=self.lr, scale=2.0 ** -self.coord_frac, n=1, q=self.q, d=self.k,
                                     bits=self.coord_bits, counter=self.counter, layer="coords", quantity="c")
        self.step_count += 1
        self._load(self.c)
        return torch.tensor(l0)

    def state_bits(self) -> dict[str, int]:
        """On-chip learner state in bits (P, scales, theta_ref, c, delta, seed): :func:`learner_state_bits`
        (``rule="eq8"`` keeps no momentum)."""
        bits = learner_state_bits(self.d, self.k, basis_bits=self.basis_bits, coord_bits=self.coord_bits,
                                  ref_bits=self.ref_bits)
        if self.rule == "eq8":
            del bits["momentum"]
        return bits
