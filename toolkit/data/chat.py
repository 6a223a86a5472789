"""Chat SFT data: records -> messages -> (input_ids, labels) -> packed blocks.

Only the assistant's own output is a target (each assistant message's content and the token that ends its
turn; the whole turn where the template renders more of it, its tool calls); everything else gets label -100, found
by rendering with any chat template. Every other key of a record or turn goes to the template (`rendered`). Blocks use
`toolkit.data.packing`'s layout plus `labels`; a conversation is never split across blocks.
How the spans are found and the blocks filled: docs/internals.md, toolkit/data/chat.py.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import inspect
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import datasets
import jinja2
import numpy as np
import pyarrow as pa
import torch

from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.data.packing import IGNORE_INDEX, Seen, attention_inputs
from toolkit.data.records import (
    REFUSE,
    TOOL,
    UNRENDERED,
    ColumnsConfig,
    read_records,
    record_rest,
    shapes_said,
    to_messages,
    unrendered,
)
from toolkit.data.text_files import read_utf8

EMBEDDED = "embedded:python-chats"


@dataclass
class ChatDataConfig:
    path: str | None = field(
        None,
        help="file of chat records (.jsonl/.json/.parquet/.csv/.arrow), a folder or glob of them, a save_to_disk folder, "
        "or a hub dataset (an id, or a folder laid out as the hub lays one out); "
        "empty = the embedded Python Q&A set",
    )
    record_format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"] = field(
        "auto", help="the records' shape: messages, sharegpt, alpaca or prompt_completion (docs/data.md); auto = each "
        "record's own"
    )
    seq_len: int = field(512, help="tokens per packed block; a conversation never spans two blocks")
    overlong: Literal["truncate", "drop"] = field(
        "truncate", help="a conversation longer than seq_len: truncate (keep its start) or drop it"
    )
    chat_template: str | None = field(
        None, help="Jinja chat template (the text, or a .jinja file) used instead of the tokenizer's"
    )
    append_stop: bool = field(False, help="train the EOS token after each assistant answer the template ends without "
                                          "it (toolkit.data.template_check)")
    val_fraction: float = field(0.1, help="fraction of conversations held out for evaluation (0 = no eval)")
    val_path: str | None = field(None, help="held-out records of their own (as data.path takes them), in place of "
                                            "val_fraction")
    columns: ColumnsConfig = field(default_factory=ColumnsConfig, help="records of another shape: their columns")
    name: str | None = field(None, help="a hub dataset's config (subset)")
    split: str = field("train", help="the split to read from a hub dataset")

    def validate(self) -> list[str]:
        problems = []
        if self.seq_len < 16:
            problems.append(f"seq_len={self.seq_len} is too short; use at least 16 tokens")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if self.chat_template and looks_like_file(self.chat_template) and not _is_file(self.chat_template):
            shown = (self.chat_template if len(self.chat_template) <= 240 else  # the end names the file
                     f"{self.chat_template[:60]}...{self.chat_template[-60:]}")
            said = "is a folder" if _is_file(self.chat_template, Path.is_dir) else "does not exist"
            problems.append(f"chat_template={shown} {said}; give a .jinja file or the template text")
        elif self.chat_template and not looks_like_file(self.chat_template) and not _is_jinja(self.chat_template):
            problems.append(f"chat_template={self.chat_template[:40]!r} is neither a file nor a template (it has no "
                            "{{ }} or {% %}): every conversation would render as this text; give a Jinja template")
        return problems


def load_chat_records(cfg: ChatDataConfig) -> list[dict]:
    """Raw records from cfg.path (toolkit.data.records), or the embedded set when no path is given."""
    if not cfg.path:
        from toolkit.data.python_chats import PYTHON_CHATS

        return [dict(r) for r in PYTHON_CHATS]
    return read_records(cfg.path, "chat", "data.path", cfg.name, cfg.split)


def own_template(tokenizer) -> str | None:
    """The chat template a tokenizer carries (the default one where it has several named), or None."""
    own = getattr(tokenizer, "chat_template", None)
    return (own.get("default") if isinstance(own, dict) else own) or None


def chat_template_for(tokenizer, chat_template: str | None = None) -> str:
    """The template to render with: the override (text or file), else the tokenizer's."""
    if chat_template:
        if looks_like_file(chat_template):
            text = read_utf8(Path(chat_template), f"chat_template={chat_template}")
            if not text.strip():  # else the tokenizer's own template would render, with no word
                raise UserError(f"chat_template={chat_template} is empty; write the Jinja template in it, or leave "
                                "data.chat_template unset for the tokenizer's own")
            return text
        return chat_template
    own = own_template(tokenizer)
    if not own:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(
            f"tokenizer {name} has no chat template; set data.chat_template to a Jinja template (text or .jinja file)"
        )
    return own


