"""Chat and preference records as users keep them, read from their files and turned into messages, in these shapes:

    messages            {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   (OpenAI, HF)
    sharegpt            {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}
    alpaca              {"instruction": ..., "input": ..., "output": ..., "system": ...}   (input, system optional)
    prompt_completion   {"prompt": ..., "completion": ...}   (TRL's: strings, or message lists)

`data.record_format` picks one (`auto`: each record's own); the rest: docs/internals.md, toolkit/data/records.py.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets

from toolkit.config.declarations import TOKENS, CheckedBy, Need, refused
from toolkit.config.errors import UserError, first_line
from toolkit.config.files import KeyTwice, once
from toolkit.config.load import field
from toolkit.data.corpus import hub_dataset
from toolkit.data.text_files import (
    NO_ROWS,
    datasets_quiet,
    not_parquet_error,
    parquet_problem,
    parquet_rows,
    read_utf8,
)

ROLES = ("system", "user", "assistant")
TOOL = "tool"  # a tool's result, answering an assistant's tool_calls (OpenAI's tool-calling format)
OWN_ROLES = {r: r for r in (*ROLES, TOOL)}  # role/content turns name their roles as the chat templates do
FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
# ShareGPT's `from` values as the sets in the wild write them
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant"}
SAID = {"messages": "messages (role/content)", "sharegpt": "ShareGPT (conversations of from/value)",
        "alpaca": "Alpaca (instruction/input/output)", "prompt_completion": "prompt/completion"}
FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


# what each speaker or key of a turn declares: read by chat records only, and looked up by name
_A_NAME = dict(resume=refused(TOKENS), used_when=Need("data.format", ("chat",), "chat records'"), path=None, accepts={
    "long": "a speaker or key is looked up by name: records without it are refused when read"})


@dataclass
class ColumnsConfig:
    """Records of another shape, mapped: which column holds the turns, which key of a turn names its speaker and which
    holds its text, and the speakers' own names for the user and the assistant (and the system)."""

    conversation: str | None = field(
        None, help="the column holding each record's list of turns (set: records are read by this mapping)",
        resume=refused(TOKENS), used_when=CheckedBy("FinetuneDataConfig.validate"), path=None, accepts={
            "unset": "records of a known shape: the default",
            "long": "a column is looked up by name: a missing one is refused when the data is read"},
    )
    role: str = field("role", help="the key of a turn naming its speaker", **_A_NAME)
    content: str = field("content", help="the key of a turn holding its text", **_A_NAME)
    user: str = field("user", help="the speaker's name for the user's turns", **_A_NAME)
    assistant: str = field("assistant", help="the speaker's name for the assistant's turns", **_A_NAME)
    system: str = field("system", help="the speaker's name for the system prompt", **_A_NAME)

    def roles(self) -> dict[str, str]:
        return {self.system: "system", self.user: "user", self.assistant: "assistant"}


