"""Tokenize documents and pack them into fixed-length blocks that keep documents apart.

Each document becomes `tokens + [EOS]`, laid end to end and cut every `seq_len` tokens; nothing is dropped (the
last block is padded, a segment no token attends to). `position_ids` restart at 0 where a document starts, and
`attention_inputs` tells that to each attention implementation the way it reads it (sdpa and eager: a
block-causal mask; flex_attention: the position ids; flash: the micro-batch flattened into one row).
How each attention kind keeps documents apart, and what was measured: docs/internals.md, toolkit/data/packing.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from toolkit.config.errors import UserError
from toolkit.run.lock import one_writer
from toolkit.run.writes import writing

IGNORE_INDEX = -100
PACKING_VERSION = "3"  # 3: documents over PIECE_CHARS tokenized in pieces; 2: one memory-mapped arrow file of blocks
MANIFEST = "blocks.json"  # the block files, in order; written last, so its presence means complete
# Tokens packed at a time. Packing holds about 50 B per token of a chunk (ids, positions and
# their int64 indices), so ~50 MB whatever the corpus size.
CHUNK_TOKENS = 1 << 20
# Characters the tokenizer is handed in one call: a longer document is cut into pieces of at most
# this many, at a whitespace (document_pieces), and its pieces' ids are joined again. The Rust
# tokenizer holds ~100-200 bytes per character of a call (a 50 MB one-line document took ~9 GB
# and then aborted), so this bounds it to a few hundred MB whatever the document.
PIECE_CHARS = 1_000_000
# Documents each tokenizing process takes in one go (a few hundred MB of text for web documents);
# the processes are started afresh for the next window, so their memory follows the window.
TOKENIZE_DOCUMENTS = 50_000
EMPTY_CORPUS = "the corpus tokenized to 0 tokens; check data.path and data.text_column"
# Attention implementations that can keep packed documents apart, and how they are told.
MASKED_ATTENTION = {"sdpa", "eager"}  # a 4-D mask (packed_mask)
POSITION_ATTENTION = {"flex_attention"}  # position ids, one row per block
VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3"}  # position ids, the blocks in one row


@dataclass
class Seen:
    """What a corpus's training blocks were made of, for a preview's table (recipes' --preview): the records read,
    those left out by reason before packing, those held out, and the packing's stats (chat's PackStats, preference's
    PairStats) or, for text, the training documents (whose tokens the preview counts)."""

    read: int = 0
    dropped: Counter = field(default_factory=Counter)
    held_out: int = 0
    stats: Any = None
    documents: datasets.Dataset | None = None

    def text_split(self, corpus, train_docs: datasets.Dataset, held_out: int) -> None:
        """A text corpus's: its documents read (kept, and those `dropped` counts), the training ones, those held out."""
        self.read = len(corpus) + sum(self.dropped.values())
        self.held_out, self.documents = held_out, train_docs


def check_attention(attn_implementation: str) -> None:
    # auto: made one of them at the launch (toolkit.config.switches)
    if attn_implementation not in MASKED_ATTENTION | POSITION_ATTENTION | VARLEN_ATTENTION | {"auto"}:
        raise UserError(
            f"model.attn_implementation={attn_implementation} cannot keep packed documents apart; use sdpa, eager, "
            "flex_attention, flash_attention_2 on GPU, or auto"
        )


def tokenize_documents(
    docs: datasets.Dataset, tokenizer, num_proc: int = 1, cache_file: str | None = None
) -> datasets.Dataset:
    """`text` -> `input_ids` (each document followed by EOS, int32), batched and multi-process.

    With `cache_file` the ids are written there (one file per process) rather than kept in memory."""
    encode_texts = encoder(tokenizer)

    def encode(batch):
        return {"input_ids": encode_texts(batch["text"])}

    num_proc = num_proc if len(docs) >= 2 * num_proc and num_proc > 1 else None
    return docs.map(
        encode,
        batched=True,
        batch_size=256,
        num_proc=num_proc,
        remove_columns=docs.column_names,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),  # half of int64 on disk
        cache_file_name=cache_file,
        desc="tokenizing",
    )


