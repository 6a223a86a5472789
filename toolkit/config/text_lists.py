"""A list of strings given on the command line (samples.prompts, adapter.target_modules, logging.trackers, ...).

Read as YAML, `samples.prompts=[How do I open a file?, What is a dict?]` fails (a `?` or `: ` inside a flow list is
YAML syntax), `[Q: what is x?]` is a mapping, `[yes]` a boolean and `Q: what is x?` alone a mapping: text a user meant
as prompts. A key whose type is a list of strings reads its override here instead: `[a, b]` is its entries, split at
the commas outside quotes, each taken as written unless it is quoted ("a, b" or 'a, b', read as YAML reads them);
anything else is one entry, as YAML reads it where that is a string (`"a"` -> a), else as written. Where it still
does not read (a quote or the bracket left open), the error shows a spelling that does, quoted for the shell.
"""

from __future__ import annotations

import json
import shlex
import typing
from typing import Any

import yaml

from toolkit.config.errors import ConfigError


def is_text_list(hint: Any) -> bool:
    """Whether a key of this type holds a list of strings (list[str], or list[str] | None)."""
    if typing.get_origin(hint) is list:
        return typing.get_args(hint) == (str,)
    return any(is_text_list(a) for a in typing.get_args(hint)) if typing.get_origin(hint) is not None else False


def spelled(key: str, value: list[str] | str) -> str:
    """`key=value` as a shell argument that reads back as `value`: a list as JSON (each entry in double quotes, which
    a list of strings reads whatever the entry holds), the whole in the shell's quotes where it needs them."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, list) else value
    return shlex.quote(f"{key}={text}")


class NotAList(ValueError):
    """A bracketed text that does not read as a list of strings; its entries as best they can be guessed."""

    def __init__(self, why: str, guess: list[str]):
        super().__init__(why)
        self.guess = guess


def read_text_list(key: str, raw: str) -> list[str] | None:
    """The list of strings an override `key=raw` gives (module docstring); None for `key=` (no value)."""
    if raw == "":
        return None
    if not raw.strip().startswith("["):
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):  # a block list: `key=- a`
            return value
        return [value if isinstance(value, str) else raw]
    try:
        return entries(raw.strip())
    except NotAList as exc:
        raise ConfigError([f"override {key}={raw} does not read as a list of strings: {exc}; write each entry in double "
                           f"quotes and the whole override in single quotes, e.g. {spelled(key, exc.guess)}"]) from None


def entries(text: str) -> list[str]:
    """The entries of `[a, "b, c", 'd']`: split at the commas outside quotes; a quoted entry read as YAML reads it,
    any other taken as written, stripped. A trailing comma ends the list, as in YAML."""
    guess = [part.strip().strip("\"'") for part in text.strip("[]").split(",") if part.strip()]
    if not text.endswith("]"):
        raise NotAList("it starts with [ and does not end with ]", guess)
    inner, out, i = text[1:-1], [], 0
    if not inner.strip():
        return []
    while True:
        i = _past_blanks(inner, i)
        if inner[i:i + 1] in ("'", '"'):
            end = _closing_quote(inner, i)
            if end is None:
                raise NotAList(f"the quote {inner[i]} that starts entry {len(out) + 1} is not closed", guess)
            try:
                out.append(yaml.safe_load(inner[i:end + 1]))
            except yaml.YAMLError as exc:  # "\q": an escape YAML does not know
                raise NotAList(f"entry {len(out) + 1} does not read: {getattr(exc, 'problem', exc)}", guess) from None
            i = _past_blanks(inner, end + 1)
            if i < len(inner) and inner[i] != ",":
                raise NotAList(f"entry {len(out)} has text after its closing quote", guess)
        else:
            end = inner.find(",", i)
            end = len(inner) if end < 0 else end
            if not inner[i:end].strip():
                raise NotAList(f"entry {len(out) + 1} is empty (two commas in a row)", guess)
            out.append(inner[i:end].strip())
            i = end
        if i >= len(inner) or not inner[i + 1:].strip():  # the end, or a trailing comma
            return out
        i += 1


def _past_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def _closing_quote(text: str, start: int) -> int | None:
    """Where the quoted scalar opened at `start` closes: a double quote not escaped by a backslash, a single quote not
    doubled ('it''s', YAML's escape); None where it does not."""
    quote, i = text[start], start + 1
    while i < len(text):
        if quote == '"' and text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            if quote == "'" and text[i + 1:i + 2] == "'":
                i += 2
                continue
            return i
        i += 1
    return None