def _render(tokenizer, messages: list[dict], template: str, variables: dict | None = None,
            generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template, **(variables or {})
        )
    except jinja2.TemplateError as exc:  # e.g. raise_exception("roles must alternate")
        raise UserError(f"the chat template rejected the conversation: {exc}") from None


def render_conversation(
    tokenizer, messages: list[dict], chat_template: str | None = None, last_only: bool = False,
    variables: dict | None = None, append_stop: bool = False,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels): labels are the ids on assistant output (content + turn end; the whole turn where the
    template renders more of it, its tool calls), -100 elsewhere; `last_only`: on the last assistant message's only
    (a preference pair's answer after its prompt). `variables`: the record's own keys, for the template.
    `append_stop` (data.append_stop): the EOS id inserted, as a target, after each output that does not end with it."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("chat SFT needs a fast tokenizer (character offsets); load one with use_fast=True")
    template = chat_template_for(tokenizer, chat_template)

    def render(msgs: list[dict], generation_prompt: bool = False) -> str:
        return _render(tokenizer, msgs, template, variables, generation_prompt)

    full = render(messages)
    spans = []  # [start, end) characters of each assistant output, and where its turn ends
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render(messages[: k + 1])
        before = render(messages[:k], generation_prompt=True)
        if not full.startswith(before):  # a template whose generation prompt is not how turns begin
            before = render(messages[:k])
        if not full.startswith(through) or not full.startswith(before):
            raise UserError(
                f"the chat template renders the turns before assistant message {k} differently once later turns "
                "follow (e.g. it rewrites history), so its tokens cannot be located; set data.chat_template"
            )
        if set(message) - {"role", "content"}:  # keys the template renders (rendered): the turn's output too
            rest = through[len(before):]
            start = len(before) + len(rest) - len(rest.lstrip())
            spans.append((start, len(through.rstrip()), len(through)))
            continue
        content = message["content"]
        start = through.find(content, len(before))
        if start < 0 and content.strip() != content:  # templates that trim the content
            content = content.strip()
            start = through.find(content, len(before))
        if start < 0:
            raise UserError(
                f"the chat template does not render assistant message {k} verbatim ({message['content'][:40]!r}), "
                "so its tokens cannot be located; set data.chat_template"
            )
        spans.append((start, start + len(content), len(through)))

    if last_only:
        spans = spans[-1:]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = special_ids(tokenizer)
    ids, labels, last = list(ids), [IGNORE_INDEX] * len(ids), []
    for start, end, turn_end in spans:
        # the turn ends at the first special token after the content, if the turn's text has one
        for (s, e), tid in zip(offsets, ids, strict=True):
            if s >= end and e <= turn_end and e > s and tid in special:
                end = e
                break
        inside = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
        for i in inside:
            labels[i] = ids[i]
        last.append(inside[-1] if inside else -1)
    if append_stop:  # a template ending a turn with the next role's marker: no trained token ever stops generation
        for i in reversed(last):
            if i >= 0 and ids[i] != tokenizer.eos_token_id:
                ids.insert(i + 1, tokenizer.eos_token_id)
                labels.insert(i + 1, tokenizer.eos_token_id)
    return ids, labels


def special_ids(tokenizer) -> set[int]:
    """The ids a turn may end with: the special tokens and every added token (ChatML's markers, say)."""
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))


