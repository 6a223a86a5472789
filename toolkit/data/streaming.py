"""Blocks packed while training reads them (`data.streaming=true`).

Each data rank reads its part of the stream, tokenizes a batch of documents at a time and lays them into
blocks with the prepared path's `Layout`: nothing is prepared ahead. `save` and `load` resume exactly. Unlike
prepared data (docs/data.md), blocks come in stream order and a step's global batch depends on the number of
data ranks.
How it splits the stream, resumes and ends an epoch: docs/internals.md, toolkit/data/streaming.py.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import datasets
import numpy as np
from datasets.distributed import split_dataset_by_node

from toolkit.config.errors import UserError
from toolkit.data.corpus import not_text
from toolkit.data.mixture import Shares, step_order
from toolkit.data.packing import Layout, document_chunks, encoder

READ_DOCUMENTS = 256  # documents tokenized at a time: one Rust tokenizer call
STATE_VERSION = 1
COLUMNS = ("input_ids", "position_ids", "num_tokens")


def state_file(folder: Path, rank: int, name: str = "") -> Path:
    """A data rank's position in its stream, or (`name`) in one source's of a mixture."""
    return folder / (f"stream_{name}_{rank}.npz" if name else f"stream_{rank}.npz")


class StreamingBlocks:
    """This data rank's packed blocks, made from the stream as they are taken.

    `ranks` is (data ranks, this rank's index); `held_out` are texts that training skips (the
    documents held out for evaluation, and any copy of them); `column` the stream's text column; `name`
    the source's, in a mixture (MixedStreams)."""

    def __init__(
        self, stream: datasets.IterableDataset, tokenizer, seq_len: int, ranks: tuple[int, int] = (1, 0),
        held_out: Collection[str] = (), column: str = "text", source: str = "the stream", name: str = "",
    ):
        self.source_stream, self.ranks, self.seq_len = stream, ranks, seq_len
        self.encode, self.pad_id = encoder(tokenizer), tokenizer.pad_token_id
        self.held_out, self.column, self.source, self.name = frozenset(held_out), column, source, name
        self.epoch = 0
        self.position: dict | None = None  # the stream's state after the last document read; None = its start
        self.layout = Layout(seq_len)
        self.pending = _no_blocks(seq_len)
        self._documents = None  # the live iterator

    # ------------------------------------------------------------------ reading
    def take(self, n: int, step: int = 0) -> dict[str, np.ndarray]:
        """The next `n` blocks: input_ids and position_ids (n, seq_len), num_tokens (n,). One stream is read in
        its order whatever the step (MixedStreams' take needs it)."""
        while len(self.pending["num_tokens"]) < n:
            self._read()
        out = {k: v[:n] for k, v in self.pending.items()}
        self.pending = {k: v[n:] for k, v in self.pending.items()}
        return out

    def _read(self) -> None:
        """Tokenize and lay out the next documents; at the end of this rank's part, its last block and a new epoch."""
        if self._documents is None:
            self._documents = iter(self._stream())
        texts, ended = [], True
        for i, example in enumerate(self._documents):
            if self.column not in example:
                raise UserError(
                    f"data.text_column={self.column} is not in {self.source}; its columns are {sorted(example)}"
                )
            text = example[self.column]
            if text is not None and not isinstance(text, str):
                raise not_text(self.source, "a record", self.column, text)
            if text and text.strip() and text not in self.held_out:
                texts.append(text)
            if i + 1 == READ_DOCUMENTS:
                ended = False
                break
        if texts:
            ids = self.encode(texts)
            lengths = np.array([x.size for x in ids], dtype=np.int64)
            for flat, counts, continues in document_chunks(lengths, lambda a, b: np.concatenate(ids[a:b])):
                self._append(*self.layout.add(flat, counts, continues))
        if not ended:
            self.position = self._live.state_dict()
            return
        if self.layout.laid == 0:
            world, rank = self.ranks
            raise UserError(
                f"data rank {rank} of {world} found no text in its part of {self.source}; the stream has fewer "
                "non-empty documents (or files) than data ranks, or data.text_column is empty"
            )
        last = self.layout.last_block(self.pad_id)
        if last is not None:
            self._append(*last)
        self.epoch, self.position, self.layout, self._documents = self.epoch + 1, None, Layout(self.seq_len), None

    def _stream(self) -> datasets.IterableDataset:
        """This rank's part, at `position` (a fresh object: datasets keeps a loaded state for every later pass)."""
        world, rank = self.ranks
        live = split_dataset_by_node(self.source_stream, rank=rank, world_size=world)
        live.set_epoch(self.epoch)
        if self.position is not None:
            live.load_state_dict(self.position)
        self._live = live
        return live

    def _append(self, ids: np.ndarray, pos: np.ndarray, num_tokens: np.ndarray | None = None) -> None:
        n = ids.size // self.seq_len
        if not n:
            return
        if num_tokens is None:
            num_tokens = np.full(n, self.seq_len, dtype=np.int32)
        new = {"input_ids": ids.reshape(n, self.seq_len), "position_ids": pos.reshape(n, self.seq_len),
               "num_tokens": num_tokens}
        self.pending = {k: np.concatenate([self.pending[k], new[k]]) for k in COLUMNS}

    # ------------------------------------------------------------------ resume
    def save(self, folder: Path) -> None:
        """This rank's position, unfinished block and blocks not yet taken, into the checkpoint folder."""
        meta = {"version": STATE_VERSION, "ranks": list(self.ranks), "seq_len": self.seq_len, "epoch": self.epoch,
                "position": self.position, "laid": self.layout.laid}
        np.savez(state_file(folder, self.ranks[1], self.name), meta=np.array(json.dumps(meta)), carry_ids=self.layout.carry_ids,
                 carry_pos=self.layout.carry_pos, **self.pending)

    def load(self, folder: Path) -> None:
        world, rank = self.ranks
        file = state_file(folder, rank, self.name)
        if not file.is_file():
            raise UserError(
                f"checkpoint {folder} has no stream position for data rank {rank} ({file.name}): it was trained on "
                "prepared data or fewer data ranks; resume it with data.streaming=false, or with its number of ranks"
            )
        with np.load(file, allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            if meta["ranks"][0] != world or meta["seq_len"] != self.seq_len:
                raise UserError(
                    f"checkpoint {folder} streamed on {meta['ranks'][0]} data rank(s) with data.seq_len="
                    f"{meta['seq_len']}; a streamed run resumes only with both unchanged (this run: {world}, "
                    f"{self.seq_len}): each rank's blocks depend on them"
                )
            self.epoch, self.position = meta["epoch"], meta["position"]
            self.layout = Layout(self.seq_len, laid=meta["laid"], carry_ids=saved["carry_ids"],
                                 carry_pos=saved["carry_pos"])
            self.pending = {k: saved[k] for k in COLUMNS}
        self._documents = None


class MixedStreams:
    """StreamingBlocks' contract (take, save, load, epoch) over the streams of a mixture's sources. Each step's
    global batch holds each source's share (toolkit.data.mixture.Shares, the same on every rank), laid out as
    a sequence of sources shuffled by (seed, step), of which each data rank takes its part from its streams;
    each source's position is saved and resumed as one stream's is. The blocks and tokens each source gave
    this rank's last take: `source_blocks`, `source_tokens`."""

    def __init__(self, streams: list[StreamingBlocks], plan: list[tuple[int, list[float]]], seed: int):
        self.streams, self.plan, self.seed = streams, plan, seed
        self.world, self.rank = streams[0].ranks
        self._shares: Shares | None = None  # made at the first take, which says the rank's part of a batch
        self.source_blocks = self.source_tokens = [0] * len(streams)

    @property
    def epoch(self) -> int:
        """Passes over the source read furthest."""
        return max(s.epoch for s in self.streams)

    def take(self, n: int, step: int) -> dict[str, np.ndarray]:
        if self._shares is None:
            self._shares = Shares(self.plan, n * self.world)
        counts = self._shares.counts(step)
        order = np.repeat(np.arange(len(self.streams)), counts)[step_order(self.seed, step, int(counts.sum()))]
        mine = order[self.rank * n : (self.rank + 1) * n]
        wheres = [np.flatnonzero(mine == source) for source in range(len(self.streams))]
        parts = [stream.take(len(where)) for stream, where in zip(self.streams, wheres, strict=True)]
        self.source_blocks = [len(where) for where in wheres]
        self.source_tokens = [int(part["num_tokens"].sum()) for part in parts]
        out = {}
        for k in COLUMNS:  # each source's blocks where the step's order puts them
            out[k] = np.empty((n, *parts[0][k].shape[1:]), dtype=np.result_type(*(part[k] for part in parts)))
            for where, part in zip(wheres, parts, strict=True):
                out[k][where] = part[k]
        return out

    def save(self, folder: Path) -> None:
        for stream in self.streams:
            stream.save(folder)

    def load(self, folder: Path) -> None:
        for stream in self.streams:
            stream.load(folder)


def held_out_documents(stream: datasets.IterableDataset, n: int, column: str = "text") -> list[str]:
    """The stream's first `n` non-empty documents: evaluation's, skipped by training."""
    texts = []
    for example in stream:
        text = example.get(column)
        if isinstance(text, str) and text.strip():
            texts.append(text)
            if len(texts) == n:
                break
    return texts


def _no_blocks(seq_len: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.empty((0, seq_len), dtype=np.int32), "position_ids": np.empty((0, seq_len), dtype=np.int32),
            "num_tokens": np.empty(0, dtype=np.int32)}
