"""The settings that the rest of a config leaves without effect, said in one line each before anything runs.

A key set away from its default where the combination does not read it makes a run silently differ from its
YAML; it is said, not refused, since an override may run a YAML written for one mode in another. Every key of
the recipe configs says on its field when it has an effect (used_when=: a Need, a callable(cfg), CheckedBy, ALWAYS)
and whether a list may repeat an entry (unique=); tests/toolkit/training/test_unused.py fails for one that does not.
Why said and not refused, and what each declaration means: docs/internals.md, toolkit/training/unused.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.config.declarations import Need, declared
from toolkit.config.keys import value_at as get


def unused_settings(cfg) -> list[str]:
    """One line for each key set away from its default where the rest of `cfg` gives it no effect."""
    lines = []
    for key, need in declared(type(cfg), "used_when").items():
        if not isinstance(need, Need) and not callable(need):
            continue  # ALWAYS read, or refused by its component (CheckedBy)
        for name, value in _set(cfg, key):
            if isinstance(need, Need):
                state = get(cfg, need.on, absent="text" if need.on == "data.format" else None)
                if state in need.values:
                    continue
                lines.append(f"note: {name}={_said(value)} is ignored: {need.on}={_said(state)} gives it no effect (it "
                             f"is {need.whose})")
            elif (why := need(cfg)) is not None:
                lines.append(f"note: {name}={_said(value)} is ignored: {why}")
    return lines


def _set(cfg, key: str) -> list[tuple[str, Any]]:
    """(the key's name, its value) where it is set away from its default: a key of each entry of a list of sections
    (`data.sources[].text_column`) once for each entry that sets it, named by its place (`data.sources[1].text_column`)."""
    if "[]." not in key:
        value = get(cfg, key, absent=dataclasses.MISSING)
        return [] if value is dataclasses.MISSING or value == get(type(cfg)(), key) else [(key, value)]
    listed, _, name = key.partition("[].")
    found = []
    for i, entry in enumerate(get(cfg, listed) or []):
        field = {f.name: f for f in dataclasses.fields(entry)}[name] if entry is not None else None
        if field is None:
            continue  # an entry the loader could not build, and said why
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if getattr(entry, name) != default:
            found.append((f"{listed}[{i}].{name}", getattr(entry, name)))
    return found


def repeated_entries(cfg) -> list[str]:
    """One problem for each list that names an entry more than once where its field says unique=True."""
    problems = []
    for key in (k for k, unique in declared(type(cfg), "unique").items() if unique):
        values = get(cfg, key) or []
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            problems.append(f"{key} names {', '.join(twice)} more than once; list each once")
    return problems


def _said(value: Any) -> str:
    if value is None:
        return ""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return repr(text) if not text.isprintable() else text  # a line break would split the one line