@functools.cache
def _parameters(tokenizer_class: type) -> frozenset[str]:
    """apply_chat_template's own parameters: a record's key of such a name is no variable of the template."""
    return frozenset(inspect.signature(tokenizer_class.apply_chat_template).parameters) - {"tools", "documents",
                                                                                           "kwargs", "self"}


TOOL_TURNS = f"role: {TOOL}"  # records.UNRENDERED's name for a conversation's tool turns
# why a record is not trained on: the reasons a preview counts (PackStats.why)
EMPTY_ANSWER = "an empty answer (every assistant turn \"\")"
TOO_LONG = "longer than data.seq_len (data.overlong=drop)"
NO_ANSWER_TOKEN = "no assistant token to train on"
ANSWER_CUT_OFF = "every assistant token past data.seq_len (truncated away)"


def rendered(tokenizer, messages: list[dict], template: str, variables: dict, index: int
             ) -> tuple[list[dict], dict, list[str]]:
    """(the turns, the record's variables, the keys left out): every key beyond role and content, a turn's or the
    record's, that the template renders nothing of is left out, or refused (records.UNRENDERED); a tool's turns alike.
    A key is rendered where the conversation renders otherwise without it."""
    names = _parameters(type(tokenizer))
    if isinstance(variables.get("tools"), str):  # the datasets that keep the definitions as a JSON string
        with contextlib.suppress(ValueError):
            variables = {**variables, "tools": json.loads(variables["tools"])}
    unpassable = sorted(set(variables) & names)  # a record's `tokenize` is no template's variable
    variables = {k: v for k, v in variables.items() if k not in names}
    keys = sorted({k for m in messages for k in m if k not in ("role", "content")} | set(variables))
    keys += [TOOL_TURNS] if any(m["role"] == TOOL for m in messages) else []
    if not keys:
        return messages, variables, unpassable

    def without(drop: set[str]) -> tuple[list[dict], dict]:
        return ([{k: v for k, v in m.items() if k not in drop} for m in messages
                 if not (TOOL_TURNS in drop and m["role"] == TOOL)], {k: v for k, v in variables.items() if k not in drop})

    def renders(drop: set[str]) -> str | None:
        try:
            return _render(tokenizer, *without(drop)[:1], template, without(drop)[1])
        except (UserError, TypeError, ValueError):  # refused without it: it matters
            return None

    full = _render(tokenizer, messages, template, variables)
    unseen = keys if renders(set(keys)) == full else [k for k in keys if renders({k}) == full]
    for key in unseen:
        if unrendered(key) == REFUSE:
            said = "tool turns (role tool)" if key == TOOL_TURNS else f"`{key}`"
            raise UserError(f"record {index} has {said}, which the chat template renders nothing of "
                            f"({UNRENDERED[key][1]}); set data.chat_template to a template that renders them, or "
                            "leave them out of the records")
    messages, variables = without(set(unseen))
    return messages, variables, unpassable + unseen


def tokenize_conversations(records: Sequence[dict], tokenizer, chat_template: str | None = None,
                           shape: str = "auto", columns: ColumnsConfig | None = None,
                           notes: list[str] | None = None, append_stop: bool = False,
                           dropped: Counter | None = None) -> datasets.Dataset:
    """Records of `shape` (auto: each its own) -> dataset of `input_ids` and `labels` (one row per conversation).

    A conversation whose every answer is empty is left out (it would teach an empty answer), and so is each key the
    template renders nothing of (records.UNRENDERED): both counted in a line of `notes`; the records left out counted
    by reason in `dropped` (a preview's table)."""
    chat_template = chat_template_for(tokenizer, chat_template)  # fails once, not per record
    named = None if shape == "auto" else shape
    rows, empty, left_out = [], 0, Counter()
    for i, record in enumerate(records):
        messages = to_messages(record, i, named, columns)
        messages, variables, unseen = rendered(tokenizer, messages, chat_template, record_rest(record, named, columns), i)
        left_out.update(unseen)
        if all(not m["content"] and set(m) == {"role", "content"} for m in messages if m["role"] == "assistant"):
            empty += 1
            continue
        try:
            rows.append(render_conversation(tokenizer, messages, chat_template, variables=variables,
                                            append_stop=append_stop))
        except UserError as exc:
            raise UserError(f"record {i}: {exc}") from None
    if not rows and empty:
        raise UserError(f"every one of the {empty} conversations has only empty answers (assistant content \"\"), so "
                        "nothing to learn from; give the assistant messages content")
    if dropped is not None and empty:
        dropped[EMPTY_ANSWER] += empty
    if notes is not None and empty:
        notes.append(f"{empty} conversations with an empty answer (every assistant turn \"\") left out")
    if notes is not None and left_out:
        notes.append("left out, the chat template rendering nothing of them: " + ", ".join(
            f"`{key}` in {n} records" for key, n in sorted(left_out.items())))
    return datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})


