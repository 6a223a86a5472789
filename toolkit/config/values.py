"""What a path or a name setting can hold: the checks the config sections' validate() share.

A value the loader takes by its type (a string) can still be one no run can use: an output_dir of "" is the
folder the run was launched from, a blank data.path or a 5,000-character cache_dir fails only when the run first
opens it, with the file system's own words. Each is refused at load, in one line naming the key
(tests/toolkit/config/test_values.py walks every key's edge values)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from toolkit.config.errors import UserError
from toolkit.run.folder import check_path_length


def path_problems(cfg: Any, names: tuple[str, ...]) -> list[str]:
    """Path settings of `cfg` that no run can use, one line each, caught at load rather than when the path is first
    opened (after data work, or after training): blank (output_dir="" is the folder the run was launched from), a
    line break, or a path longer than the file system takes (toolkit.run.folder.check_path_length). None (`key=`, the
    default) is not checked."""
    problems = []
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, str):
            continue
        if not value.strip():
            default = defaults.get(name)
            fix = "leave the key empty for the default" if default is None else f"drop it for the default, {default}"
            problems.append(f"{name}={value!r} is blank; give a path, or {fix}")
        elif any(c in value for c in "\n\r"):
            problems.append(f"{name}={value[:60]!r} holds a line break; give the path on one line")
        else:
            try:  # a folder name past the file system's NAME_MAX, or the whole past PATH_MAX
                check_path_length(name, Path(value))
            except UserError as exc:
                problems.append(str(exc))
    return problems


def name_problems(cfg: Any, names: tuple[str, ...], fix: str = "give the name as your data has it") -> list[str]:
    """Name settings of `cfg` (a column, a split, a speaker) that are blank or hold a line break: nothing is
    called that, and the run would fail, or silently read nothing, once the data is open."""
    problems = []
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, str) and (not value.strip() or any(c in value for c in "\n\r")):
            what = "is blank" if not value.strip() else "holds a line break"
            problems.append(f"{name}={value[:60]!r} {what}; {fix}")
    return problems