def read_records(name: str, kind: str, key: str = "data.path", subset: str | None = None, split: str = "train") -> list:
    """The records of a .jsonl/.json/.parquet/.csv/.arrow file, of a folder or glob of such files (in name order), of
    a folder `datasets.save_to_disk` wrote, or of a hub dataset (`subset`, `split`): an id, or a local folder laid out
    as the hub lays one out (its README.md, the dataset card, tells it apart). `kind` names them in errors, and `key`
    the setting that gave `name`."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "dataset_info.json").is_file():
        try:
            with datasets_quiet():
                saved = datasets.load_from_disk(str(path))
        except Exception as exc:  # a folder missing its state.json or arrow files, or with damaged ones
            raise UserError(f"{key}={name} has datasets' dataset_info.json but cannot be read as a save_to_disk folder "
                            f"({first_line(exc)}); save it again with Dataset.save_to_disk") from None
        return _non_empty(saved, f"{key}={name}")
    if (path.is_dir() and (path / "README.md").is_file()) or (not path.exists() and _hub_id(name)):
        return _non_empty(hub_dataset(name, subset, split, key), f"{key}={name} split={split}")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in FILES)
        where = f"{key}={name} holds no {'/'.join(FILES)} files"
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        where = f"{key}={name} does not exist" if not glob.has_magic(name) else f"{key}={name} matches no file"
    if not files:
        raise UserError(f"{where}; give a {'/'.join(FILES)} file of {kind} records, a folder or glob of them, or a "
                        "folder that datasets' save_to_disk wrote")
    records = [r for f in files for r in _read_file(f, f"{key}={f if len(files) > 1 else name}")]
    if not records:
        raise UserError(f"{key}={name} holds no records")
    return records


@contextlib.contextmanager
def _no_progress_bars():
    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def _read_file(path: Path, said: str) -> list:
    """One file's records; jsonl and json are read here, for errors that name the line."""
    suffix = path.suffix.lower()
    if suffix not in FILES:
        raise UserError(f"{said} has suffix {path.suffix or '(none)'}; use one of {', '.join(FILES)}")
    if suffix == ".parquet" and (why := parquet_problem(path)) is not None:
        raise not_parquet_error(said, why)
    if suffix == ".parquet" and parquet_rows(path) == 0:
        return []  # its columns and no row: a folder's other files may hold records; none at all is said as such
    if suffix == ".csv":
        read_utf8(path, said)  # not UTF-8 (UTF-16, latin-1): said as every text file is
        if not path.read_bytes().strip():
            raise UserError(f"{said} is empty; give a csv file with a header line and a record a line")
    if FILES[suffix] != "json":
        try:
            with _no_progress_bars(), datasets_quiet():  # datasets' bar and log lines for a file read in a moment
                ds = datasets.load_dataset(FILES[suffix], data_files=str(path), split="train")
        except Exception as exc:  # pyarrow's, pandas' and datasets' own errors for a damaged file
            if NO_ROWS in str(exc):
                return []  # a table of no row: read_records says it holds no records
            cause = exc.__cause__ or exc  # datasets' DatasetGenerationError says only that an error occurred
            raise UserError(f"{said} cannot be read as {suffix[1:]}: {first_line(cause)[:200]}; write it again, or "
                            "give another file") from None
        return ds.to_list()
    text = read_utf8(path, said).removeprefix("\ufeff")  # Notepad's UTF-8 begins with a byte-order mark; json refuses it
    if suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                records.append(_record(line, f"{said} line {number}"))
        return records
    records = _json(text, said, whole_file=True)
    if not isinstance(records, list):
        raise UserError(f"{said} must hold a JSON list of records, found {type(records).__name__}")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise UserError(f"{said}: record {i} is a JSON {type(record).__name__}, not an object; each record is "
                            "one object, e.g. {\"messages\": [...]}")
    return records


def _json(text: str, said: str, whole_file: bool):
    """JSON whose objects hold each key once, or one line naming where it is not (a file's line; a line as it is)."""
    try:
        return json.loads(text, object_pairs_hook=once)
    except json.JSONDecodeError as exc:
        raise UserError(f"{said} is not valid JSON{f' at line {exc.lineno}' if whole_file else ''}: {exc.msg}") from None
    except KeyTwice as exc:
        raise UserError(f"{said}: {exc}; keep one") from None


def _record(line: str, said: str) -> dict:
    """One line of a .jsonl file as its record: a JSON object with each key once."""
    record = _json(line, said, whole_file=False)
    if not isinstance(record, dict):
        raise UserError(f"{said} is a JSON {type(record).__name__}, not an object; each line is one record, e.g. "
                        "{\"messages\": [...]}")
    return record


def _hub_id(name: str) -> bool:
    """org/name or name, and not a data file's name: what a hub id looks like (a path that does not exist may too;
    one inside a local folder, data/chats say, is that folder's, mistyped)."""
    return (re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name) is not None
            and Path(name).suffix.lower() not in {*FILES, ".txt", ".gz", ".zip", ".tar"}
            and not ("/" in name and Path(name).parent.is_dir()))


def _non_empty(ds: datasets.Dataset, said: str) -> list:
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{said} holds splits {sorted(ds)}, none named train; give the split's folder")
        ds = ds["train"]
    if len(ds) == 0:
        raise UserError(f"{said} holds no records")
    return ds.to_list()


# Every key a record or a turn carries beyond what its shape reads (role and content, from and value, ...) is handed
# to the chat template: a turn's with its turn, a record's as a variable of the template (`tools` is
# apply_chat_template's own). What the template renders trains, as its turn does; where it renders nothing of a key,
# that key is refused or said (a note counting the records), never dropped unsaid (toolkit.data.chat.rendered).
# tests/toolkit/data/test_chat.py walks every row, and a key no row names.
REFUSE, NOTE = "refused", "said"
UNRENDERED: dict[str, tuple[str, str]] = {
    "tool_calls": (REFUSE, "the assistant's answer is the call: trained on its content alone it learns to answer "
                            "without calling"),
    f"role: {TOOL}": (REFUSE, "the turns after a tool's result would be trained on a result the model never saw"),
    "tools": (NOTE, "the tool definitions: a template that shows none still trains the calls"),
    "tool_call_id": (NOTE, "which call a result answers: templates that show results in order leave it out"),
    "name": (NOTE, "a speaker's or a tool's name"),
    "reasoning_content": (NOTE, "the assistant's reasoning, where a template shows it"),
    "thinking": (NOTE, "the assistant's reasoning, where a template shows it"),
    "weight": (NOTE, "a turn's weight in the loss (axolotl's ShareGPT): every assistant turn trains alike here"),
}