@dataclass
class PackStats:
    conversations: int
    kept: int
    truncated: int
    dropped: int
    blocks: int
    tokens: int
    targets: int
    seq_len: int
    # what a preview's table shows (recipes' --preview): tokens of each conversation offered (before any cut), tokens
    # cut from the truncated ones, the dropped ones by reason
    lengths: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    cut: int = 0
    why: dict[str, int] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        fill = self.tokens / max(1, self.blocks * self.seq_len)
        return (
            f"packed {self.kept} of {self.conversations} conversations into {self.blocks} blocks of {self.seq_len} "
            f"tokens ({fill:.0%} filled, {self.targets} target tokens); {self.truncated} truncated to seq_len, "
            f"{self.dropped} dropped (longer than seq_len, or no target left)"
        )


def _nothing_to_train_on(whole_targets: np.ndarray, too_long: np.ndarray, seq_len: int, overlong: str,
                         split: str) -> str:
    """Why no conversation of `split` ("training", "held-out") kept a target token, by its real cause: no assistant
    tokens at all (empty assistant turns), or the assistant tokens lie past data.seq_len (and how overlong treats
    them)."""
    n = whole_targets.size
    if not whole_targets.any():
        return (f"none of the {n} {split} conversations has an assistant token to train on (their assistant turns "
                "are empty, or the chat template renders none); give the assistant messages content")
    if overlong == "truncate":
        return (f"no {split} conversation has an assistant token within its first data.seq_len={seq_len} tokens "
                f"({int(too_long.sum())} of {n} are longer, and truncating them cuts off every assistant turn); "
                "raise data.seq_len")
    return (f"no {split} conversation fits data.seq_len={seq_len} with a target left ({int(too_long.sum())} of {n} "
            "are longer); raise data.seq_len or set data.overlong=truncate")


