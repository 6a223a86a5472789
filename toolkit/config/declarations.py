"""What each key of a config declares on its field, and the walk that gathers it into tables.

A key says on its `field(...)` what a resume does with its change (`resume=`), when it has an effect
(`used_when=`), whether it is a path (`path=`, toolkit.run.paths' roles), whether a list may repeat an entry
(`unique=`) and which edge values a run takes (`accepts=`). `declared` derives each consumer's table from the
config classes; `undeclared` names every key that leaves one out. Why: docs/internals.md,
toolkit/config/declarations.py.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, NamedTuple

DECLARATIONS = ("resume", "used_when", "path", "unique", "accepts")  # field()'s keywords, kept in its metadata


class Need(NamedTuple):
    """`key` has an effect only where `on` (a dotted key) is one of `values`; `whose` says whose setting it is."""

    on: str
    values: tuple
    whose: str


class CheckedBy(NamedTuple):
    """The key's check sits with its component, which knows the combination: `where`."""

    where: str


ALWAYS = "always"  # used_when: read by every combination the recipes accept


class Resume(NamedTuple):
    """What a resume does with a change of the key since its checkpoint: `kind` (RESUME_KINDS), and `why` for a
    refused or a free one (said in the refusal, or the proof that it changes nothing)."""

    kind: str
    why: str = ""


def refused(why: str) -> Resume:
    """Refused, naming `why`: the key decides which tokens a step sees, what the ids mean, the shape or what trains."""
    return Resume("refused", why)


def free(why: str) -> Resume:
    """Free to change: where and how the same numbers are computed, saved or reported (`why`, with its proof)."""
    return Resume("free", why)


OWN_CHECK = Resume("own check")  # the data order and mixture: toolkit.checkpoint.settings' own checks
SCHEDULE = Resume("schedule")  # taken from the resumed step on, the schedule rebuilt; said in one line
FROM_NEXT_STEP = Resume("from the next step")  # read at every step: taken, said in one line
KEPT_BY_THE_OPTIMIZER = Resume("kept by the optimizer")  # AdamW's saved state carries it: refused
RESUME_KINDS = ("refused", "free", *(r.kind for r in (OWN_CHECK, SCHEDULE, FROM_NEXT_STEP, KEPT_BY_THE_OPTIMIZER)))
# the reasons many refused keys share
TOKENS = "it decides which tokens each step reads"
IDS = "it decides what the token ids mean"
SHAPE = "it decides the model's shape and which weights train"


@functools.cache
def declarations(cls: type, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every key of a config tree by its dotted name (the keys of a list of sections as `data.sources[].path`), with
    its type hint ("hint") and what its field declares; a field that overrides one keeps what it does not say."""
    hints = typing.get_type_hints(cls)
    found: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):  # a section: its keys are the keys
            found |= _section(f, hint, f"{prefix}{f.name}.")
            continue
        said = [vars(base)["__dataclass_fields__"][f.name].metadata for base in reversed(cls.__mro__)
                if f.name in vars(base).get("__dataclass_fields__", {})]
        found[prefix + f.name] = {"hint": hint, **{k: v for m in said for k, v in m.items() if k in DECLARATIONS}}
        listed = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if typing.get_origin(hint) is list and listed:
            found |= declarations(listed[0], f"{prefix}{f.name}[].")
    return found


def _section(f: dataclasses.Field, hint: type, prefix: str) -> dict[str, dict[str, Any]]:
    stray = [k for k in DECLARATIONS if k in f.metadata]
    if stray:
        raise TypeError(f"the section {prefix[:-1]} declares {', '.join(stray)}: a section has no value of its own; "
                        "declare them on its keys' fields")
    return declarations(hint, prefix)


def declared(config: type | tuple[type, ...], what: str) -> dict[str, Any]:
    """{dotted key: its declaration of `what`} over one config tree or several (a key they share declared alike),
    in field order; a key that declares none is left out."""
    table: dict[str, Any] = {}
    for cls in config if isinstance(config, tuple) else (config,):
        for key, said in declarations(cls).items():
            if what in said and table.setdefault(key, said[what]) != said[what]:
                raise TypeError(f"{key} declares {what} as {table[key]!r} and as {said[what]!r}: declare it alike")
    return table


def is_text(hint: Any) -> bool:
    """Whether a key of this type holds text (str, str | None, list[str], dict[str, ...]): a path, or not one."""
    return hint is str or any(is_text(a) for a in typing.get_args(hint) if not isinstance(a, str))


def required(key: str, hint: Any) -> set[str]:
    """What a key of this type must declare: every key what a resume does and when it has an effect, a list whether
    it may repeat an entry, text whether it is a path; a key inside a list (`data.sources[].path`) when it has an
    effect and whether it is a path (a resume checks the list whole)."""
    needs = {"path"} if is_text(hint) else set()
    if "[]" in key:
        return needs | {"used_when"}
    return needs | {"resume", "used_when"} | ({"unique"} if typing.get_origin(hint) is list else set())


def undeclared(config: type) -> list[str]:
    """One line for each key of `config` that leaves out a declaration its type requires, declares one its type does
    not take, or declares one of a kind nothing reads."""
    lines = []
    for key, said in declarations(config).items():
        needs, optional = required(key, said["hint"]), {"accepts"} if "[]" not in key else set()
        lines += [f"{key} declares no {what}=: say it on its field (toolkit.config.declarations)"
                  for what in DECLARATIONS if what in needs and what not in said]
        lines += [f"{key} declares {what}=, which a key of type {_name(said['hint'])} does not take: drop it"
                  for what in DECLARATIONS if what in said and what not in needs | optional]
        lines += [f"{key} declares {what}={said[what]!r}, {why}" for what, why in (
            ("resume", f"not a Resume of {', '.join(RESUME_KINDS)}"),
            ("used_when", "not ALWAYS, a Need, a CheckedBy or a callable(cfg)"),
            ("path", "not a role of toolkit.run.paths (OUTPUT, CACHE, READ, RESUME) or None"),
            ("unique", "not true or false")) if what in said and not _valid(what, said[what])]
    return lines


def _valid(what: str, value: Any) -> bool:
    if what == "resume":
        return isinstance(value, Resume) and value.kind in RESUME_KINDS
    if what == "used_when":
        return value == ALWAYS or isinstance(value, (Need, CheckedBy)) or callable(value)
    if what == "path":
        return value is None or isinstance(value, str)
    return isinstance(value, bool)


def _name(hint: Any) -> str:
    return str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
