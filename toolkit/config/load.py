"""Typed, validated recipe configs: a YAML file plus `key.sub=value` overrides into dataclasses.

Every component owns a dataclass whose fields carry a one-line `help`. Loading checks every key (unknown ones get
the closest valid name), coerces types the way YAML users expect ("1e-3" is a float), runs each section's
`validate()`, and reports *all* problems in one `ConfigError` rather than stopping at the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from toolkit.config.errors import ConfigError
from toolkit.config.files import (
    HugeNumber,
    NotYaml,
    Unparsed,
    _not_a_launch_config,
    parse_yaml,
    read_config_file,
)
from toolkit.config.keys import dotted_keys, is_set
from toolkit.config.text_lists import is_text_list, read_text_list, spelled
from toolkit.config.user_paths import expand_path, expand_paths, only_beside_the_config

T = TypeVar("T")


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
          resume: Any = dataclasses.MISSING, used_when: Any = dataclasses.MISSING, path: Any = dataclasses.MISSING,
          unique: Any = dataclasses.MISSING, accepts: Any = dataclasses.MISSING):
    """A dataclass field with its one-line documentation and what the key declares, each once, here: what a resume
    does with its change, when it has an effect, whether it is a path (None: text, not a path), whether a list may
    repeat an entry, the edge values a run takes and why (toolkit.config.declarations, which walks them)."""
    said = {"resume": resume, "used_when": used_when, "path": path, "unique": unique, "accepts": accepts}
    metadata = {"help": help, **{k: v for k, v in said.items() if v is not dataclasses.MISSING}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def parse_overrides(args: list[str], text_lists: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """`["train.lr=3e-4", "output_dir=runs/x"]` -> nested dict, values parsed as YAML scalars; the keys in
    `text_lists` (lists of strings) read as toolkit.config.text_lists reads them."""
    for i, arg in enumerate(args):  # first: `key=[How` alone does not read either, and its error would hide why
        if "=" not in arg and i and "=" in args[i - 1]:
            raise ConfigError([split_by_the_shell(args, i, text_lists)])
    tree: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError([f"override {arg!r} is not key=value (for example train.max_steps=200)"])
        key, raw = arg.split("=", 1)
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError([f"override {arg!r} has an empty name before a dot or its '='; write it like "
                               "train.max_steps=200"])
        if key.strip() in text_lists:
            value = read_text_list(key.strip(), raw)
        else:
            try:
                # `key=` is null; `key=~` is the home folder, as a shell would read it (YAML's ~ is null)
                value = parse_yaml(raw, f"override {key}") if raw not in ("", "~") else {"": None, "~": "~"}[raw]
            except NotYaml as exc:
                # `data.path=*.txt` is a YAML alias that does not parse: the text as written, typed by its key
                value = Unparsed(raw, exc.problems[0])
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override {arg!r} sets a key under {part!r}, which is not a section"])
            node = child
        node[parts[-1]] = value
    return tree


def split_by_the_shell(args: list[str], i: int, text_lists: frozenset[str] | set[str]) -> str:
    """The error for args[i], a word with no `=` after an override: the shell split that override's value at its
    spaces (`samples.prompts=How do I open a file?` unquoted); the override whole, quoted, is what works."""
    start, end = i - 1, i
    while end < len(args) and "=" not in args[end]:
        end += 1
    key, raw = " ".join(args[start:end]).split("=", 1)
    value: list[str] | str = raw
    if key.strip() in text_lists:
        try:
            value = read_text_list(key.strip(), raw)
        except ConfigError:
            value = raw
    return (f"override {args[i]!r} is not key=value: the shell split the value of {key.strip()} at its spaces into "
            f"{end - start} arguments; quote the override whole, e.g. {spelled(key.strip(), value)}")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    cls: type[T], path: str | Path | None, overrides: list[str] | None = None, notes: list[str] | None = None,
    given: dict[str, str] | None = None,
) -> T:
    """Read `path` (YAML), apply overrides, build and validate `cls`; `given` (when given) gets each dotted key the
    file or the overrides set, with where: "config" or "command line" (an override wins).

    Keys renamed in `cls.RENAMED` still work for one release: they are moved to their new
    name, and `notes` (when given) gets one deprecation line for each, and the lines of the config's own
    `notes()` (settings the rest of it leaves without effect). The keys of `cls.PATHS` hold paths: `~` and
    environment variables in them are expanded (expand_path), once, here."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(path, notes)
        _not_a_launch_config(raw, path)
    problems: list[str] = []
    keys = dotted_keys(cls)
    over = parse_overrides(overrides or [], {key for key, hint in keys.items() if is_text_list(hint)})
    renamed = getattr(cls, "RENAMED", {})
    # renamed in the file and in the overrides separately, so that an override wins either way
    lines = apply_renames(raw, renamed, problems) + apply_renames(over, renamed, problems)
    if notes is not None:
        notes.extend(dict.fromkeys(lines))
    from_file = raw
    if given is not None:
        for key in keys:
            where = "command line" if is_set(over, key) else "config" if is_set(from_file, key) else None
            if where is not None:
                given[key] = where
    raw = merge(raw, over)
    cfg = _build(cls, raw, "", problems)
    if cfg is not None:  # before the range checks: they look for the files paths name
        problems += expand_paths(cfg, getattr(cls, "PATHS", {}))
        if path is not None:
            problems += only_beside_the_config(cfg, getattr(cls, "PATHS", {}), from_file, over,
                                               Path(expand_path(str(path), "--config")))
    if cfg is not None:  # range checks too, so that one run reports every problem
        reported = {_problem_key(p) for p in problems}  # a value of the wrong type is not range-checked again
        problems.extend(p for p in validate_tree(cfg) if p not in problems and _problem_key(p) not in reported)
    if problems:
        raise ConfigError(problems)
    if notes is not None and hasattr(cfg, "notes"):
        notes.extend(cfg.notes())
    return cfg


