"""The recipe files, torch-free: which recipes ship with the package, where their YAML is, and a
recipe's raw values with its ``extends`` chain merged (nothing validated yet).

``szo.config`` builds the typed, validated config from :func:`read_recipe`; ``szo recipe --list``
reads the names and descriptions from here without importing the schema's registries (torch).
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = ["recipe_names", "recipe_path", "recipe_description", "read_recipe", "read_yaml", "deep_merge"]


def _recipe_dir():
    """The shipped recipes: package ``szo._recipes`` (``recipes/`` of the source tree, mapped by the
    install); from an uninstalled source checkout on ``sys.path`` (``PYTHONPATH=.``, pytest's rootdir
    before an installed copy), that checkout's ``recipes/`` itself."""
    try:
        return resources.files("szo._recipes")
    except ModuleNotFoundError:
        source = Path(__file__).resolve().parent.parent / "recipes"
        if source.is_dir():
            return source
        raise


def recipe_names() -> list[str]:
    """Names of the recipes shipped in the package (``szo._recipes/*.yaml``)."""
    return sorted(p.name[: -len(".yaml")] for p in _recipe_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name: str):
    """The shipped YAML of recipe ``name`` (an importlib.resources Traversable)."""
    if name not in recipe_names():
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(recipe_names())}")
    return _recipe_dir() / f"{name}.yaml"


def read_yaml(text: str, where: str) -> dict[str, Any]:
    """A recipe's YAML text as a mapping; one ValueError naming ``where`` otherwise."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``over`` merged in, section by section (``over`` wins)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_recipe(name_or_path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A shipped recipe's (or a YAML file's) raw values, its ``extends`` chain merged: the parent's
    values are the defaults, its ``name`` and ``description`` are not inherited."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        data, key = read_yaml(p.read_text(encoding="utf-8"), str(p)), str(p.resolve())
    else:
        name = str(name_or_path)
        data, key = read_yaml(recipe_path(name).read_text(encoding="utf-8"), f"recipe {name}"), name
        data.setdefault("name", name)
    if key in _seen:
        raise ValueError(f"recipe 'extends' cycle: {' -> '.join(_seen + (key,))}")
    base = data.pop("extends", None)
    if base is not None:
        parent = read_recipe(base, _seen + (key,))
        parent.pop("name", None)
        parent.pop("description", None)
        data = deep_merge(parent, data)
    return data


def recipe_description(name: str) -> str:
    """The one-line description a shipped recipe gives itself (empty if it gives none)."""
    return str(read_recipe(name).get("description") or "")
