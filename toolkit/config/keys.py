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


def is_set(tree: Any, key: str) -> bool:
    """Whether a nested mapping (a YAML's, the overrides') sets a dotted key."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def key_lines(cls: type, cfg: Any = None, given: dict[str, str] | None = None) -> list[str]:
    """Every key of a config tree, a line each: its dotted name, type, default and help; a section's title first.
    With a loaded `cfg` and `given` (dotted key -> where it was set: "config", "command line"), a key set there shows
    its value and where it came from before its default."""
    return _lines(cls, "", _instance(cls), cfg, given or {})


def _lines(cls: type, prefix: str, defaults: Any, cfg: Any, given: dict[str, str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        hint, name, help_ = hints[f.name], prefix + f.name, f.metadata.get("help", "")
        # the default from the tree's own instance: a section's default_factory may set its keys (pretraining's
        # samples.max_new_tokens is 40, SamplesConfig's own 48)
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        if dataclasses.is_dataclass(hint):
            inner = default if dataclasses.is_dataclass(default) else _instance(hint)
            lines += ["", f"{name}: {help_}", *_lines(hint, f"{name}.", inner, cfg, given)]
            continue
        said = f"default {default!r}"
        if name in given:
            value = value_at(cfg, name)
            said = f"{value!r} from the {given[name]}" + (" (= default)" if value == default else f", {said}")
        lines.append(f"  {name} ({_type_name(hint)}, {said}): {help_}")
    return lines


def _instance(cls: type) -> Any:
    """A config tree with every default; None where a key has none to give."""
    try:
        return cls()
    except TypeError:
        return None


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"


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
