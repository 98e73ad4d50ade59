"""Updates: what a step does with its estimate, and the one codec for the state an update keeps.

* :func:`heavy_ball_` -- paper eq. (6) in velocity form, the one momentum update of the library
  (SZO's k coordinates, full-space parameter vectors, per-layer tensors, the federated server's
  coordinates): ``v <- momentum * v - lr * g``; the caller adds ``v`` to its point.
* :func:`sign_descent_` -- ZO-signSGD (seed 000): ``theta <- theta - lr * sign(g)``.
* :func:`integer_heavy_ball` -- the integer learner's momentum rule (``szo.hw.optim.onchip.OnChipSZO``):
  ``delta <- sat(round(-lr g 2**f) + (delta * m_int >> shift))``, right shift toward zero.
* :func:`quantized_zo_update` -- seed 004 eq. 8, the rounded, clipped integer update.
* :class:`StateCodec` -- the extra optimizer state (generators, counters, coordinates, phases)
  under one ``state_dict()`` key, read and written by one mechanism for every optimizer.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..functional.integer import SaturationCounter, right_shift_to_zero, round_to_int, saturate

__all__ = ["heavy_ball_", "sign_descent_", "integer_heavy_ball", "quantized_zo_update", "Field", "StateCodec", "GENERATOR_COUNTERS"]


def heavy_ball_(velocity: torch.Tensor, grad: torch.Tensor, *, lr: float, momentum: float) -> torch.Tensor:
    """``velocity <- momentum * velocity - lr * grad`` in place (paper eq. 6, velocity form); returns it.

    ``theta_{t+1} = theta_t + v_{t+1}`` is eq. (6): ``theta_t - lr g + beta (theta_t - theta_{t-1})``.
    """
    # lr / momentum as param_groups hold them: a number, or a one-element tensor (torch accepts lr=torch.tensor(...))
    return velocity.mul_(float(momentum)).add_(grad.to(velocity.dtype), alpha=-float(lr))


def sign_descent_(theta: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """``theta - lr * sign(grad)`` (a new tensor; ZO-signSGD, Liu et al. 2019 / seed 000 Sec. 3.2)."""
    return theta - lr * torch.sign(grad)


def integer_heavy_ball(delta: torch.Tensor, grad: torch.Tensor, *, lr: float, frac_bits: int, momentum_int: int,
                       shift: int, bits: int, counter: SaturationCounter | None = None,
                       layer: str = "coords") -> torch.Tensor:
    """The integer momentum step: ``round(-lr g 2**frac_bits)`` (to nearest) plus
    ``delta * momentum_int >> shift`` (toward zero), each narrowing saturated to ``bits`` and counted."""
    step = round_to_int(-lr * grad.to(torch.float64) * (1 << frac_bits), min(bits, 62))  # never wraps
    step = saturate(step, bits, counter, layer, "step")
    mom = right_shift_to_zero(delta * momentum_int, shift)
    return saturate(step + mom, bits, counter, layer, "delta")


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
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 61:
        raise ValueError(f"bits must be an int in [2, 61] (the variables' signed width), got {bits!r}")
    if not scale > 0 or not lr >= 0:
        raise ValueError(f"need scale > 0 and lr >= 0, got scale={scale}, lr={lr}")
    factor = n * q / (n * q + d - 1) * lr / scale ** 2
    if not math.isfinite(factor):
        raise ValueError(f"eq. 8's step factor lr / s**2 = {lr:g} / {scale:g}**2 is not a finite float: lower the lr")
    # [.]: round to nearest; a step beyond 2**bits saturates theta all the same, so it is clamped
    # there first (converted unclamped, a step past int64 wraps to the opposite bound)
    step = round_to_int(factor * grad.to(torch.float64), bits)
    return saturate(theta_int - step, bits, counter, layer, quantity)  # clip(., -Q_N, Q_P)


# ---------------------------------------------------------------------- state codec
def _generator_get(g: torch.Generator) -> torch.Tensor:
    return g.get_state()


def _generator_set(g: torch.Generator, v: torch.Tensor) -> torch.Generator:
    g.set_state(v.to(torch.uint8))
    return g


def _xorshift_set(g, state: int):
    g.state = state
    return g


def _counter_set(counter: SaturationCounter, counts: dict) -> SaturationCounter:
    counter.reset()
    for layer, quantities in counts.items():
        for quantity, n in quantities.items():
            counter.add(str(layer), str(quantity), int(n))
    return counter


_KINDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {
    # kind -> (encode value, decode (old value, stored) -> new value)
    "int": (int, lambda old, v: int(v)),
    "float": (float, lambda old, v: float(v)),
    "plain": (copy.deepcopy, lambda old, v: copy.deepcopy(v)),  # JSON-like values (str, None, lists, dicts)
    "float64": (lambda t: t.clone(), lambda old, v: v.to(torch.float64, copy=True)),
    "int64": (lambda t: t.clone(), lambda old, v: v.to(torch.int64, copy=True)),
    # a tensor kept in its own dtype (e.g. the point the parameters stand at, in their dtype); the
    # optimizer's setter checks it and puts it in place
    "tensor": (lambda t: t.clone(), lambda old, v: v.clone()),
    "generator": (_generator_get, _generator_set),
    # an XORShift32 generator: its 32-bit state as a one-element int64 tensor
    "xorshift": (lambda g: torch.tensor([g.state], dtype=torch.int64), lambda g, v: _xorshift_set(g, int(v[0]))),
    # a SaturationCounter: its counts {layer: {quantity: n}}, restored into the same counter
    "counter": (lambda c: c.as_dict(), _counter_set),
    # a list of tensors (or None): e.g. AsyncFGD-Adam's moments, one per parameter
    "tensors": (lambda ts: None if ts is None else [t.clone() for t in ts],
                lambda old, v: None if v is None else [t.clone() for t in v]),
    # a list (per stage) of lists (per version) of tensors: AsyncFGD's stale parameter versions
    "versions": (lambda h: [[[t.clone() for t in v] for v in vs] for vs in h],
                 lambda old, h: [[[t.clone() for t in v] for v in vs] for vs in h]),
}


@dataclass(frozen=True)
class Field:
    """One value of a checkpoint section: stored under ``key``, held at ``path`` of the optimizer
    (``"a.b"``: attribute ``a``, then key / attribute ``b``), encoded by ``kind``; a missing key
    loads ``default`` (``None``: left as it is). ``record_only``: written for the record (and the
    section's ``check``), never loaded back (e.g. a structural setting the constructor fixed)."""

    key: str
    kind: str
    path: str | None = None
    default: Any = None
    record_only: bool = False
    optional: bool = False  # a None value is not written (a state only some variants have)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown state kind {self.kind!r}; valid: {', '.join(_KINDS)}")


#: the probe generator and the forward count: the counters every seeded forward-only optimizer saves
GENERATOR_COUNTERS = (Field("generator_state", "generator", "generator"), Field("forward_passes", "int", default=0))


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _set(obj: Any, path: str, value: Any) -> None:
    *head, last = path.split(".")
    for part in head:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    if isinstance(obj, dict):
        obj[last] = value
    else:
        setattr(obj, last, value)


class StateCodec:
    """The extra state of a forward-only optimizer under ``state_dict()[key]``.

    ``encode(opt)`` gives the section, ``decode(opt, section)`` puts it back (a ``check`` may
    refuse a section that does not fit this optimizer, with one ValueError). Sections and key
    names are the checkpoint format: tests/optim/test_golden.py loads checkpoints written before
    this codec existed.
    """

    def __init__(self, key: str, fields: tuple[Field, ...],
                 check: Callable[[Any, dict], None] | None = None):
        self.key = key
        self.fields = fields
        self.check = check

    def encode(self, opt: Any) -> dict[str, Any]:
        """The section; an ``optional`` field whose value is None is left out (the keys of an
        optimizer that does not use it stay what they always were)."""
        out = {}
        for f in self.fields:
            v = _get(opt, f.path or f.key)
            if v is None and f.optional:
                continue
            out[f.key] = _KINDS[f.kind][0](v)
        return out

    def decode(self, opt: Any, section: dict[str, Any]) -> None:
        if self.check is not None:
            self.check(opt, section)
        for f in self.fields:
            path = f.path or f.key
            if f.record_only:
                continue
            if f.key in section:
                _set(opt, path, _KINDS[f.kind][1](_get(opt, path), section[f.key]))
            elif f.default is not None:
                _set(opt, path, f.default() if callable(f.default) else f.default)
