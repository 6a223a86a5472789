"""Typed, validated recipe configs: a YAML file plus `key.sub=value` overrides into dataclasses.

Every component owns a dataclass whose fields carry a one-line `help`; a recipe composes them
into one tree. Loading checks every key (unknown ones get the closest valid name), coerces
types the way YAML users expect ("1e-3" is a float), runs each section's `validate()`, and
reports *all* problems in one `ConfigError` rather than stopping at the first.

Files are read strictly (`read_yaml`, `read_json`): a key written twice in one mapping is refused
with both lines (YAML's rule, which PyYAML does not enforce: the last would win with no word), and
so are a folder, a binary or non-UTF-8 file, and a number too large for any setting.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from toolkit.user_paths import UnusablePath, expand_path, expand_paths, from_here, only_beside_the_config

T = TypeVar("T")


class UserError(Exception):
    """A mistake in what the user asked for; recipes print it as one line, with no traceback."""


def first_line(exc: BaseException) -> str:
    """What an exception says, as a clause of a one-line error: its first line (at most 300 characters), or its
    type if it says nothing."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


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
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError([f"override {arg!r} has an empty name before a dot or its '='; write it like "
                               "train.max_steps=200"])
        try:
            # `key=` is null; `key=~` is the home folder, as a shell would read it (YAML's ~ is null)
            value = parse_yaml(raw, f"override {key}") if raw not in ("", "~") else {"": None, "~": "~"}[raw]
        except _NotYaml as exc:
            # `data.path=*.txt` is a YAML alias that does not parse: the text as written, typed by its key
            value = _Unparsed(raw, exc.problems[0])
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
    name, and `notes` (when given) gets one deprecation line for each, and the lines of the config's own
    `notes()` (settings the rest of it leaves without effect). The keys of `cls.PATHS` hold paths: `~` and
    environment variables in them are expanded (expand_path), once, here."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(path, notes)
        _not_a_launch_config(raw, path)
    problems: list[str] = []
    over = parse_overrides(overrides or [])
    renamed = getattr(cls, "RENAMED", {})
    # renamed in the file and in the overrides separately, so that an override wins either way
    lines = apply_renames(raw, renamed, problems) + apply_renames(over, renamed, problems)
    if notes is not None:
        notes.extend(dict.fromkeys(lines))
    from_file = raw
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


# keys only an accelerate config or a DeepSpeed JSON has: such a file given as --config is the other option's
LAUNCH_CONFIG_KEYS = {"compute_environment": "an accelerate config", "num_processes": "an accelerate config",
                      "zero_optimization": "a DeepSpeed JSON", "train_micro_batch_size_per_gpu": "a DeepSpeed JSON"}


def _not_a_launch_config(raw: dict[str, Any], path: str | Path) -> None:
    """One line, not a problem per key, for a launch's config given where the recipe's goes."""
    found = [key for key in LAUNCH_CONFIG_KEYS if key in raw]
    if found:
        kind = LAUNCH_CONFIG_KEYS[found[0]]
        where = "--config_file" if kind.startswith("an accelerate") else "the accelerate config's deepspeed_config_file"
        raise ConfigError([f"--config {path} is {kind} ({', '.join(found)}), not a recipe's; give it as {where}, and "
                           f"a recipe YAML as --config, e.g. {from_here(SHIPPED_CONFIGS / 'pretrain_tiny.yaml')}"])


# The configs the recipes ship, for the hint when --config names something else.
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"