def unrendered(key: str) -> str:
    """What a key the chat template renders nothing of does: refused or said (any key no row names: said)."""
    return UNRENDERED.get(key, (NOTE, ""))[0]


NEEDS = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
         "prompt_completion": ("prompt", "completion")}  # the keys each shape is known by


READS = {**NEEDS, "alpaca": ("instruction", "input", "output", "system")}  # the keys each shape reads


def record_rest(record, shape: str | None = None, columns: ColumnsConfig | None = None) -> dict:
    """A record's keys that its shape (None: its own) or data.columns does not read, with a value: handed to the chat
    template as its variables (UNRENDERED)."""
    if not isinstance(record, dict):
        return {}
    read = {columns.conversation} if columns is not None and columns.conversation else set(
        READS.get(shape or shape_of(record) or "", ()))
    return {k: v for k, v in record.items() if k not in read and v is not None}


def shape_of(record) -> str | None:
    """The shape `record` has, by its keys, or None."""
    if not isinstance(record, dict):
        return None
    return next((shape for shape, keys in NEEDS.items() if all(record.get(k) is not None for k in keys)), None)


def shapes_said(records: list, named: str = "auto", columns: ColumnsConfig | None = None) -> str:
    """The log's line for a source's records: how many, of which shapes."""
    if columns is not None and columns.conversation:
        return f"{len(records)} records, turns in `{columns.conversation}` (data.columns)"
    if named != "auto":
        return f"{len(records)} records, {SAID[named]} (data.record_format)"
    counts = Counter(shape_of(r) for r in records)
    return f"{len(records)} records: " + ", ".join(f"{n} {SAID[k]}" for k, n in counts.most_common() if k)


def _keys(record) -> str:
    if not isinstance(record, dict):
        return f"no keys (a {type(record).__name__})"
    # a column of a parquet or csv that this record has no value in is there as null
    empty = sorted(k for k, v in record.items() if v is None)
    return f"keys {sorted(k for k in record if k not in empty)}" + (f" ({', '.join(empty)}: null)" if empty else "")


def _nearly(record) -> str:
    """What a record of no shape comes closest to: a shape with some of its keys, a key one slip from a shape's,
    or a column of turns that data.columns can name."""
    if not isinstance(record, dict):
        return ""
    have = {k for k, v in record.items() if v is not None}
    if {"chosen", "rejected"} <= have:
        return " (a preference pair: train on it with data.format=preference and a train.objective)"
    for shape, keys in NEEDS.items():
        if 0 < len(have & set(keys)) < len(keys):
            return f" (nearly {SAID[shape]}: it lacks `{'`, `'.join(k for k in keys if k not in have)}`)"
    for key in sorted(have):
        close = difflib.get_close_matches(key, [k for keys in NEEDS.values() for k in keys], n=1, cutoff=0.75)
        if close:
            return f" (did you mean `{close[0]}` for `{key}`?)"
    turns = [k for k in sorted(have) if isinstance(record[k], list) and record[k] and isinstance(record[k][0], dict)]
    if turns:
        return (f" (`{turns[0]}` holds a list of turns: name it with data.columns.conversation, and its keys with "
                "columns.role and columns.content)")
    return ""


def _no_shape(record, index: int) -> UserError:
    return UserError(
        f"record {index} has {_keys(record)}{_nearly(record)}; a chat record needs `messages` (role/content), "
        "`conversations` (ShareGPT's from/value), `instruction` and `output` (Alpaca), or `prompt` and `completion`"
    )


