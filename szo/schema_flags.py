"""Command-line flags that stand for recipe schema keys: one helper for every command built that way
(``szo adapt``: the ``tta`` / ``szo`` sections; ``szo federated``: the ``federated`` section).

A flag is ``name -> (section, key, what it is)``; its type, choices and default come from the
schema field (``szo.schema``), so a default exists once, and its help names the key it sets. A flag
not given is None in the parsed arguments and leaves the key to the recipe (or the schema).
"""
from __future__ import annotations

import argparse
import typing
from typing import Any, Mapping

from szo.schema import Section

__all__ = ["Flags", "add_schema_flags", "flag_values"]

Flags = Mapping[str, "tuple[str, str, str]"]
"""flag name (``batch_size`` -> ``--batch-size``) -> (schema section, key, what it is)."""


def add_schema_flags(p: argparse.ArgumentParser, flags: Flags, sections: Mapping[str, type[Section]], *,
                     over_recipe: bool = False, defaults: Mapping[str, Any] | None = None) -> None:
    """One ``--flag`` per entry of ``flags``, typed and defaulted by its section's field (``Literal``:
    its choices; ``X | None``: X). ``over_recipe``: the flag overrides a recipe's value (the help says
    the default is the recipe's, else the schema's). ``defaults``: flag -> the command's own default
    where it differs from the field's (``szo adapt``'s --q: test-time adaptation's 10, not training's 1;
    :func:`flag_values` fills it in)."""
    for flag, (section, key, what) in flags.items():
        cls = sections[section]
        default = (defaults or {}).get(flag, getattr(cls(), key))
        hint = typing.get_type_hints(cls)[key]
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]  # X of ``X | None``
        base = type(default) if default is not None else inner[0] if len(inner) == 1 and inner[0] in (int, float) \
            else str
        shown = "null" if default is None else default
        where = f"the recipe's, else {shown}" if over_recipe else shown
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None, choices=choices,
                       type=None if choices else base, help=f"{what} ({section}.{key}; default {where})")


def flag_values(args: argparse.Namespace, flags: Flags, defaults: Mapping[str, Any] | None = None
                ) -> dict[str, dict[str, Any]]:
    """The flags given, and those of ``defaults`` not given, as ``{section: {key: value}}`` (the recipe
    values they stand for)."""
    out: dict[str, dict[str, Any]] = {}
    for flag, (section, key, _) in flags.items():
        value = getattr(args, flag)
        if value is None:
            value = (defaults or {}).get(flag)
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out