def pack_conversations(
    rows, seq_len: int, pad_id: int, overlong: Literal["truncate", "drop"] = "truncate", split: str = "training"
) -> tuple[datasets.Dataset, PackStats]:
    """Conversations (a dataset with `input_ids`/`labels`, or (ids, labels) pairs) -> packed blocks."""
    flat_ids, flat_labels, offsets = _flatten(rows)
    lengths = np.diff(offsets)
    n = lengths.size
    if n == 0:
        raise UserError("there are no conversations to pack; check data.path")
    too_long = lengths > seq_len
    size = np.minimum(lengths, seq_len) if overlong == "truncate" else lengths
    # targets each conversation keeps (its first token is never one: nothing before it predicts it)
    cum = np.concatenate([[0], np.cumsum(flat_labels != IGNORE_INDEX)])
    first = np.minimum(offsets[:-1] + 1, offsets[:-1] + size)
    targets = cum[offsets[:-1] + size] - cum[first]
    keep = (targets > 0) & ((overlong == "truncate") | ~too_long)
    if not keep.any():
        raise UserError(_nothing_to_train_on(cum[offsets[1:]] - cum[np.minimum(offsets[:-1] + 1, offsets[1:])],
                                             too_long, seq_len, overlong, split))
    src_start, size = offsets[:-1][keep], size[keep]

    block, start, n_blocks = best_fit_decreasing(size, seq_len)

    total = int(size.sum())
    conv = np.repeat(np.arange(size.size), size)
    within = np.arange(total) - np.repeat(np.cumsum(size) - size, size)
    src = src_start[conv] + within
    dst = block[conv] * seq_len + start[conv] + within
    used = np.bincount(block, weights=size, minlength=n_blocks).astype(np.int64)

    index = np.arange(n_blocks * seq_len)
    input_ids = np.full(index.size, pad_id, dtype=np.int32)
    labels = np.full(index.size, IGNORE_INDEX, dtype=np.int32)
    position_ids = (index % seq_len - used[index // seq_len]).astype(np.int32)  # the padding tail: 0, 1, ...
    input_ids[dst] = flat_ids[src]
    labels[dst] = flat_labels[src]
    labels[dst[within == 0]] = IGNORE_INDEX
    position_ids[dst] = within

    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(input_ids), seq_len),
            "position_ids": pa.FixedSizeListArray.from_arrays(pa.array(position_ids), seq_len),
            "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels), seq_len),
            "num_tokens": pa.array(used.astype(np.int32)),
        }
    )
    whole = cum[offsets[1:]] - cum[np.minimum(offsets[:-1] + 1, offsets[1:])]
    too_long_dropped = too_long & (overlong == "drop")
    why = Counter({TOO_LONG: int((~keep & too_long_dropped).sum()),
                   NO_ANSWER_TOKEN: int((~keep & ~too_long_dropped & (whole == 0)).sum()),
                   ANSWER_CUT_OFF: int((~keep & ~too_long_dropped & (whole > 0)).sum())})
    stats = PackStats(
        conversations=n,
        kept=int(keep.sum()),
        truncated=int((too_long & keep).sum()),
        dropped=int((~keep).sum()),
        blocks=n_blocks,
        tokens=total,
        targets=int(targets[keep].sum()),
        seq_len=seq_len,
        lengths=lengths.astype(np.int64),
        cut=int((lengths - seq_len)[too_long & keep].sum()),
        why={reason: count for reason, count in why.items() if count},
    )
    return datasets.Dataset(table), stats