def _problem_key(problem: str) -> str:
    """The dotted key a problem names first: `optim.betas[1] must be ...` and `optim.betas=[...] must` -> optim.betas."""
    return problem.split(" ", 1)[0].split("=", 1)[0].split("[", 1)[0]


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
    if not isinstance(raw, dict):  # with the keys it takes: a list of paths for data.sources told nothing of them
        names = [f.name for f in dataclasses.fields(cls)]
        keys = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        problems.append(_not_a(raw, f"a mapping of its keys ({keys})", prefix.rstrip(".") or "config"))
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


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the largest value a setting keeps on the device
# torch and numpy hold integers in 64 bits; a larger one fails deep inside them ("Overflow when unpacking long")
INT_MAX = 2**63 - 1


def _shown(value: Any) -> str:
    """A value for a message: a number of hundreds of digits is described, not printed."""
    text = str(value)
    if isinstance(value, (int, str)) and len(text) > 20 and text.lstrip("+-").isdigit():
        return f"a {len(text.lstrip('+-'))}-digit number"
    return repr(value)


def _not_a(value: Any, wanted: str, key: str) -> str:
    if isinstance(value, Unparsed):
        return f"{value.problem} ({key} must be {wanted})"
    return f"{key} must be {wanted}, found {value!r}"


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    wants_structure = dataclasses.is_dataclass(hint) or hint is dict or typing.get_origin(hint) in (list, tuple, dict)
    if isinstance(value, Unparsed) and not wants_structure:
        value = str(value)  # the text as written, a plain string from here on
    if isinstance(value, (HugeNumber, int)) and not isinstance(value, bool) and hint not in (str, float) and (
        isinstance(value, HugeNumber) or abs(value) > INT_MAX
    ):
        problems.append(f"{key} is {_shown(value)}, beyond what any setting takes (at most {INT_MAX:,})")
        return value
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
            # YAML 1.1 reads no/off/yes/on as booleans: `mixed_precision: no` means the string (and `false`, none)
            said = ("yes", "on", "true") if value else ("no", "off", "false", "none")
            spelled = [a for a in args if str(a).lower() in said]
            if not spelled:  # said as YAML's boolean, not as True: the user wrote yes, on or true (no, off, false)
                problems.append(f"{key}={'/'.join(said[:3])} (YAML's {str(value).lower()}) is not one of "
                                f"{', '.join(map(str, args))}")
                return value
            value = spelled[0]
        if value not in args:
            same_letters = [str(a) for a in args if str(a).lower() == str(value).lower()]  # LoRA for lora
            close = same_letters or difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_txt = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key}={value!r} is not one of {', '.join(map(str, args))}{hint_txt}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str) and not isinstance(value, Unparsed) and args == (str,):
            value = [value]  # one string where a list of strings is wanted: a list of one (`trackers: tensorboard`)
        if not isinstance(value, (list, tuple)):
            problems.append(_not_a(value, "a list", key))
            return []  # reported: the sections' range checks see an empty list
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        # a section that did not build is reported: the range checks see the others
        return [v for v in items if v is not None] if dataclasses.is_dataclass(item) else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            problems.append(_not_a(value, "a mapping", key))
            return {}
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
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 1e3 (no dot, no exponent sign) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, float) and number.is_integer():
            value = number
            if abs(value) > INT_MAX:
                problems.append(f"{key}={value:g} is beyond what any setting takes (at most {INT_MAX:,})")
                return value
            return int(value)
        problems.append(f"{key} must be an integer, found {_shown(value)}")
        return value
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf  # float() of a 400-digit int overflows
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and abs(number) <= FLOAT32_MAX:
            return number
        # nan and inf are numbers to float() but no setting means them: lr=inf trained NaN weights; past float32's
        # range (lr=1e308) a setting is inf on the device, where the weights and their arithmetic are float32 or less
        what = "a finite number" if number is None or not math.isfinite(number) else f"at most {FLOAT32_MAX:.3g}"
        what = "a number" if number is None else what
        problems.append(f"{key} must be {what}, found {_shown(value)}")
        return value
    if hint is str:
        if isinstance(value, str) and "\0" in value:  # no path, name or text a setting takes holds one (the OS refuses)
            problems.append(f"{key} holds a NUL byte (\\0), which no path, name or text can hold; remove it")
            return value
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{key} must be a string, found {value!r}")
        return value
    return value
