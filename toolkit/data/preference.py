"""Preference pairs: records -> (prompt, chosen, rejected) -> two token sequences -> packed blocks.

Each answer is rendered after its prompt with the chat template, and only its tokens are targets. Blocks hold
whole pairs, the chosen then the rejected sequence, each a document of its own; `sequence` numbers them (2k:
pair k's chosen, 2k + 1: its rejected; -1: padding) and `pairs` counts a block's pairs, the loss's unit.
The records it takes, and how blocks are filled: docs/internals.md, toolkit/data/preference.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import datasets
import numpy as np
import pyarrow as pa
import torch

from toolkit.config.errors import UserError
from toolkit.data.chat import (
    TOO_LONG,
    ChatDataConfig,
    best_fit_decreasing,
    chat_template_for,
    render_conversation,
)
from toolkit.data.packing import IGNORE_INDEX, Seen, attention_inputs
from toolkit.data.records import pair_shapes_said, read_records, to_pair

# The embedded set's non-answers, for a third of its pairs (the others reject another question's answer).
NON_ANSWERS = (
    "I am not sure; search the Python documentation for that.",
    "That cannot be done in Python.",
    "Just write a loop.",
)


def embedded_records() -> list[dict]:
    """A preference pair for each question of the embedded chat set: its answer is chosen, and rejected is
    another question's answer or a non-answer (written for this toolkit, as the chat set is)."""
    from toolkit.data.python_chats import PYTHON_CHATS
    from toolkit.data.records import to_messages

    chats = [to_messages(r, i) for i, r in enumerate(PYTHON_CHATS)]
    records = []
    for i, messages in enumerate(chats):
        other = chats[(i + len(chats) // 3) % len(chats)]
        rejected = NON_ANSWERS[i // 3 % len(NON_ANSWERS)] if i % 3 == 2 else other[-1]["content"]
        records.append({"prompt": messages[:-1], "chosen": messages[-1]["content"], "rejected": rejected})
    return records


def render_answer(tokenizer, prompt: list[dict[str, str]], answer: str, template: str,
                  append_stop: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of prompt + answer, the labels on the answer only (and EOS after it, `append_stop`), cut
    after its last target."""
    ids, labels = render_conversation(tokenizer, [*prompt, {"role": "assistant", "content": answer}], template,
                                      last_only=True, append_stop=append_stop)
    targets = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    if not targets:
        raise UserError(f"the chat template renders no token of the answer {answer[:40]!r}; set data.chat_template")
    return ids[:targets[-1] + 1], labels[:targets[-1] + 1]


@dataclass
class PairStats:
    offered: int
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    blocks: int = 0
    tokens: int = 0
    seq_len: int = 0
    # what a preview's table shows (recipes' --preview): tokens of each pair offered (both sequences, before any cut),
    # tokens cut from the truncated ones, the dropped ones by reason
    lengths: list[int] = dataclasses.field(default_factory=list)
    cut: int = 0
    why: Counter = dataclasses.field(default_factory=Counter)

    def __str__(self) -> str:
        fill = self.tokens / max(1, self.blocks * self.seq_len)
        return (f"packed {self.kept} of {self.offered} pairs into {self.blocks} blocks of {self.seq_len} tokens "
                f"({fill:.0%} filled); {self.truncated} truncated to seq_len, {self.dropped} dropped (longer than "
                "seq_len, or an answer with no token left within it)")


IDENTICAL, EMPTY = "chosen equal to rejected", "an empty answer"
NO_ANSWER_LEFT = "an answer with no token left within data.seq_len"


def tokenize_pairs(records: list, tokenizer, chat_template: str | None, append_stop: bool = False,
                   dropped: Counter | None = None) -> tuple[list[tuple], str]:
    """Records -> [(chosen ids, chosen labels, rejected ids, rejected labels)] and a line for the log, leaving out
    (and counting, in `dropped` too when given) pairs whose answers are equal or empty: they teach nothing."""
    template = chat_template_for(tokenizer, chat_template)
    rows, identical, empty = [], 0, 0
    for i, record in enumerate(records):
        prompt, chosen, rejected = to_pair(record, i)
        if not chosen.strip() or not rejected.strip():
            empty += 1
            continue
        if chosen == rejected:
            identical += 1
            continue
        try:
            rows.append((*render_answer(tokenizer, prompt, chosen, template, append_stop),
                         *render_answer(tokenizer, prompt, rejected, template, append_stop)))
        except UserError as exc:
            raise UserError(f"record {i}: {exc}") from None
    if dropped is not None:
        dropped.update({k: n for k, n in ((IDENTICAL, identical), (EMPTY, empty)) if n})
    return rows, (f"{len(records)} preference records: {identical} with chosen equal to rejected and {empty} with "
                  "an empty answer left out")


def _fit(lc: int, lr: int, seq_len: int) -> tuple[int, int]:
    """Lengths of a pair's two sequences cut to fit one block together: each keeps its start and at least half
    the block, unless the other needs less."""
    if lc + lr <= seq_len:
        return lc, lr
    c = min(lc, max(seq_len // 2, seq_len - lr))
    return c, min(lr, seq_len - c)


def pack_pairs(rows: list[tuple], seq_len: int, pad_id: int,
               overlong: Literal["truncate", "drop"] = "truncate") -> tuple[datasets.Dataset, PairStats]:
    """Tokenized pairs -> blocks of whole pairs (columns input_ids, position_ids, labels, sequence, num_tokens,
    pairs)."""
    stats = PairStats(offered=len(rows))
    kept = []  # (chosen ids, chosen labels, rejected ids, rejected labels) as they go into a block
    for ids_c, lab_c, ids_r, lab_r in rows:
        c, r = _fit(len(ids_c), len(ids_r), seq_len)
        cut = (c, r) != (len(ids_c), len(ids_r))
        stats.lengths.append(len(ids_c) + len(ids_r))
        # a sequence's first token is never a target (nothing before it in the block predicts it)
        if (cut and overlong == "drop") or not any(x != IGNORE_INDEX for x in lab_c[1:c]) or not any(
                x != IGNORE_INDEX for x in lab_r[1:r]):
            stats.dropped += 1
            stats.why[TOO_LONG if cut and overlong == "drop" else NO_ANSWER_LEFT] += 1
            continue
        stats.truncated += cut
        stats.cut += len(ids_c) + len(ids_r) - c - r
        kept.append((ids_c[:c], lab_c[:c], ids_r[:r], lab_r[:r]))
    if not kept:
        raise UserError(f"none of {stats.offered} preference pairs fits data.seq_len={seq_len} with an answer token "
                        f"of each side left (data.overlong={overlong}); raise data.seq_len")
    size = np.array([len(p[0]) + len(p[2]) for p in kept], dtype=np.int64)
    block, start, n_blocks = best_fit_decreasing(size, seq_len)
    input_ids = np.full((n_blocks, seq_len), pad_id, dtype=np.int32)
    labels = np.full((n_blocks, seq_len), IGNORE_INDEX, dtype=np.int32)
    sequence = np.full((n_blocks, seq_len), -1, dtype=np.int32)
    used = np.bincount(block, weights=size, minlength=n_blocks).astype(np.int64)
    position_ids = (np.arange(seq_len)[None, :] - used[:, None]).astype(np.int32)  # the padding tail: 0, 1, ...
    pairs = np.zeros(n_blocks, dtype=np.int32)
    for i in np.lexsort((start, block)).tolist():  # each block's pairs in the order they sit in it
        b, at = int(block[i]), int(start[i])
        for side, (ids, labs) in enumerate((kept[i][:2], kept[i][2:])):
            n = len(ids)
            input_ids[b, at:at + n] = ids
            labels[b, at + 1:at + n] = labs[1:]
            position_ids[b, at:at + n] = np.arange(n)
            sequence[b, at:at + n] = 2 * pairs[b] + side
            at += n
        pairs[b] += 1

    def rows_of(a: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), seq_len)

    stats.kept, stats.blocks, stats.tokens, stats.seq_len = len(kept), n_blocks, int(size.sum()), seq_len
    return datasets.Dataset(pa.table({
        "input_ids": rows_of(input_ids), "position_ids": rows_of(position_ids), "labels": rows_of(labels),
        "sequence": rows_of(sequence), "num_tokens": pa.array(used.astype(np.int32)), "pairs": pa.array(pairs),
    })), stats


def with_reference(blocks: datasets.Dataset, logps: np.ndarray) -> datasets.Dataset:
    """The blocks with a `ref_logps` column: the reference model's log-probability of each position's target."""
    table = blocks.with_format("arrow")[:]  # honours a selection of the blocks
    table = table.drop_columns([c for c in ("ref_logps",) if c in table.column_names])
    seq_len = logps.shape[1]
    column = pa.FixedSizeListArray.from_arrays(pa.array(logps.astype(np.float32).reshape(-1)), seq_len)
    return datasets.Dataset(table.append_column("ref_logps", column))


def collate_pairs(columns: dict, attn_implementation: str) -> dict[str, torch.Tensor]:
    """Columns of packed pair blocks -> model inputs with labels, `sequence` numbered across the micro-batch
    (row r's sequence s is 2 L r + s, so pair ids stay apart when varlen attention joins the rows) and
    `ref_logps` where the blocks have them."""
    def tensor(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(columns[name]), dtype=dtype)

    sequence = tensor("sequence", torch.long)
    rows, length = sequence.shape
    sequence = torch.where(sequence >= 0, sequence + 2 * length * torch.arange(rows)[:, None], -1)
    batch = {"input_ids": tensor("input_ids", torch.long), "position_ids": tensor("position_ids", torch.long),
             "labels": tensor("labels", torch.long), "sequence": sequence}
    if "ref_logps" in columns:
        batch["ref_logps"] = tensor("ref_logps", torch.float32)
    return attention_inputs(batch, attn_implementation)


def pair_counts(blocks: datasets.Dataset) -> np.ndarray:
    """Pairs per block: what the preference loss is averaged over."""
    return np.asarray(blocks.select_columns(["pairs"]).with_format("numpy")[:]["pairs"], dtype=np.int64)


def preference_blocks(cfg: ChatDataConfig, tokenizer, seed: int, seen: Seen | None = None
                      ) -> tuple[datasets.Dataset, datasets.Dataset | None, list[str]]:
    """(train blocks, held-out blocks or None, lines for the log): whole pairs held out. `seen` (when given) is told
    what they were made of."""
    from toolkit.data.corpus import split_documents

    records = read_records(cfg.path, "preference", "data.path", cfg.name, cfg.split) if cfg.path else embedded_records()
    seen = seen if seen is not None else Seen()
    rows, read = tokenize_pairs(records, tokenizer, cfg.chat_template, cfg.append_stop, seen.dropped)
    if not rows:
        raise UserError(f"{read}: none has two different, non-empty answers; check data.path")
    if cfg.val_path:  # the user's own held-out pairs, whole
        train_rows, (val_rows, _) = rows, tokenize_pairs(read_records(cfg.val_path, "preference", "data.val_path"),
                                                         tokenizer, cfg.chat_template, cfg.append_stop)
    else:
        train, held = split_documents(datasets.Dataset.from_dict({"row": list(range(len(rows)))}), cfg.val_fraction,
                                      seed)
        train_rows = [rows[i] for i in train["row"]]
        val_rows = [rows[i] for i in held["row"]] if held is not None else []
    train, stats = pack_pairs(train_rows, cfg.seq_len, tokenizer.pad_token_id, cfg.overlong)
    seen.read, seen.stats, seen.held_out = len(records), stats, 0 if cfg.val_path else len(val_rows)
    notes = [f"{read}; TRL's {pair_shapes_said(records)}", f"train: {stats}"]
    val = None
    if val_rows:
        val, val_stats = pack_pairs(val_rows, cfg.seq_len, tokenizer.pad_token_id, cfg.overlong)
        notes.append(f"held-out{f' (data.val_path={cfg.val_path})' if cfg.val_path else ''}: {val_stats}")
    if stats.truncated or stats.dropped:
        notes.append(f"{stats.truncated + stats.dropped} training pairs are longer than data.seq_len={cfg.seq_len} "
                     f"and were {'truncated' if cfg.overlong == 'truncate' else 'dropped'} (data.overlong="
                     f"{cfg.overlong}); raise data.seq_len to keep them whole")
    return train, val, notes
