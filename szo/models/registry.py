"""timm-style model registry: ``@register_model`` factories, ``create(name, ...)``, ``names()``."""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

from szo.models.base import SpikingModel
from szo.models.foreign import FOREIGN_PREFIX, create_foreign, resolve

F = TypeVar("F", bound=Callable[..., SpikingModel])

_REGISTRY: dict[str, Callable[..., SpikingModel]] = {}


def register_model(fn: F) -> F:
    """Register a model factory under its function name (decorator)."""
    name = fn.__name__
    if name in _REGISTRY and _REGISTRY[name] is not fn:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = fn
    return fn


def names() -> list[str]:
    """Sorted names of all registered models."""
    return sorted(_REGISTRY)


def check_name(name: Any) -> str:
    """``name`` if it is a registered model or a ``spikingjelly:<module>.<Class>`` network that
    resolves (``szo.models.foreign``); one ValueError naming the valid ones otherwise."""
    if isinstance(name, str) and name.startswith(FOREIGN_PREFIX):
        resolve(name)
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}, or a SpikingJelly network as "
                         f"{FOREIGN_PREFIX}<module>.<Class> (e.g. {FOREIGN_PREFIX}conv_fashion_mnist.CSNN)")
    return name


def check_arguments(name: str, factory: Callable[..., Any], kw: dict[str, Any]) -> None:
    """One ValueError naming only the arguments ``factory`` does not take (and the ones it does)."""
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(k for k in kw if k not in params)
    if unknown:
        hint = (" (YAML reads {a:2} as the key 'a:2': write {a: 2}, with a space after the colon)"
                if any(":" in k for k in unknown) else "")
        valid = ", ".join(p for p in params if p != "self")
        raise ValueError(f"model {name!r} has no argument(s) {', '.join(map(repr, unknown))}{hint}; valid: {valid}")


def create(
    name: str,
    *,
    num_classes: int | None = None,
    T: int | None = None,
    activation: str = "lif",
    **kw: Any,
) -> SpikingModel:
    """Build a registered model; ``None`` for ``num_classes`` / ``T`` means the model's default.
    ``spikingjelly:<module>.<Class>``: that SpikingJelly network, unchanged, as a
    ``szo.models.foreign.ForeignModel`` (``num_classes`` and ``T`` required)."""
    if isinstance(name, str) and name.startswith(FOREIGN_PREFIX):
        if num_classes is None or T is None:
            raise ValueError(f"model {name!r} is a foreign network: pass num_classes and T")
        return create_foreign(name, num_classes=num_classes, T=T, activation=activation, **kw)
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; valid names: {names()}") from None
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if T is not None:
        kw["T"] = T
    kw["activation"] = activation
    check_arguments(name, factory, kw)
    model = factory(**kw)
    if not isinstance(model, SpikingModel):
        raise TypeError(f"factory {name!r} returned {type(model).__name__}, not a SpikingModel")
    model.model_name = name
    return model