def best_fit_decreasing(size: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(block, start within it) of each conversation, and the number of blocks.

    Longest first, each into the open block it fills most tightly (best-fit decreasing), so a
    block's tail is padding only where no remaining conversation fits. Filling blocks in data
    order instead left a quarter of every block as padding on chat data averaging ~200 tokens
    in 512-token blocks (bench/chat_packing.py: 75% filled; 98% with this). Conversations are
    re-ordered, which costs nothing: the training order is shuffled by block anyway.
    """
    block = np.empty(size.size, dtype=np.int64)
    start = np.empty(size.size, dtype=np.int64)
    room: list[int] = []  # sorted distinct capacities left in open blocks
    blocks_with: dict[int, list[int]] = {}  # capacity -> open blocks with exactly that much room
    n_blocks = 0
    for i in np.argsort(-size, kind="stable").tolist():
        length = int(size[i])
        j = bisect.bisect_left(room, length)
        if j < len(room):  # the tightest open block it fits in
            capacity = room[j]
            b = blocks_with[capacity].pop()
            if not blocks_with[capacity]:
                room.pop(j)
        else:
            b, capacity = n_blocks, seq_len
            n_blocks += 1
        block[i], start[i] = b, seq_len - capacity
        left = capacity - length
        if left > 0:
            if not blocks_with.get(left):
                blocks_with[left] = []
                bisect.insort(room, left)
            blocks_with[left].append(b)
    return block, start, n_blocks


def collate_chat(columns: dict, attn_implementation: str) -> dict[str, torch.Tensor]:
    """Columns of packed chat blocks (`blocks[indices]`) -> model inputs with the SFT labels."""
    position_ids = torch.as_tensor(np.asarray(columns["position_ids"]), dtype=torch.long)
    batch = {
        "input_ids": torch.as_tensor(np.asarray(columns["input_ids"]), dtype=torch.long),
        "position_ids": position_ids,
        "labels": torch.as_tensor(np.asarray(columns["labels"]), dtype=torch.long),
    }
    return attention_inputs(batch, attn_implementation)


def chat_target_counts(blocks: datasets.Dataset) -> np.ndarray:
    """Number of loss targets per block (what the loss is normalised by)."""
    labels = blocks.select_columns(["labels"]).with_format("numpy")[:]["labels"]
    return (labels[:, 1:] != IGNORE_INDEX).sum(axis=1).astype(np.int64)


def _flatten(rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(rows, datasets.Dataset):
        if len(rows) == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int64)
        table = rows.with_format("arrow")[:]  # honours select/shuffle, like packing.pack_documents
        ids_col, labels_col = (table.column(c).combine_chunks() for c in ("input_ids", "labels"))
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
        labels = labels_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
        if not np.array_equal(labels_col.offsets.to_numpy(), offsets):
            raise UserError("each conversation needs as many labels as input_ids")
        return ids, labels, offsets
    pairs = list(rows)
    if any(len(ids) != len(lab) for ids, lab in pairs):
        raise UserError("each conversation needs as many labels as input_ids")
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in pairs], dtype=np.int64)]).astype(np.int64)
    ids = np.fromiter((t for x, _ in pairs for t in x), dtype=np.int32, count=int(offsets[-1]))
    labels = np.fromiter((t for _, y in pairs for t in y), dtype=np.int32, count=int(offsets[-1]))
    return ids, labels, offsets


def _is_file(value: str, kind=Path.is_file) -> bool:
    try:
        return kind(Path(value))
    except OSError:  # a name longer than the file system takes: no such file
        return False


def _is_jinja(value: str) -> bool:
    return "{%" in value or "{{" in value


def looks_like_file(value: str) -> bool:
    return "\n" not in value and not _is_jinja(value)


def chat_blocks(
    cfg: ChatDataConfig, tokenizer, seed: int, seen: Seen | None = None
) -> tuple[datasets.Dataset, datasets.Dataset | None, list[str]]:
    """(train blocks, held-out blocks or None, lines for the log): whole conversations held out. `seen` (when
    given) is told what they were made of."""
    from toolkit.data.corpus import split_documents

    records = load_chat_records(cfg)
    said: list[str] = []
    seen = seen if seen is not None else Seen()
    rows = tokenize_conversations(records, tokenizer, cfg.chat_template, cfg.record_format, cfg.columns, said,
                                  cfg.append_stop, seen.dropped)
    if cfg.val_path:  # the user's own held-out set, whole
        train_rows = rows
        held_out: list[str] = []
        val_rows = tokenize_conversations(read_records(cfg.val_path, "chat", "data.val_path"), tokenizer,
                                          cfg.chat_template, cfg.record_format, cfg.columns, held_out, cfg.append_stop)
        said += [f"held-out (data.val_path): {line}" for line in held_out]
    else:
        train_rows, val_rows = split_documents(rows, cfg.val_fraction, seed)
    train, stats = pack_conversations(train_rows, cfg.seq_len, tokenizer.pad_token_id, cfg.overlong)
    seen.read, seen.stats = len(records), stats
    seen.held_out = len(val_rows) if val_rows is not None and not cfg.val_path else 0
    notes = [shapes_said(records, cfg.record_format, cfg.columns), *said, f"train: {stats}"]
    val = None
    if val_rows is not None:
        val, val_stats = pack_conversations(val_rows, cfg.seq_len, tokenizer.pad_token_id, cfg.overlong, "held-out")
        notes.append(f"held-out{f' (data.val_path={cfg.val_path})' if cfg.val_path else ''}: {val_stats}")
    if stats.truncated or stats.dropped:
        # under truncate, a conversation cut before its first answer has nothing left to train: dropped, said apart
        cut = [f"{stats.truncated} truncated"] if stats.truncated else []
        cut += [f"{stats.dropped} dropped" + (" (no assistant token left within it)" if cfg.overlong == "truncate"
                                               else "")] if stats.dropped else []
        notes.append(
            f"{stats.truncated + stats.dropped} training conversations are longer than data.seq_len={cfg.seq_len} "
            f"and were {' and '.join(cut)} (data.overlong={cfg.overlong}); raise data.seq_len to keep them whole"
        )
    return train, val, notes
