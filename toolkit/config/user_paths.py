"""Paths as users write them, in a config's path keys and in the recipes' path options: one way, everywhere.

`~` and `~user` for a home folder, `$VAR` and `${VAR}` for an environment variable, as a shell would expand them
(a YAML file, a quoted argument and `key=~/x` on the command line reach the toolkit unexpanded). Relative paths are
relative to where the command runs, never to the file that names them: a relative path a config gives that is found
only beside the config is said in one line. The keys that hold paths are each recipe config's PATHS
(toolkit.training.recipe_config); the options, each recipe's own list.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


class UnusablePath(ValueError):
    """A path that cannot mean what its user meant (an unset variable, an unknown user); its text is the one line."""


_VARIABLE = re.compile(r"\$(\w+|\{([^}]*)\})")


def expand_path(text: str, name: str) -> str:
    """A path as users write it, in a config key or a command-line option (`name`, for the error): `~` and `~user`
    for a home folder, `$VAR` and `${VAR}` for an environment variable, as a shell would; relative paths stay
    relative to where the command runs. A variable that is not set, or a user that does not exist, is refused in one
    line (the shell would give an empty string, and a path that silently means something else). A Jinja template's
    text (a newline, `{{` or `{%`: data.chat_template takes either) is not a path, and is left as it is."""
    if "\n" in text or "{{" in text or "{%" in text:
        return text
    said = f"{name} {text}" if name.startswith("-") else f"{name}={text}"  # an option, or a config key
    for match in _VARIABLE.finditer(text):
        variable = match.group(2) if match.group(2) is not None else match.group(1)
        if variable not in os.environ:
            raise UnusablePath(f"{said} names the environment variable {variable}, which is not set; set it "
                            f"(export {variable}=...) or write the path out")
    expanded = os.path.expanduser(os.path.expandvars(text))
    if expanded.startswith("~"):
        user = expanded[1:].split("/")[0]
        raise UnusablePath(f"{said}: there is no user {user!r} whose home ~{user} could be; write ~/ for yours, "
                        "or the path in full")
    return expanded


def expand_paths(cfg: Any, keys: dict[str, str]) -> list[str]:
    """expand_path on each of `keys` (dotted, `[]` for every item of a list of sections) that `cfg` holds, in place;
    a line for each that cannot be expanded."""
    problems = []
    for key in keys:
        for owner, leaf, shown in _holders(cfg, key.split("."), ""):
            value = getattr(owner, leaf, None)
            if isinstance(value, str):
                try:
                    setattr(owner, leaf, expand_path(value, shown))
                except UnusablePath as exc:
                    problems.append(str(exc))
    return problems


def only_beside_the_config(cfg: Any, keys: dict[str, str], from_file: dict, over: dict, config: Path) -> list[str]:
    """A line for each relative path the config file gives (an override is typed where the command runs) that is
    not where the command runs but is beside the file: relative paths are relative to where you launch, and taking
    the file's folder instead would make the same YAML mean two things."""
    found, folder = [], Path(os.path.normpath(config.absolute().parent))
    for key in keys:
        parts = key.split(".")
        if not _given(from_file, parts) or _given(over, parts):
            continue
        for owner, leaf, shown in _holders(cfg, parts, ""):
            value = getattr(owner, leaf, None)
            if not isinstance(value, str) or not value or Path(value).is_absolute() or Path(value).exists():
                continue
            beside = folder / value
            if beside.exists():
                found.append(f"{shown}={value} (in {config}) is not in {Path.cwd()}, where relative paths start, but it "
                             f"is beside the config; write {shown}={beside}, or launch from {folder}")
    return found


def _given(tree: dict, parts: list[str]) -> bool:
    """Whether a mapping of settings gives the dotted key `parts` (a list of sections: the list itself)."""
    node: Any = tree
    for part in parts:
        if not isinstance(node, dict) or part.removesuffix("[]") not in node:
            return False
        node = node[part.removesuffix("[]")]
        if part.endswith("[]"):
            return True
    return True


def _holders(node: Any, parts: list[str], prefix: str):
    """(the section, its field's name, the key as errors name it) for each place a dotted key names."""
    head, rest = parts[0], parts[1:]
    name = head.removesuffix("[]")
    if not rest:
        yield node, name, prefix + name
        return
    child = getattr(node, name, None)
    if head.endswith("[]"):
        for i, item in enumerate(child or []):
            yield from _holders(item, rest, f"{prefix}{name}[{i}].")
    elif child is not None:
        yield from _holders(child, rest, f"{prefix}{name}.")



def from_here(path: Path) -> str:
    """`path` as it works from where the command runs: relative when it is below this folder, else absolute (a hint
    of recipes/configs/X.yaml, given in another folder, named the very path that was not found)."""
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else relative


def cache_dir(override: str | None = None) -> Path:
    """Where the toolkit caches tokenizers, packed data and dequantised models."""
    if override:
        return Path(override)
    return Path(os.environ.get("LLM_TOOLKIT_CACHE", Path.home() / ".cache" / "llm-toolkit"))
