"""A training recipe's `--preview N`: what trains, shown before anything trains (no model, no run folder).

The recipe builds its training blocks with the very functions training uses and hands them here: N blocks are
printed after templating, the tokens that carry loss (the labels its collate function gives the loss) marked apart
from the context, each packed conversation or document's start named with its place in the block; then one table of
what the blocks were made of, per corpus (a column per source of data.sources).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
import numpy as np

from toolkit.data.packing import IGNORE_INDEX, Seen, encoder

LEGEND = {False: "[[...]]: tokens that carry loss (trained on); unmarked: context the model only reads; <#k @i>: packed "
                 "record k starts at token i of the block; <pad xN>: padding",
          True: "green: tokens that carry loss (trained on); grey: context the model only reads; <#k @i>: packed record "
                "k starts at token i of the block; <pad xN>: padding"}
OPEN, CLOSE = "[[", "]]"
GREEN, GREY, BOLD, RESET = "\x1b[32m", "\x1b[90m", "\x1b[1m", "\x1b[0m"
DOCUMENTS_COUNTED = 20_000  # a text corpus's documents tokenized for the table's tokens per record: seconds, not minutes


def loss_mask(labels: np.ndarray) -> np.ndarray:
    """Which tokens of a block carry loss: those with a label (the collate function's labels, unshifted)."""
    return np.asarray(labels) != IGNORE_INDEX


def record_starts(block: dict, continued: bool = False) -> list[tuple[int, str]]:
    """(token, name) where each packed record starts in `block` (a row of the collated columns): a chat block's
    conversations and a text block's documents where their positions restart, a preference block's chosen and
    rejected sequences by `sequence`; `continued`: the block's first token goes on with the block before's document."""
    n = int(block["num_tokens"])
    if "sequence" in block:
        sequence = np.asarray(block["sequence"])[:n]
        changes = [i for i in range(n) if i == 0 or sequence[i] != sequence[i - 1]]
        return [(i, f"#{sequence[i] // 2 + 1} {'rejected' if sequence[i] % 2 else 'chosen'}") for i in changes]
    positions = np.asarray(block["position_ids"])[:n]
    starts = [int(i) for i in np.flatnonzero(positions == 0) if not (i == 0 and continued)]
    return [(i, f"#{k + 1}") for k, i in enumerate(starts)]


def marked(tokenizer, ids: np.ndarray, loss: np.ndarray, starts: list[tuple[int, str]], num_tokens: int,
           colour: bool) -> str:
    """The block's tokens as text, each run of tokens with (or without) loss decoded whole (a character split over
    tokens stays whole), loss runs in [[...]] (green with `colour`), each record's start named `<#k @i>`."""
    named = dict(starts)
    cuts = sorted({0, num_tokens, *named, *(np.flatnonzero(np.diff(loss[:num_tokens].astype(np.int8))) + 1).tolist()})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if a in named:
            tag = f"<{named[a]} @{a}>"
            out.append(f"\n{BOLD}{tag}{RESET}" if colour else f"\n{tag}")
        text = tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if colour:
            out.append(f"{GREEN if loss[a] else GREY}{text}{RESET}")
        else:
            out.append(f"{OPEN}{text}{CLOSE}" if loss[a] else text)
    if num_tokens < len(ids):
        out.append(f"<pad x{len(ids) - num_tokens}>")
    return "".join(out).lstrip("\n")


def spans_of(text: str) -> list[str]:
    """The loss-carrying texts of a bracketed (colourless) block, in order: what a reader takes [[...]] to say."""
    return re.findall(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), text, flags=re.S)


def stop_tokens(labels: np.ndarray, tokenizer) -> Counter:
    """The token that ends each run of loss-carrying tokens (a trained turn's or answer's last one: its stop), by
    (id, text), over the blocks' labels (n, seq_len)."""
    carried = loss_mask(labels)
    ends = carried & ~np.concatenate([carried[:, 1:], np.zeros((len(carried), 1), bool)], axis=1)
    ids = np.asarray(labels)[ends]
    return Counter({(int(i), tokenizer.convert_ids_to_tokens(int(i))): int(n)
                    for i, n in zip(*np.unique(ids, return_counts=True), strict=True)})


@dataclass
class Column:
    """One corpus's figures in the table."""

    name: str
    seen: Seen
    lengths: np.ndarray  # tokens per training record, as rendered (before any cut)
    tokens: int  # real tokens in the training blocks
    loss_tokens: int
    blocks: int
    seq_len: int
    template: str
    stop: str
    counted_of: int | None = None  # lengths come from the first N records only
    notes: list[str] = field(default_factory=list)