def read_config_file(path: str | Path, notes: list[str] | None = None) -> dict[str, Any]:
    """The mapping a `--config` file holds (YAML, or JSON for a .json file), refused in one line
    when it is not one. An empty file takes every default, and `notes` says so."""
    if not str(path).strip():  # Path("") is the folder the command runs in
        raise ConfigError([f"--config {str(path)!r} names no file; give a config file, e.g. "
                           f"{from_here(SHIPPED_CONFIGS / 'pretrain_tiny.yaml')}"])
    try:
        path = Path(expand_path(str(path), "--config"))
    except UnusablePath as exc:
        raise ConfigError([str(exc)]) from None
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.yaml"))
        hint = (f"e.g. {path / inside[0]} (it has {len(inside)})" if inside
                else f"e.g. {from_here(SHIPPED_CONFIGS / 'pretrain_tiny.yaml')}")
        raise ConfigError([f"--config {path} is a folder; give a config file, {hint}"])
    if not path.exists():
        shipped = sorted(p.name for p in SHIPPED_CONFIGS.glob("*.yaml"))
        close = difflib.get_close_matches(path.name, shipped, n=1)
        hint = (f"did you mean {from_here(SHIPPED_CONFIGS / close[0])}?" if close
                else f"the shipped ones are in {from_here(SHIPPED_CONFIGS)}/")
        raise ConfigError([f"--config {path} does not exist; {hint}"])
    if not path.is_file():  # /dev/zero, a FIFO: reading would never end
        raise ConfigError([f"--config {path} is not a regular file; give a YAML config file"])
    if path.suffix == ".json":
        raw = read_json(path)
    else:
        raw = read_yaml(path)
    if raw is None:
        if notes is not None:
            notes.append(f"{path} holds no settings: every key takes its default")
        return {}
    if not isinstance(raw, dict):
        found = {list: "a list", str: "a single string", bool: "a single true/false"}.get(type(raw), "a single number")
        raise ConfigError([f"{path} must hold a mapping of keys (key: value lines), found {found}"])
    return raw


def utf16_sign(head: bytes) -> str | None:
    """Why a file whose first bytes are `head` is UTF-16 or UTF-32 text ("a UTF-16 byte-order mark"), or None:
    its byte-order mark, or (without one) a NUL in every other byte, as ASCII text has in UTF-16."""
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if head.startswith(bom):
            return f"a {name} byte-order mark"
    pairs = head[: len(head) - len(head) % 2]
    if len(pairs) >= 4 and max(pairs[0::2].count(0), pairs[1::2].count(0)) >= 0.9 * len(pairs) / 2:
        return "a NUL in every other byte, as in UTF-16"
    return None


# the first bytes of the compressed files users keep text in, and how to unpack each
ARCHIVES = {b"\x1f\x8b": ("gzip-compressed", "gunzip"), b"PK\x03\x04": ("a zip archive", "unzip"),
            b"BZh": ("bzip2-compressed", "bunzip2"), b"\xfd7zXZ\x00": ("xz-compressed", "unxz"),
            b"\x28\xb5\x2f\xfd": ("zstd-compressed", "unzstd")}


def reencode_hint(head: bytes) -> str:
    """What to do with a file that is not UTF-8, from its first bytes: UTF-16 (Windows' "Unicode", PowerShell's
    default) named as such; a compressed file or one holding NUL bytes as not text (re-encoding it from latin-1, the
    hint for anything else, would make a text of its bytes); anything else most likely latin-1."""
    sign = utf16_sign(head)
    if sign is not None:
        name = "utf-32" if "UTF-32" in sign else "utf-16"
        return f"it is {name.upper()} text ({sign}); re-encode it as UTF-8, e.g. iconv -f {name} -t utf-8"
    for magic, (what, unpack) in ARCHIVES.items():
        if head.startswith(magic):
            return f"it is {what}, not text; unpack it first ({unpack}) and give the text"
    if b"\0" in head:
        return "it holds NUL bytes, so it is a binary file, not text; give a text file"
    return "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"


def _text(path: Path) -> str:
    """A config file's text, refused in one line when it is binary or not UTF-8 (a BOM is dropped)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"{path} cannot be read: {exc.strerror}; check its permissions"]) from None
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    if utf16_sign(data[:4096]) is not None:
        raise ConfigError([f"{path} is not UTF-8 text: {reencode_hint(data[:4096])}"])
    if b"\0" in data:
        raise ConfigError([f"{path} is a binary file (it holds NUL bytes), not a config; give a {kind} file"])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError([
            f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); {reencode_hint(data[:4096])}"
        ]) from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's contents (None when it is empty), refused in one line when it does not parse,
    holds a key twice, or is not UTF-8 text."""
    path = Path(path)
    return parse_yaml(_text(path), str(path))


class _NotYaml(ConfigError):
    """Text that does not parse as YAML."""