def encoder(tokenizer, piece_chars: int | None = None) -> Callable[[list[str]], list[np.ndarray]]:
    """texts -> their token ids (int32), each followed by EOS (what separates documents in a block).

    The tokenizer gets at most `piece_chars` characters a call: a longer text is cut into pieces
    (`document_pieces`) whose ids are joined, with no EOS between them (one document). A token
    across a cut can differ from tokenizing the text whole; a cut before a whitespace leaves
    byte-level BPE's words, and so its tokens, as they were."""
    eos = tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    piece_chars = piece_chars or PIECE_CHARS

    def call(texts: list[str]) -> list[list[int]]:
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The Rust tokenizer directly: the transformers wrapper also builds attention masks
            # and a BatchEncoding per batch that packing throws away (measured: 25% of the time).
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode(texts: list[str]) -> list[np.ndarray]:
        pieces = [(doc, piece) for doc, text in enumerate(texts) for piece in document_pieces(text, piece_chars)]
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        start = 0
        while start < len(pieces):  # consecutive pieces of at most piece_chars characters in all (one at least)
            end, chars = start + 1, len(pieces[start][1])
            while end < len(pieces) and chars + len(pieces[end][1]) <= piece_chars:
                chars += len(pieces[end][1])
                end += 1
            for (doc, _), ids in zip(pieces[start:end], call([p for _, p in pieces[start:end]]), strict=True):
                parts[doc].append(np.asarray(ids, dtype=np.int32))
            start = end
        return [np.concatenate([*p, np.array([eos], dtype=np.int32)]) for p in parts]

    return encode