def column_of(name: str, seen: Seen, train: datasets.Dataset, collate_fn: Callable, tokenizer, template: str,
              seq_len: int) -> Column:
    """The figures of a corpus's training blocks: their loss tokens as its collate function labels them."""
    labels, tokens = [], 0
    for start in range(0, len(train), 1024):
        rows = train[start:start + 1024]
        labels.append(collate_fn(rows, "flex_attention")["labels"].numpy())
        tokens += int(np.asarray(rows["num_tokens"]).sum())
    labels = np.concatenate(labels) if labels else np.zeros((0, seq_len), np.int64)
    counted_of = None
    if seen.stats is not None:  # chat and preference data: each record as rendered
        lengths = np.asarray(seen.stats.lengths, dtype=np.int64)
        ends = stop_tokens(labels, tokenizer)
        turns = sum(ends.values())
        stop = "; ".join(f"{text!r} (id {i}) ends {n:,} of {turns:,} trained turns" for (i, text), n in
                         ends.most_common(2)) or "none"
    else:  # text: each document as the encoder tokenizes it (with its EOS)
        documents = seen.documents
        encode = encoder(tokenizer)
        shown = documents.select(range(min(len(documents), DOCUMENTS_COUNTED)))
        lengths = np.array([len(ids) for start in range(0, len(shown), 256)
                            for ids in encode(shown[start:start + 256]["text"])], dtype=np.int64)
        counted_of = len(shown) if len(shown) < len(documents) else None
        stop = f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), the EOS after each document"
    return Column(name, seen, lengths, tokens, int(loss_mask(labels).sum()), len(train), seq_len, template, stop,
                  counted_of)


def table(columns: list[Column]) -> str:
    """One table: a row per figure, a column per corpus."""
    reasons = sorted({r for c in columns for r in (*c.seen.dropped, *getattr(c.seen.stats, "why", {}))})
    rows: list[tuple[str, list[str]]] = [("records read", [f"{c.seen.read:,}" for c in columns])]
    for reason in reasons:
        rows.append((f"dropped: {reason}", [f"{c.seen.dropped.get(reason, 0) + getattr(c.seen.stats, 'why', {}).get(reason, 0):,}"
                                            for c in columns]))
    if not reasons:
        rows.append(("dropped", ["none" for _ in columns]))
    rows.append(("held out for evaluation", [f"{c.seen.held_out:,}" for c in columns]))
    rows.append(("packed for training", [f"{c.seen.stats.kept:,}" if c.seen.stats is not None else
                                         f"{len(c.seen.documents):,}" for c in columns]))
    rows.append(("truncated to data.seq_len", [
        f"{c.seen.stats.truncated:,} ({c.seen.stats.cut:,} tokens cut)" if c.seen.stats is not None else
        "none (a document runs on into the next block)" for c in columns]))

    def spread(c: Column) -> str:
        if not c.lengths.size:
            return "-"
        median, p95 = np.percentile(c.lengths, [50, 95])
        of = f" (of the first {c.counted_of:,})" if c.counted_of else ""
        return f"median {median:,.0f}, p95 {p95:,.0f}, max {int(c.lengths.max()):,}{of}"

    rows.append(("tokens per record", [spread(c) for c in columns]))
    rows.append(("training blocks", [f"{c.blocks:,} of {c.seq_len} tokens ({c.tokens / max(1, c.blocks * c.seq_len):.0%}"
                                     " filled)" for c in columns]))
    rows.append(("tokens with loss", [f"{c.loss_tokens / max(1, c.tokens):.1%} ({c.loss_tokens:,} of {c.tokens:,})"
                                      for c in columns]))
    rows.append(("template", [c.template for c in columns]))
    rows.append(("stop token", [c.stop for c in columns]))
    header = ("", [c.name for c in columns])
    width = max(len(name) for name, _ in rows) + 2
    cells = [max(len(values[i]) for _, values in [header, *rows]) + 2 for i in range(len(columns))]
    lines = [f"{name:<{width}}" + "".join(f"{v:<{w}}" for v, w in zip(values, cells, strict=True))
             for name, values in [header, *rows]]
    lines.insert(1, "-" * (width + sum(cells)))
    return "\n".join(line.rstrip() for line in lines)


def examples(parts: list[tuple[str, datasets.Dataset, Callable]], n: int, tokenizer, colour: bool) -> list[str]:
    """N training blocks, taken in turn from each corpus (`parts`: its name, blocks, collate function), as text."""
    shown, taken = [], [0] * len(parts)
    while len(shown) < n and any(taken[i] < len(blocks) for i, (_, blocks, _) in enumerate(parts)):
        for i, (name, blocks, collate_fn) in enumerate(parts):
            if len(shown) == n or taken[i] >= len(blocks):
                continue
            b = taken[i]
            taken[i] += 1
            rows = blocks[b:b + 1]
            block = {k: np.asarray(v[0]) for k, v in rows.items()}
            labels = collate_fn(rows, "flex_attention")["labels"].numpy()[0]
            # a text block whose first token goes on with the document the block before left unfinished (no EOS)
            continued = "sequence" not in block and "labels" not in block and b > 0 and \
                int(blocks[b - 1]["input_ids"][-1]) != tokenizer.eos_token_id
            after = f"; its first tokens end the document of block {b}" if continued else ""
            title = (f"block {b + 1} of {len(blocks):,}{f' ({name})' if name else ''}, "
                     f"{int(block['num_tokens'])} of {len(block['input_ids'])} tokens{after}")
            text = marked(tokenizer, block["input_ids"], loss_mask(labels), record_starts(block, continued),
                          int(block["num_tokens"]), colour)
            shown.append(f"--- {title} ---\n{text}")
    return shown


def show(parts: list[tuple[str, datasets.Dataset, Callable]], columns: list[Column], n: int, tokenizer,
         colour: bool, say: Callable[[str], None] = print) -> None:
    """Print N blocks, the legend, and the table."""
    for text in examples(parts, n, tokenizer, colour):
        say(text)
        say("")
    say(LEGEND[colour])
    say("")
    say(table(columns))
