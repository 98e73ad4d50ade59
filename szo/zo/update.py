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
# A section is loaded in two phases (``StateCodec.stage``, then ``StateCodec.apply``): every value is
# checked and converted first -- tensors against the shape and kind of the value they replace, generator
# states on a scratch generator -- and only then put in place, so a refused load changes nothing.
def _refuse(what: str, msg: str) -> ValueError:
    return ValueError(f"optimizer state: {what} {msg}")


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and not v.is_complex():
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, int):
        raise _refuse(what, f"must be an integer, got {type(v).__name__}")
    return v


def _as_float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _refuse(what, f"must be a number, got {type(v).__name__}")
    return float(v)


def _as_tensor(old: Any, v: Any, what: str, *, integer: bool = False) -> torch.Tensor:
    """``v`` checked against the tensor it replaces: a tensor of the same shape, real, floating where
    ``old`` is (integer where the kind is)."""
    if not isinstance(v, torch.Tensor):
        raise _refuse(what, f"must be a tensor, got {type(v).__name__}")
    if isinstance(old, torch.Tensor) and tuple(v.shape) != tuple(old.shape):
        raise _refuse(what, f"has shape {tuple(v.shape)}, this optimizer's has {tuple(old.shape)}")
    if v.is_complex() or v.dtype == torch.bool or (integer and v.is_floating_point()) or (
            isinstance(old, torch.Tensor) and old.is_floating_point() and not v.is_floating_point()):
        want = "an integer" if integer or (isinstance(old, torch.Tensor) and not old.is_floating_point()) else "a float"
        raise _refuse(what, f"is a {str(v.dtype).replace('torch.', '')} tensor, not {want} one")
    return v


def _generator_stage(old: torch.Generator, v: Any, what: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or v.dtype not in (torch.uint8, torch.int8, torch.int64, torch.int32):
        raise _refuse(what, f"must be a torch.Generator state (a uint8 tensor), got "
                            f"{v.dtype if isinstance(v, torch.Tensor) else type(v).__name__}")
    state = v.to(torch.uint8)
    try:  # on a scratch generator of the same device: the optimizer's own is set only once all of it is valid
        torch.Generator(device=old.device).set_state(state)
    except (RuntimeError, TypeError, ValueError) as e:
        raise _refuse(what, f"is not a state of a torch.Generator on {old.device} "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return state


def _generator_set(g: torch.Generator, v: torch.Tensor) -> torch.Generator:
    g.set_state(v)
    return g


def _xorshift_stage(old: Any, v: Any, what: str) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.reshape(-1)[0]
    state = _as_int(v, what)
    if not 1 <= state <= 0xFFFFFFFF:
        raise _refuse(what, f"is {state}, not an XORShift32 state (an integer in [1, 2**32 - 1])")
    return state


def _xorshift_set(g, state: int):
    g.state = state
    return g


def _counter_stage(old: Any, v: Any, what: str) -> dict[str, dict[str, int]]:
    if not isinstance(v, dict) or not all(isinstance(q, dict) for q in v.values()):
        raise _refuse(what, f"must map layers to {{quantity: count}}, got {type(v).__name__}")
    return {str(layer): {str(q): _as_int(n, what) for q, n in qs.items()} for layer, qs in v.items()}


def _counter_set(counter: SaturationCounter, counts: dict) -> SaturationCounter:
    counter.reset()
    for layer, quantities in counts.items():
        for quantity, n in quantities.items():
            counter.add(str(layer), str(quantity), int(n))
    return counter


def _tensors_stage(old: Any, v: Any, what: str) -> list[torch.Tensor] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)):
        raise _refuse(what, f"must be a list of tensors, got {type(v).__name__}")
    olds = list(old) if isinstance(old, (list, tuple)) and len(old) == len(v) else [None] * len(v)
    return [_as_tensor(o, t, f"{what}[{i}]").clone() for i, (o, t) in enumerate(zip(olds, v))]


def _versions_stage(old: Any, h: Any, what: str) -> list:
    if not isinstance(h, (list, tuple)) or not all(isinstance(vs, (list, tuple)) and all(
            isinstance(v, (list, tuple)) for v in vs) for vs in h):
        raise _refuse(what, "must be a list (per stage) of lists (per version) of tensors")
    return [[[_as_tensor(None, t, what).clone() for t in v] for v in vs] for vs in h]


