"""Typed, validated recipe configs: a YAML file plus `key.sub=value` overrides into dataclasses.

Every component owns a dataclass whose fields carry a one-line `help`; a recipe composes them
into one tree. Loading checks every key (unknown ones get the closest valid name), coerces
types the way YAML users expect ("1e-3" is a float), runs each section's `validate()`, and
reports *all* problems in one `ConfigError` rather than stopping at the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class UserError(Exception):
    """A mistake in what the user asked for; recipes print it as one line, with no traceback."""


class ConfigError(UserError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems in the config:\n  - " + "\n  - ".join(problems))


def cache_dir(override: str | None = None) -> Path:
    """Where the toolkit caches tokenizers, packed data and dequantised models."""
    if override:
        return Path(override)
    return Path(os.environ.get("LLM_TOOLKIT_CACHE", Path.home() / ".cache" / "llm-toolkit"))


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with its one-line documentation."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["train.lr=3e-4", "output_dir=runs/x"]` -> nested dict, values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError([f"override {arg!r} is not key=value (for example train.max_steps=200)"])
        key, raw = arg.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override {arg!r} sets a key under {part!r}, which is not a section"])
            node = child
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    cls: type[T], path: str | Path | None, overrides: list[str] | None = None, notes: list[str] | None = None
) -> T:
    """Read `path` (YAML), apply overrides, build and validate `cls`.

    Keys renamed in `cls.RENAMED` still work for one release: they are moved to their new
    name, and `notes` (when given) gets one deprecation line for each."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"--config {path} does not exist; pick one from recipes/configs/"])
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError([f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"]) from None
        if not isinstance(raw, dict):
            raise ConfigError([f"{path} must hold a mapping of keys, found {type(raw).__name__}"])
    problems: list[str] = []
    over = parse_overrides(overrides or [])
    renamed = getattr(cls, "RENAMED", {})
    # renamed in the file and in the overrides separately, so that an override wins either way
    lines = apply_renames(raw, renamed, problems) + apply_renames(over, renamed, problems)
    if notes is not None:
        notes.extend(dict.fromkeys(lines))
    raw = merge(raw, over)
    cfg = _build(cls, raw, "", problems)
    if cfg is not None:  # range checks too, so that one run reports every problem
        problems.extend(p for p in validate_tree(cfg) if p not in problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def apply_renames(raw: dict[str, Any], renamed: dict[str, Any], problems: list[str]) -> list[str]:
    """Move old keys of `raw` to their new names, in place; one deprecation line per key moved.

    `renamed` maps an old dotted key (a leaf or a whole section) to its new dotted key, or to
    (new key, function converting the old value)."""
    lines = []
    for old, target in renamed.items():
        new, convert = target if isinstance(target, tuple) else (target, None)
        *old_parents, old_leaf = old.split(".")
        chain = [raw]
        for part in old_parents:
            chain.append(chain[-1].get(part) if isinstance(chain[-1], dict) else None)
        if not isinstance(chain[-1], dict) or old_leaf not in chain[-1]:
            continue
        value = chain[-1].pop(old_leaf)
        for parent, part in reversed(list(zip(chain[:-1], old_parents, strict=True))):
            if parent[part] == {}:
                del parent[part]  # a section left empty by the move (e.g. all of `sample:`)
        if convert is not None:
            value = convert(value)
        *new_parents, new_leaf = new.split(".")
        dest = raw
        for part in new_parents:
            dest = dest.setdefault(part, {})
        if new_leaf in dest and not (isinstance(dest[new_leaf], dict) and isinstance(value, dict)):
            problems.append(f"{old} and {new} are the same setting (renamed to {new}); keep only {new}")
            continue
        dest[new_leaf] = merge(value, dest[new_leaf]) if new_leaf in dest else value
        lines.append(f"deprecated: the config key {old} is now {new}; the old name stops working in the next release")
    return lines


def validate_tree(cfg: Any, prefix: str = "") -> list[str]:
    """Run `validate()` on every section; each returns messages naming keys relative to itself."""
    problems: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            problems += validate_tree(value, f"{prefix}{f.name}.")
    if hasattr(cfg, "validate"):
        try:
            problems += [f"{prefix}{msg}" for msg in cfg.validate()]
        except TypeError:  # a value of the wrong type, already reported by the loader
            pass
    return problems


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(raw, dict):
        problems.append(f"{prefix.rstrip('.') or 'config'} must be a mapping, found {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            problems.append(f"unknown key {prefix}{key}{hint}")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    for name, f in fields.items():
        is_section = dataclasses.is_dataclass(hints[name])
        if name not in kwargs and is_section:
            kwargs[name] = _build(hints[name], {}, f"{prefix}{name}.", problems)
        elif name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"missing required key {prefix}{name} ({f.metadata.get('help', '')})")
    if any(v is None and dataclasses.is_dataclass(hints[k]) for k, v in kwargs.items()):
        return None
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key was missing: already reported above
        if not problems:
            problems.append(f"{prefix or 'config'}: {exc}")
        return None


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, f"{key}.", problems)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        sub: list[str] = []
        for arg in non_none:
            sub = []
            out = _coerce(arg, value, key, sub)
            if not sub:
                return out
        problems.extend(sub)
        return value
    if origin is typing.Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            # YAML 1.1 reads no/off/yes/on as booleans: `mixed_precision: no` means the string
            spelled = [a for a in args if str(a).lower() in (("yes", "on", "true") if value else ("no", "off", "false"))]
            value = spelled[0] if spelled else value
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_txt = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key}={value!r} is not one of {', '.join(map(str, args))}{hint_txt}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key} must be a list, found {value!r}")
            return value
        item = args[0] if args else Any
        return [_coerce(item, v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            problems.append(f"{key} must be a mapping, found {value!r}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{key} must be true or false, found {value!r}")
        return value
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.append(f"{key} must be an integer, found {value!r}")
        return value
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        # nan and inf are numbers to float() but no setting means them: lr=inf trained NaN weights
        what = "a finite number" if number is not None else "a number"
        problems.append(f"{key} must be {what}, found {value!r}")
        return value
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{key} must be a string, found {value!r}")
        return value
    return value
