"""Parameter layouts and model fingerprints: the one home of the flat-vector layout rules.

A *layout* is ``[(name, shape), ...]`` in ``named_parameters()`` order: the order in which
``flat_params()``, trajectories, subspace bases and the subspace optimizers lay out the d
coordinates. On disk (trajectory and subspace manifests) it is ``[{"name", "shape"}, ...]``.
The *fingerprint* of a model is ``sha256(json.dumps([model_name, [[name, shape], ...]]))``
(hex); it is stored in every trajectory and subspace manifest, so the formula must not change.

This module imports only torch: ``szo.models``, ``szo.trajectory``, ``szo.optim`` and
``subspace_store`` all use it without importing each other.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Layout", "layout_fingerprint", "layout_from_json", "layout_mismatch", "layout_to_json", "param_layout"]

Layout = list[tuple[str, tuple[int, ...]]]


def param_layout(module: nn.Module) -> Layout:
    """``(name, shape)`` of every parameter of ``module`` in ``named_parameters()`` order; a
    module compiled by ``torch.compile`` has the names of the module it compiled (not ``_orig_mod.``-prefixed),
    a ``DistributedDataParallel`` model those of the model it wraps (not ``module.``-prefixed)."""
    module = getattr(module, "_orig_mod", module)
    if isinstance(module, DistributedDataParallel):
        module = module.module
    return [(n, tuple(int(s) for s in p.shape)) for n, p in module.named_parameters()]


def _entry(e: Any) -> tuple[str, tuple[int, ...]]:
    if isinstance(e, dict):
        return str(e["name"]), tuple(int(s) for s in e["shape"])
    name, shape = e
    return str(name), tuple(int(s) for s in shape)


def layout_from_json(layout: Iterable[Any] | None) -> Layout | None:
    """``[{"name", "shape"}]`` (or ``(name, shape)`` pairs) -> ``[(name, (int, ...))]``; None stays None."""
    if layout is None:
        return None
    return [_entry(e) for e in layout]


def layout_to_json(layout: Iterable[Any] | None) -> list[dict] | None:
    """A layout (pairs or dicts) -> ``[{"name": str, "shape": [int, ...]}]``; None stays None."""
    if layout is None:
        return None
    return [{"name": n, "shape": list(s)} for n, s in map(_entry, layout)]


def layout_fingerprint(model_name: str, layout: Iterable[Any]) -> str:
    """sha256 hex of ``json.dumps([model_name, [[name, shape], ...]])`` (the model fingerprint)."""
    pairs = [[n, list(s)] for n, s in map(_entry, layout)]
    return hashlib.sha256(json.dumps([model_name, pairs]).encode()).hexdigest()


def layout_mismatch(expected: Sequence[Any], found: Sequence[Any], *,
                    where: tuple[str, str] = ("in the subspace", "in the model")) -> str | None:
    """The first difference between two layouts as one phrase; None if they are equal.

    ``where`` names the two sides in the phrase (default: a subspace's layout vs a model's).
    """
    exp_l, got_l = layout_from_json(expected), layout_from_json(found)
    a, b = where
    for i, (exp, got) in enumerate(zip(exp_l, got_l)):
        if exp != got:
            return f"parameter #{i} is {exp[0]} {list(exp[1])} {a} but {got[0]} {list(got[1])} {b}"
    if len(exp_l) != len(got_l):
        i = min(len(exp_l), len(got_l))
        extra = f"{exp_l[i][0]} (only {a})" if len(exp_l) > len(got_l) else f"{got_l[i][0]} (only {b})"
        return f"{len(exp_l)} parameters {a}, {len(got_l)} {b}; first extra: {extra}"
    return None