def document_pieces(text: str, piece_chars: int | None = None) -> list[str]:
    """`text` cut into pieces of at most `piece_chars` characters that join back to it: each cut just
    before the last whitespace that follows a word in the second half of the budget (so the next piece
    starts with the space, as byte-level BPE's words do), or at the budget where there is none."""
    piece_chars = piece_chars or PIECE_CHARS
    if len(text) <= piece_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        end = start + piece_chars
        cut = max(text.rfind(c, start + piece_chars // 2, end) for c in " \n\t")
        while cut > start + piece_chars // 2 and text[cut - 1].isspace():  # before a run of whitespace, not in it
            cut -= 1
        cut = cut if cut > start + piece_chars // 2 else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def pack_documents(
    tokenized: datasets.Dataset, seq_len: int, pad_id: int, path: Path | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> datasets.Dataset:
    """Lay token lists end to end and cut into blocks of `seq_len`, a chunk of documents at a time.

    With `path` the blocks are streamed into that arrow file and come back memory-mapped, so
    memory follows `chunk_tokens` (and the longest document), never the corpus; without it they
    are returned in memory."""
    if path is None:
        batches = list(packed_batches(tokenized, seq_len, pad_id, chunk_tokens))
        return datasets.Dataset(pa.Table.from_batches(batches, schema=block_schema(seq_len)))
    pack_shard(tokenized, seq_len, pad_id, path, Ranks(), chunk_tokens)  # the whole corpus: one rank's share
    return datasets.Dataset.from_file(str(path))  # memory-mapped: a rank reads the blocks it asks for


def block_schema(seq_len: int) -> pa.Schema:
    tokens = pa.list_(pa.int32(), seq_len)
    return pa.schema([("input_ids", tokens), ("position_ids", tokens), ("num_tokens", pa.int32())])


def packed_batches(
    tokenized: datasets.Dataset, seq_len: int, pad_id: int, chunk_tokens: int = CHUNK_TOKENS,
    start: int = 0, following: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The packed blocks of `tokenized`, as arrow record batches of whole blocks, chunk by chunk
    (`Layout`): the cut is the one of laying the whole corpus out at once.

    For one shard of a corpus, `start` is the stream index of its first token and `following`
    the (ids, positions) of at least seq_len tokens after it (fewer where the corpus ends): the
    shard gives the blocks that start inside it, and its tokens before its first block border
    belong to the shard before."""
    schema = block_schema(seq_len)
    layout = Layout(seq_len, laid=start, skip=-start % seq_len)
    for flat, lengths, continues in _document_chunks(tokenized, chunk_tokens):
        ids, pos = layout.add(flat, lengths, continues)
        if ids.size:
            yield _block_batch(ids, pos, np.full(ids.size // seq_len, seq_len, dtype=np.int32), schema)
    if following is None and layout.laid == 0:
        raise UserError(EMPTY_CORPUS)
    if layout.carry_ids.size and following is not None:  # the block runs on into the next shards
        need = seq_len - layout.carry_ids.size
        layout.carry_ids = np.concatenate([layout.carry_ids, following[0][:need]])
        layout.carry_pos = np.concatenate([layout.carry_pos, following[1][:need]])
    last = layout.last_block(pad_id)
    if last is not None:
        yield _block_batch(*last, schema)


@dataclass
class Layout:
    """Documents laid end to end and cut into blocks of `seq_len`, a batch of whole documents at a time.

    A token at stream index g has position g - max(start of its document, start of its block), so
    a block's unfinished tail is carried to the next batch with its positions already final: the
    cut is the one of laying the whole stream out at once. `skip` tokens at the stream's start
    finish a block that an earlier shard began."""

    seq_len: int
    laid: int = 0  # stream index of the next token
    skip: int = 0
    doc_start: int = 0  # stream index where the last document laid began (a long one comes in slices)
    carry_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    carry_pos: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))

    def add(self, flat: np.ndarray, lengths: np.ndarray, continues: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, positions) of the whole blocks these documents complete, flat; the tail is carried.
        `continues`: the first of them is the rest of the last document laid (its positions go on)."""
        starts = _document_starts(lengths, self.laid, self.doc_start if continues else None)
        position = _positions(lengths, self.laid, self.seq_len, starts)
        self.laid += flat.size
        if len(starts):
            self.doc_start = int(starts[-1])
        if self.skip:
            k = min(self.skip, flat.size)
            flat, position, self.skip = flat[k:], position[k:], self.skip - k
        ids, pos = np.concatenate([self.carry_ids, flat]), np.concatenate([self.carry_pos, position])
        whole = ids.size - ids.size % self.seq_len
        self.carry_ids, self.carry_pos = ids[whole:], pos[whole:]
        return ids[:whole], pos[:whole]

    def last_block(self, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The stream's last, padded block (ids, positions, [real tokens]), or None when it ended on a border.
        The padding is a segment of its own (positions from 0)."""
        if not self.carry_ids.size:
            return None
        pad = self.seq_len - self.carry_ids.size
        ids = np.concatenate([self.carry_ids, np.full(pad, pad_id, dtype=np.int32)])
        pos = np.concatenate([self.carry_pos, np.arange(pad, dtype=np.int32)])
        return ids, pos, np.array([self.carry_ids.size], dtype=np.int32)


def _document_starts(lengths: np.ndarray, laid: int, open_start: int | None = None) -> np.ndarray:
    """Stream index where each of these documents (laid from `laid` on) began: the first began at
    `open_start` when it is the rest of a document begun earlier."""
    starts = laid + np.cumsum(lengths, dtype=np.int64) - lengths
    if open_start is not None and len(starts):
        starts[0] = open_start
    return starts


def _positions(lengths: np.ndarray, laid: int, seq_len: int, starts: np.ndarray | None = None) -> np.ndarray:
    """Position ids of documents of `lengths` tokens laid from stream index `laid` on (`starts`: where
    each began, when the first is the rest of an earlier one)."""
    index = laid + np.arange(int(lengths.sum()), dtype=np.int64)
    doc_start = np.repeat(_document_starts(lengths, laid) if starts is None else starts, lengths)
    return (index - np.maximum(doc_start, index - index % seq_len)).astype(np.int32)


def _block_batch(ids: np.ndarray, pos: np.ndarray, num_tokens: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    seq_len = schema.field("input_ids").type.list_size
    columns = [
        pa.FixedSizeListArray.from_arrays(pa.array(ids), seq_len),
        pa.FixedSizeListArray.from_arrays(pa.array(pos), seq_len),
        pa.array(num_tokens),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _document_chunks(
    tokenized: datasets.Dataset, chunk_tokens: int, window_rows: int = 4096
) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
    """`document_chunks` of the tokenized corpus, a window of rows at a time."""
    for column in column_windows(tokenized, "input_ids", window_rows):
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)

        def flat(first: int, last: int, column=column) -> np.ndarray:
            part = pc.list_flatten(column.slice(first, last - first))
            return part.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)

        yield from document_chunks(lengths, flat, chunk_tokens)


def document_chunks(
    lengths: np.ndarray, flat: Callable[[int, int], np.ndarray], chunk_tokens: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
    """(flat int32 tokens, per-document lengths, whether the first is the rest of the last document) of
    at most `chunk_tokens` tokens at a time: whole documents, or one longer than a chunk in slices of
    chunk_tokens, so that packing holds one chunk whatever the document. `flat(first, last)` gives the
    tokens of documents first..last-1 laid end to end."""
    chunk_tokens = chunk_tokens or CHUNK_TOKENS
    ends = np.cumsum(lengths)
    first = 0
    while first < len(lengths):
        # the documents that end within chunk_tokens of this chunk's start, and at least one
        base = ends[first - 1] if first else 0
        last = max(first + 1, int(np.searchsorted(ends, base + chunk_tokens, side="right")))
        tokens = flat(first, last)
        if tokens.size <= chunk_tokens:
            yield tokens, lengths[first:last], False
        else:  # one document: its slices (views)
            for a in range(0, tokens.size, chunk_tokens):
                piece = tokens[a : a + chunk_tokens]
                yield piece, np.array([piece.size], dtype=np.int64), a > 0
        first = last


def column_windows(dataset: datasets.Dataset, name: str, window_rows: int = 4096) -> Iterator[pa.Array | pa.ChunkedArray]:
    """One column of `dataset`, some rows at a time, in order.

    A dataset that is exactly its arrow files (what `load_dataset` or `map` wrote) is read from
    the files with plain reads, a record batch at a time: reading it through the memory map would
    leave every page read in this process's RSS until the kernel wants it back (4 bytes a token,
    the whole text of a corpus). Anything else (a selection, a slice, a table in memory) is read
    through the arrow format, which honours an indices mapping. `name` is the column's name in
    the files (before any rename)."""
    files = [f["filename"] for f in dataset.cache_files]
    if files and dataset._indices is None and sum(_rows_in(f) for f in files) == len(dataset):
        for f in files:
            with pa.OSFile(f) as source:
                for batch in pa.ipc.open_stream(source):
                    yield batch.column(name)
        return
    rows = dataset.with_format("arrow")
    for start in range(0, len(dataset), window_rows):
        yield rows[start : start + window_rows].column(name)


def _rows_in(arrow_file: str) -> int:
    with pa.memory_map(arrow_file) as source:  # only the batches' headers are touched
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


@dataclass(frozen=True)
class Ranks:
    """The processes that prepare a corpus together; each tokenizes and packs 1/world of its documents.

    `gather(value)` returns every rank's value in rank order (and so is also a barrier)."""

    rank: int = 0
    world: int = 1
    gather: Callable[[Any], list] = field(default=lambda value: [value])
    local_world: int = 1  # ranks on this node, which share its tokenizing processes

    @classmethod
    def of_process_group(cls) -> Ranks:
        """Every rank of the launched job (all nodes), or this process alone when there is no process group."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()

        def gather(value):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out

        # The ranks on this node share its cores; counted by host name rather than read from the
        # launcher's environment, so that any launcher (torchrun, mpirun, slurm) gets it right.
        hosts = gather(socket.gethostname())
        return cls(dist.get_rank(), dist.get_world_size(), gather, hosts.count(hosts[dist.get_rank()]))


def packed_dataset(
    docs: datasets.Dataset, tokenizer, seq_len: int, cache_root: Path, source_fingerprint: str, num_proc: int = 1,
    ranks: Ranks | None = None,
) -> datasets.Dataset:
    """Tokenize + pack, cached on disk under a fingerprint of (source, tokenizer, seq_len).

    Every rank prepares its contiguous 1/world of the documents into its own block file; the
    files together hold exactly the blocks of one process packing the whole corpus (`pack_shard`),
    so the cache does not depend on how many ranks made it. The ids go to a scratch file and the
    blocks straight to the cache, so neither is ever whole in memory. `cache_root` must be one
    folder that every rank sees (a shared filesystem across nodes). `num_proc` tokenizing processes
    are shared by the ranks of a node."""
    ranks = ranks or Ranks.of_process_group()
    key = _fingerprint(source_fingerprint, tokenizer, seq_len, len(docs))
    # rank 0 of each run waits for another run packing the same blocks (a shared data.cache_dir), then reads them
    with one_writer(cache_root / f".packed-{key}.lock", take=ranks.rank == 0):
        return _packed(docs, tokenizer, seq_len, cache_root, key, num_proc, ranks)


def _packed(docs: datasets.Dataset, tokenizer, seq_len: int, cache_root: Path, key: str, num_proc: int,
            ranks: Ranks) -> datasets.Dataset:
    target = cache_root / f"packed-{key}"
    if ranks.gather((target / MANIFEST).is_file())[0]:
        return _load_blocks(target)
    tmp = cache_root / f".packed-{key}.tmp"
    if ranks.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    ranks.gather(None)  # cleared before anyone writes into it
    # a write that fails (a full disk, in this process or a tokenizing one) is one line, and the scratch and
    # block files go with the .tmp folder (toolkit.run.writes.WRITERS['data cache'])
    with writing("data cache", tmp):
        tmp.mkdir(parents=True, exist_ok=True)
        # the contiguous share datasets' shard(contiguous=True) takes, which may be empty: fewer documents than ranks
        div, extra = divmod(len(docs), ranks.world)
        first = ranks.rank * div + min(ranks.rank, extra)
        size = div + (ranks.rank < extra)
        shard = (docs.select(range(first, first + size)) if size else docs.select([])) if ranks.world > 1 else docs
        ids_file = tmp / f"ids-{ranks.rank:05d}.arrow"
        # num_proc is the node's: its ranks tokenize at once, so each takes its part of the processes
        per_rank = max(1, num_proc // ranks.local_world)
        # A window of documents at a time, each with fresh tokenizing processes: a process's RSS then
        # holds the text pages of one window (datasets reads the text through its memory map), not the
        # pages of its whole part, which grow with the corpus.
        window = TOKENIZE_DOCUMENTS * per_rank
        parts = [tokenize_documents(shard.select(range(a, min(a + window, len(shard)))) if len(shard) else shard,
                                    tokenizer, per_rank,
                                    cache_file=str(tmp / f"{ids_file.stem}-w{i:05d}.arrow"))
                 for i, a in enumerate(range(0, max(1, len(shard)), window))]
        tokenized = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        name = f"blocks-{ranks.rank:05d}-of-{ranks.world:05d}.arrow"
        n_blocks = pack_shard(tokenized, seq_len, tokenizer.pad_token_id, tmp / name, ranks)
        del tokenized
        for scratch in tmp.glob(f"{ids_file.stem}*.arrow"):  # one file per window and tokenizing process
            scratch.unlink()
        files = ranks.gather((name, n_blocks))
        if not all(ranks.gather(all((tmp / f).is_file() for f, _ in files))):
            raise UserError(
                f"data.cache_dir={cache_root} is not one folder for all {ranks.world} ranks (a rank cannot see the "
                "blocks another wrote); on several nodes put data.cache_dir on a filesystem every node mounts"
            )
        if ranks.rank == 0:
            (tmp / MANIFEST).write_text(json.dumps({"files": [f for f, n in files if n], "blocks": sum(n for _, n in files)}))
            for empty in (f for f, n in files if not n):  # a shard inside one block of the shard before it
                (tmp / empty).unlink()
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    ranks.gather(None)
    return _load_blocks(target)


def pack_shard(
    tokenized: datasets.Dataset, seq_len: int, pad_id: int, path: Path, ranks: Ranks, chunk_tokens: int = CHUNK_TOKENS
) -> int:
    """Pack this rank's contiguous share of the corpus into `path`; returns its number of blocks.

    The ranks swap two small things: their token counts (so each knows where its share starts in
    the stream) and their first seq_len tokens with positions (so the block that crosses into the
    next shares can be finished)."""
    counts = ranks.gather(_token_count(tokenized))
    if sum(counts) == 0:
        raise UserError(EMPTY_CORPUS)
    start = sum(counts[: ranks.rank])
    heads = ranks.gather(_head(tokenized, seq_len, start))
    later = heads[ranks.rank + 1 :]
    following = tuple(np.concatenate([h[i] for h in later] or [np.empty(0, np.int32)])[:seq_len] for i in (0, 1))
    n_blocks = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, block_schema(seq_len)) as writer:
        for batch in packed_batches(tokenized, seq_len, pad_id, chunk_tokens, start, following):
            writer.write_batch(batch)
            n_blocks += batch.num_rows
    return n_blocks


def _token_count(tokenized: datasets.Dataset, window_rows: int = 65536) -> int:
    rows = tokenized.with_format("arrow")
    return sum(
        int(pc.sum(pc.list_value_length(rows[i : i + window_rows].column("input_ids"))).as_py() or 0)
        for i in range(0, len(tokenized), window_rows)
    )


def _head(tokenized: datasets.Dataset, seq_len: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, positions) of the first seq_len tokens of a share that starts at stream index `start`."""
    ids, pos, layout = [], [], Layout(seq_len, laid=start)
    for flat, lengths, continues in _document_chunks(tokenized, seq_len):
        ids.append(flat)
        starts = _document_starts(lengths, layout.laid, layout.doc_start if continues else None)
        pos.append(_positions(lengths, layout.laid, seq_len, starts))
        layout.laid, layout.doc_start = layout.laid + flat.size, int(starts[-1])
        if layout.laid - start >= seq_len:
            break
    if not ids:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    return np.concatenate(ids)[:seq_len], np.concatenate(pos)[:seq_len]


def _load_blocks(folder: Path) -> datasets.Dataset:
    """The cached blocks, memory-mapped: a rank reads the blocks it asks for, never a whole column."""
    manifest = json.loads((folder / MANIFEST).read_text())
    parts = [datasets.Dataset.from_file(str(folder / f)) for f in manifest["files"]]
    blocks = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if len(blocks) != manifest["blocks"]:
        raise UserError(f"the packed cache {folder} holds {len(blocks)} blocks, not {manifest['blocks']}; delete it to prepare again")
    return blocks


def packed_splits(train_docs: datasets.Dataset, val_docs: datasets.Dataset | None, tokenizer, cfg, source: str, seed: int):
    """(train blocks, held-out blocks or None) of a split corpus, packed once into the cache.

    `cfg` is the recipe's data section (seq_len, val_fraction, num_proc, cache_dir); the cache
    key names the corpus, the split seed and the held-out fraction."""
    cache = cfg.resolved_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    split_key = f"{source}-seed{seed}-val{cfg.val_fraction}"
    train = packed_dataset(train_docs, tokenizer, cfg.seq_len, cache, f"{split_key}-train", cfg.num_proc)
    val = None
    if val_docs is not None:
        val = packed_dataset(val_docs, tokenizer, cfg.seq_len, cache, f"{split_key}-val", cfg.num_proc)
    return train, val


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids -> which document of its row each token is in (positions restart at 0 per document)."""
    return torch.cumsum(position_ids == 0, dim=1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids -> (B, 1, L, L) boolean mask: causal, and only within a document."""
    segment = document_ids(position_ids)
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def packed_mask(position_ids: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """The 4-D mask that keeps packed documents apart under `attn_implementation` (MASKED_ATTENTION): sdpa's
    boolean one, or eager's additive one in bf16 (added to fp32 or bf16 scores alike)."""
    allowed = block_causal_mask(position_ids)
    if attn_implementation != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.bfloat16, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(torch.bfloat16).min)


def labels_for(input_ids: torch.Tensor, position_ids: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels (unshifted, as transformers expects) with cross-document targets masked.

    A token that starts a document cannot be predicted from the previous document, and padding
    is never a target.
    """
    labels = input_ids.long().clone()
    labels[position_ids == 0] = IGNORE_INDEX
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    labels[positions[None, :] >= num_tokens[:, None]] = IGNORE_INDEX
    return labels


def target_counts(blocks: datasets.Dataset, chunk_rows: int = 4096) -> np.ndarray:
    """Number of loss targets per block (what the loss is normalised by), read a chunk of blocks at a time."""
    rows = blocks.select_columns(["position_ids", "num_tokens"]).with_format("numpy")
    counts = [block_targets(rows[start : start + chunk_rows]) for start in range(0, len(rows), chunk_rows)]
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)


def block_targets(columns: dict) -> np.ndarray:
    """Loss targets of each block of `columns` (position_ids and num_tokens of some blocks)."""
    pos, n = np.asarray(columns["position_ids"]), np.asarray(columns["num_tokens"])
    valid = (pos != 0) & (np.arange(pos.shape[1])[None, :] < n[:, None])
    valid[:, 0] = False  # the first label of a block has no prediction (shifted away)
    return valid.sum(axis=1).astype(np.int64)


def column(blocks: datasets.Dataset, name: str) -> np.ndarray:
    """One column of a packed dataset as a numpy array ((n, seq_len) for token columns).

    Whole in memory: for a corpus, use it for `num_tokens` (4 bytes a block), not the token columns."""
    return blocks.select_columns([name]).with_format("numpy")[:][name]


def collate(columns: dict, attn_implementation: str) -> dict[str, torch.Tensor]:
    """Columns of packed blocks (`blocks[indices]`) -> model inputs for the attention kind."""
    input_ids = torch.as_tensor(np.asarray(columns["input_ids"]), dtype=torch.long)
    position_ids = torch.as_tensor(np.asarray(columns["position_ids"]), dtype=torch.long)
    num_tokens = torch.as_tensor(np.asarray(columns["num_tokens"]), dtype=torch.long)
    batch = {"input_ids": input_ids, "position_ids": position_ids,
             "labels": labels_for(input_ids, position_ids, num_tokens)}
    return attention_inputs(batch, attn_implementation)


def attention_inputs(batch: dict[str, torch.Tensor], attn_implementation: str) -> dict[str, torch.Tensor]:
    """A collated batch (input_ids, position_ids, labels; B x L) as the attention kind needs it."""
    if attn_implementation in MASKED_ATTENTION:
        batch["attention_mask"] = packed_mask(batch["position_ids"], attn_implementation)
    elif attn_implementation in VARLEN_ATTENTION:
        # A row's first label is never a target (the shift drops it); ignoring it keeps the last
        # token of one row from predicting the first of the next once the rows are one.
        batch["labels"][:, 0] = IGNORE_INDEX
        batch = {k: v.reshape(1, -1) for k, v in batch.items()}
    return batch


def _fingerprint(source: str, tokenizer, seq_len: int, n_docs: int) -> str:
    vocab = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    h = hashlib.sha256()
    for part in (PACKING_VERSION, source, vocab, str(tokenizer.eos_token_id), str(seq_len), str(n_docs)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