def _keep(old: Any, v: Any) -> Any:
    return v


@dataclass(frozen=True)
class _Kind:
    """How one kind of value is written (``encode``), checked and converted without side effects
    (``stage(current value, stored, name) -> staged``) and put in place (``put(current, staged) -> new``)."""

    encode: Callable[[Any], Any]
    stage: Callable[[Any, Any, str], Any]
    put: Callable[[Any, Any], Any] = _keep


_KINDS: dict[str, _Kind] = {
    "int": _Kind(int, lambda old, v, what: _as_int(v, what)),
    "float": _Kind(float, lambda old, v, what: _as_float(v, what)),
    "plain": _Kind(copy.deepcopy, lambda old, v, what: copy.deepcopy(v)),  # JSON-like values (str, None, lists, dicts)
    "float64": _Kind(lambda t: t.clone(), lambda old, v, what: _as_tensor(old, v, what).to(torch.float64, copy=True)),
    "int64": _Kind(lambda t: t.clone(),
                   lambda old, v, what: _as_tensor(old, v, what, integer=True).to(torch.int64, copy=True)),
    # a tensor kept in its own dtype (e.g. the point the parameters stand at, in their dtype); the
    # optimizer's setter puts it in place
    "tensor": _Kind(lambda t: t.clone(), lambda old, v, what: _as_tensor(old, v, what).clone()),
    "generator": _Kind(lambda g: g.get_state(), _generator_stage, _generator_set),
    # an XORShift32 generator: its 32-bit state as a one-element int64 tensor
    "xorshift": _Kind(lambda g: torch.tensor([g.state], dtype=torch.int64), _xorshift_stage, _xorshift_set),
    # a SaturationCounter: its counts {layer: {quantity: n}}, restored into the same counter
    "counter": _Kind(lambda c: c.as_dict(), _counter_stage, _counter_set),
    # a list of tensors (or None): e.g. AsyncFGD-Adam's moments, one per parameter
    "tensors": _Kind(lambda ts: None if ts is None else [t.clone() for t in ts], _tensors_stage),
    # a list (per stage) of lists (per version) of tensors: AsyncFGD's stale parameter versions
    "versions": _Kind(lambda h: [[[t.clone() for t in v] for v in vs] for vs in h], _versions_stage),
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

    ``encode(opt)`` gives the section. Loading is two phases: ``stage(opt, section)`` checks all of it
    (the section's ``check``, which refuses a section that does not fit this optimizer with one
    ValueError, then every value against the one it replaces) and changes nothing; ``apply(opt,
    staged)`` puts it in place and cannot be refused. ``decode`` is both. Sections and key names are
    the checkpoint format: tests/optim/test_golden.py loads checkpoints written before this codec existed.
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
            out[f.key] = _KINDS[f.kind].encode(v)
        return out

    def stage(self, opt: Any, section: Any) -> list[tuple[Field, bool, Any]]:
        """Every value of ``section`` checked and converted, nothing changed: ``(field, stored, value)``
        per field to set (``stored`` False: the field's default, for a key the section lacks)."""
        if not isinstance(section, dict):
            raise ValueError(f"optimizer state: section {self.key!r} must be a mapping, got {type(section).__name__}")
        if self.check is not None:
            self.check(opt, section)
        staged = []
        for f in self.fields:
            if f.record_only:
                continue
            if f.key in section:
                staged.append((f, True, _KINDS[f.kind].stage(_get(opt, f.path or f.key), section[f.key],
                                                             f"{self.key}.{f.key}")))
            elif f.default is not None:
                staged.append((f, False, f.default() if callable(f.default) else f.default))
        return staged

    def apply(self, opt: Any, staged: list[tuple[Field, bool, Any]]) -> None:
        """Put what :meth:`stage` returned in place."""
        for f, stored, value in staged:
            path = f.path or f.key
            _set(opt, path, _KINDS[f.kind].put(_get(opt, path), value) if stored else value)

    def decode(self, opt: Any, section: dict[str, Any]) -> None:
        self.apply(opt, self.stage(opt, section))
