"""Config files read strictly: a key written twice in one mapping is refused with both lines (YAML's rule, which
PyYAML does not enforce), and so are a folder, a binary or non-UTF-8 file, and a number too large for any setting."""

from __future__ import annotations

import codecs
import difflib
import json
from pathlib import Path
from typing import Any

import yaml

from toolkit.config.errors import ConfigError
from toolkit.config.user_paths import UnusablePath, expand_path, from_here

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
SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


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


class NotYaml(ConfigError):
    """Text that does not parse as YAML."""


class Unparsed(str):
    """An override's text that is not YAML: a string where a string is wanted, its YAML error where a list or
    mapping is."""

    def __new__(cls, text: str, problem: str):
        out = super().__new__(cls, text)
        out.problem = problem
        return out


class HugeNumber(str):
    """An integer too long for Python to convert (over 4,300 digits): kept as its text, refused by the loader."""


class _StrictLoader(yaml.SafeLoader):
    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            return HugeNumber(node.value)


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
        raise NotYaml([f"{name} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"]) from None
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