def to_messages(record, index: int, shape: str | None = None, columns: ColumnsConfig | None = None) -> list[dict]:
    """One record of `shape` (None: its own), or read by `columns` when it names a conversation column, ->
    `[{"role", "content"}, ...]`; `index` names it in errors."""
    if columns is not None and columns.conversation:
        if not isinstance(record, dict) or record.get(columns.conversation) is None:
            raise UserError(f"record {index} has {_keys(record)}, no `{columns.conversation}` (data.columns."
                            "conversation)")
        out = _messages(record[columns.conversation], index, columns.conversation, columns.role, columns.content,
                        columns.roles())
        if not any(m["role"] == "assistant" for m in out):
            raise UserError(f"record {index} has no {columns.assistant!r} turn (data.columns.assistant), so nothing to "
                            "learn from")
        return out
    own = shape_of(record)
    shape = shape or own
    if shape is None:
        raise _no_shape(record, index)
    if own != shape:
        raise UserError(f"record {index} has {_keys(record)}, not a {SAID[shape]} record "
                        "(data.record_format); use record_format=auto to read each record by its own shape")
    if shape == "messages":
        out = _messages(record["messages"], index, "messages", "role", "content", OWN_ROLES)
    elif shape == "sharegpt":
        out = _messages(record["conversations"], index, "conversations", "from", "value", SHAREGPT_ROLES)
    elif shape == "alpaca":
        user = str(record["instruction"])
        if record.get("input"):
            user = f"{user}\n\n{record['input']}"
        out = [{"role": "user", "content": user}, {"role": "assistant", "content": str(record["output"])}]
        if record.get("system"):
            out.insert(0, {"role": "system", "content": str(record["system"])})
    else:
        out = _turns(record["prompt"], index, "prompt", "user") + _turns(record["completion"], index, "completion",
                                                                          "assistant")
    if not any(m["role"] == "assistant" for m in out):
        raise UserError(f"record {index} has no assistant message, so nothing to learn from; add one or remove it")
    return out


def _messages(turns, index: int, key: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict]:
    """`[{"role", "content", and the turn's other keys}, ...]`: what the chat template is handed (toolkit.data.chat)."""
    if not isinstance(turns, list) or not turns:
        raise UserError(f"record {index}: `{key}` must be a non-empty list of {role_key}/{text_key} mappings")
    out = []
    for j, turn in enumerate(turns):
        said = turn.get(role_key) if isinstance(turn, dict) else None
        role = roles.get(said) if isinstance(said, str) else None
        if role is None:
            raise UserError(f"record {index}: turn {j} of `{key}` has {role_key} {said!r}; use one of {', '.join(roles)}")
        # a column of a parquet or csv that this turn has no value in is there as null
        rest = {k: v for k, v in turn.items() if k not in (role_key, text_key) and v is not None}
        out.append({"role": role, "content": _text(turn.get(text_key), f"record {index}: turn {j} of `{key}` ({said})",
                                                   text_key, "tool_calls" in rest), **rest})
    return out


def _text(value, said: str, text_key: str, calls: bool) -> str:
    """A turn's text: a string; OpenAI's content parts of type text, joined; none beside tool calls."""
    if isinstance(value, str):
        return value
    if value is None and calls:  # OpenAI's assistant turn that only calls
        return ""
    if isinstance(value, list) and value and all(isinstance(part, dict) for part in value):
        kinds = sorted({str(part.get("type")) for part in value} - {"text"})
        if kinds:
            raise UserError(f"{said} has content parts of type {', '.join(kinds)}; only text trains a text model: "
                            "leave the others out")
        if all(isinstance(part.get("text"), str) for part in value):
            return "".join(part["text"] for part in value)
    raise UserError(f"{said} has no text `{text_key}`")


def _turns(value, index: int, key: str, role: str) -> list[dict]:
    """prompt/completion's halves: a string (one turn of `role`) or a role/content list."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, index, key, "role", "content", OWN_ROLES)


def _prompt(value, index: int) -> list[dict[str, str]]:
    """A preference record's prompt: a string (the user's turn) or role/content turns ending with the user's."""
    turns = _turns(value, index, "prompt", "user")
    if turns[-1]["role"] != "user":
        raise UserError(f"record {index}: the prompt's last message is the {turns[-1]['role']}'s; end it with the "
                        "user's turn")
    return turns


def _answer(value, index: int, key: str) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        value = value["content"]
    if isinstance(value, dict) and value.get("role") not in (None, "assistant"):  # a whole conversation's last turn
        raise UserError(f"record {index}: the answer of `{key}` (its last message) has role {value['role']!r}; an "
                        "answer is the assistant's: give it role assistant")
    if not isinstance(value, str):
        raise UserError(f"record {index}: `{key}` must be a string or one assistant message")
    return value


