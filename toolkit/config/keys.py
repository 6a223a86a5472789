"""The keys of a config tree: their dotted names and type hints, the value at one, and --help's line for each."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def value_at(cfg: Any, key: str, absent: Any = None) -> Any:
    """The value at a dotted key of a config; `absent` where this config has no such key."""
    value = cfg
    for part in key.split("."):
        if not hasattr(value, part):
            return absent
        value = getattr(value, part)
    return value


def dotted_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every key of a config tree by its dotted name, with its type hint (a section is not a key)."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= dotted_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys[prefix + f.name] = hints[f.name]
    return keys


def key_lines(cls: type, prefix: str = "") -> list[str]:
    """Every key of a config tree, a line each: its dotted name, type, default and help; a section's title first."""
    hints = typing.get_type_hints(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            lines += ["", f"{prefix}{f.name}: {f.metadata.get('help', '')}", *key_lines(hint, f"{prefix}{f.name}.")]
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        lines.append(f"  {prefix}{f.name} ({_type_name(hint)}, default {default!r}): {f.metadata.get('help', '')}")
    return lines


def _type_name(hint: Any) -> str:
    """A type as a user writes its values: `str | None`, `int`, or the choices of a Literal."""
    if typing.get_origin(hint) is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) in (list, dict, tuple):
        return str(hint)
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")