class _Unparsed(str):
    """An override's text that is not YAML: a string where a string is wanted, its YAML error where a list or
    mapping is."""

    def __new__(cls, text: str, problem: str):
        out = super().__new__(cls, text)
        out.problem = problem
        return out


class _HugeNumber(str):
    """An integer too long for Python to convert (over 4,300 digits): kept as its text, refused by the loader."""


class _StrictLoader(yaml.SafeLoader):
    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            return _HugeNumber(node.value)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def parse_yaml(text: str, name: str) -> Any:
    """`text` as YAML; `name` (a file, or an override) starts each problem's line."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        twice = _written_twice(node, "", set())
        if twice is not None:
            key, first, second = twice
            raise ConfigError([f"{name} line {second}: {key} is written twice (lines {first} and {second}); keep one"])
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise _NotYaml([f"{name} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"]) from None
    except RecursionError:  # [[[[... thousands deep: PyYAML's composer recurses once per level
        raise ConfigError([f"{name} nests deeper than a config can (Python's recursion limit); flatten it"]) from None
    finally:
        loader.dispose()


def _written_twice(node: yaml.Node, prefix: str, seen_nodes: set[int]) -> tuple[str, int, int] | None:
    """(dotted key, its first line, its second line) for the first key written twice in one mapping.
    Each node once: aliases share nodes, and a "billion laughs" file nests them exponentially."""
    if id(node) in seen_nodes:
        return None
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := _written_twice(item, f"{prefix}[{i}].", seen_nodes)) is not None:
                return found
    if not isinstance(node, yaml.MappingNode):
        return None
    seen: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":  # `<<:` may be overridden
            line = key.start_mark.line + 1
            if (key.tag, key.value) in seen:
                return f"{prefix}{key.value}", seen[key.tag, key.value], line
            seen[key.tag, key.value] = line
        if (found := _written_twice(value, f"{prefix}{getattr(key, 'value', '?')}.", seen_nodes)) is not None:
            return found
    return None


class KeyTwice(ValueError):
    """A JSON object that holds a key twice (json keeps the last with no word)."""


def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook for objects whose keys are each written once."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise KeyTwice(f"the key {next(k for k in keys if keys.count(k) > 1)!r} is written twice in one object")
    return dict(pairs)


def read_json(path: str | Path, what: str | None = None) -> Any:
    """A JSON file's contents, refused in one line when it does not parse or an object holds a key twice
    (json keeps the last with no word). With `what` (e.g. "a DeepSpeed config"), the file must hold an object."""
    path = Path(path)
    try:
        out = json.loads(_text(path), object_pairs_hook=once)
    except KeyTwice as exc:
        raise ConfigError([f"{path}: {exc}; keep one"]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"]) from None
    except ValueError as exc:  # an integer over 4,300 digits
        raise ConfigError([f"{path} holds a number too large for any setting ({exc})"]) from None
    if what is not None and not isinstance(out, dict):
        raise ConfigError([f"{path} must hold a JSON object ({{...}}: {what}), found {_json_kind(out)}"])
    return out


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a user reads it: "a list", "a string", "null"."""
    if value is None:
        return "null"
    names = {list: "a list", dict: "an object", str: "a string", bool: "true/false"}
    return names.get(type(value), "a number")


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
    if isinstance(value, _Unparsed):
        return f"{value.problem} ({key} must be {wanted})"
    return f"{key} must be {wanted}, found {value!r}"


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    wants_structure = dataclasses.is_dataclass(hint) or hint is dict or typing.get_origin(hint) in (list, tuple, dict)
    if isinstance(value, _Unparsed) and not wants_structure:
        value = str(value)  # the text as written, a plain string from here on
    if isinstance(value, (_HugeNumber, int)) and not isinstance(value, bool) and hint not in (str, float) and (
        isinstance(value, _HugeNumber) or abs(value) > INT_MAX
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
            value = spelled[0] if spelled else value
        if value not in args:
            same_letters = [str(a) for a in args if str(a).lower() == str(value).lower()]  # LoRA for lora
            close = same_letters or difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_txt = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key}={value!r} is not one of {', '.join(map(str, args))}{hint_txt}")
        return value
    if origin in (list, tuple):
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