# TRL's preference shapes: answers as text (standard) or as messages (conversational), the prompt given or implicit
PAIR_SAID = {("standard", True): "standard (text), prompt given", ("standard", False): "standard (text), implicit prompt",
             ("conversational", True): "conversational (messages), prompt given",
             ("conversational", False): "conversational (messages), implicit prompt"}


def pair_shape(record) -> tuple[str, bool] | None:
    """TRL's shape of a preference record, as (standard or conversational, prompt given), or None."""
    if not isinstance(record, dict) or record.get("chosen") is None or record.get("rejected") is None:
        return None
    parts = [record.get(k) for k in ("prompt", "chosen", "rejected")]
    kind = "standard" if all(p is None or isinstance(p, str) for p in parts) else "conversational"
    return kind, record.get("prompt") is not None


def pair_shapes_said(records: list) -> str:
    """The log's words for the preference shapes of `records`, counted."""
    counts = Counter(pair_shape(r) for r in records)
    return ", ".join(f"{n} {PAIR_SAID[k]}" for k, n in counts.most_common() if k)


def _shared_opening(chosen: str, rejected: str, index: int) -> dict:
    """TRL's standard implicit prompt: two whole texts that begin alike. Their shared opening words are the prompt
    (the user's turn) and each one's rest its answer (TRL cuts at the first differing character; here at the space
    before it, so that no word is split between the prompt and an answer)."""
    shared = os.path.commonprefix([chosen, rejected])
    cut = max((i for i, c in enumerate(shared) if c.isspace()), default=0)  # the last space both have
    if not shared[:cut].strip():
        raise UserError(f"record {index}: `chosen` and `rejected` without `prompt` share no opening words to take as "
                        "the prompt; give `prompt` apart")
    return {"prompt": chosen[:cut].rstrip(), "chosen": chosen[cut:].strip(), "rejected": rejected[cut:].strip()}


def to_pair(record, index: int) -> tuple[list[dict[str, str]], str, str]:
    """One record -> (prompt messages, chosen text, rejected text); `index` names the record in errors. Without
    `prompt`, `chosen` and `rejected` are whole conversations or texts (TRL's implicit prompt): the turns both share
    are the prompt, and each one's last, the assistant's, its answer; of two texts, the words both open with."""
    if isinstance(record, dict) and record.get("prompt") is None and all(
            isinstance(record.get(k), str) for k in ("chosen", "rejected")):
        record = _shared_opening(record["chosen"], record["rejected"], index)
    if isinstance(record, dict) and record.get("prompt") is None and all(
            isinstance(record.get(k), list) and len(record[k]) > 1 for k in ("chosen", "rejected")):
        chosen, rejected = record["chosen"], record["rejected"]
        if chosen[:-1] != rejected[:-1]:
            raise UserError(f"record {index}: `chosen` and `rejected` without `prompt` must share every turn but "
                            "their last (the prompt); give `prompt` apart")
        record = {"prompt": chosen[:-1], "chosen": chosen[-1], "rejected": rejected[-1]}
    missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(record, dict) or record.get(k) is None]
    if missing:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        chat = shape_of(record) if {"chosen", "rejected"} & set(missing) else None
        nearly = f" (a chat record, {SAID[chat]}: train on it with data.format=chat)" if chat else ""
        raise UserError(f"record {index} lacks {', '.join(f'`{k}`' for k in missing)} (has {keys}){nearly}; a "
                        "preference record needs `prompt`, `chosen` and `rejected` (or `chosen` and `rejected` as whole "
                        "conversations or texts)")
    return _prompt(record["prompt"], index), _answer(record["chosen"], index, "chosen"), _answer(
        record["rejected"], index, "rejected")


FIRST_RECORDS = 100  # what the recipe checks before the model loads; the rest are read as they are tokenized


def check_first_records(data) -> None:
    """The first records of a chat or preference source (a FinetuneDataConfig) read as training will read them; the
    embedded sets and text need no check."""
    if data.format not in ("chat", "preference") or not data.path:
        return
    shape = None if data.record_format == "auto" else data.record_format
    for key, path, hub in (("data.path", data.path, (data.name, data.split)), ("data.val_path", data.val_path, ())):
        for i, record in enumerate(read_records(path, data.format, key, *hub)[:FIRST_RECORDS]
                                   if path else []):
            try:
                if data.format == "chat":
                    to_messages(record, i, shape, data.columns)
                else:
                    to_pair(record, i)
            except UserError as exc:
                raise UserError(f"{key}={path}: {exc}") from None
