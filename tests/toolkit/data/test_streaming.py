"""Streaming: blocks packed as training takes them, equal to the prepared path's, and resumed exactly."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from toolkit.config.errors import UserError
from toolkit.data import streaming
from toolkit.data.packing import pack_documents, tokenize_documents
from toolkit.data.streaming import StreamingBlocks, held_out_documents

SEQ_LEN = 32


@pytest.fixture(scope="module")
def texts(tiny_texts) -> list[str]:
    """150 documents from 1 character to several blocks long, with empty ones between."""
    out = []
    for i, text in enumerate(tiny_texts[:150]):
        out.append(text[: (37 * i) % 700 + 1])
        if i % 17 == 0:
            out.append("   ")  # skipped, as the prepared path's non-empty filter does
    return out


@pytest.fixture
def small_reads(monkeypatch):
    """7 documents a read: positions in the stream fall inside files, blocks and documents."""
    monkeypatch.setattr(streaming, "READ_DOCUMENTS", 7)


def jsonl_stream(folder, texts: list[str], files: int) -> datasets.IterableDataset:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[f::files]))
    names = sorted(str(p) for p in folder.glob("*.jsonl"))
    return datasets.load_dataset("json", data_files=names, split="train", streaming=True)


def prepared(texts: list[str], tokenizer) -> dict[str, np.ndarray]:
    docs = datasets.Dataset.from_dict({"text": [t for t in texts if t.strip()]})
    blocks = pack_documents(tokenize_documents(docs, tokenizer), SEQ_LEN, tokenizer.pad_token_id)
    return {k: np.asarray(v) for k, v in blocks.with_format("numpy")[:].items()}


def take_all(blocks: StreamingBlocks, sizes: list[int]) -> list[dict[str, np.ndarray]]:
    return [blocks.take(n) for n in sizes]


def joined(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in streaming.COLUMNS}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for k in streaming.COLUMNS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_one_rank_streams_the_blocks_of_the_prepared_path(texts, tiny_tokenizer, small_reads):
    """The same token stream cut the same way: ids, positions and token counts, the padded last block too."""
    reference = prepared(texts, tiny_tokenizer)
    n = len(reference["num_tokens"])
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()
    blocks = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN)
    got = joined(take_all(blocks, [1, 5, 2, n - 8]))
    assert_same(got, reference)
    assert reference["num_tokens"][-1] < SEQ_LEN  # the corpus does not end on a border: a padded block
    assert blocks.epoch == 1
    # the next epoch reads the stream again from its start
    assert_same(blocks.take(3), {k: v[:3] for k, v in reference.items()})


@pytest.mark.parametrize("files", [2, 3], ids=["a-file-per-rank", "every-other-document"])
def test_each_rank_streams_the_blocks_of_its_documents(texts, tiny_tokenizer, tmp_path, small_reads, files):
    """2 data ranks: whole files each where they divide, else alternate documents; nothing lost or repeated."""
    stream = jsonl_stream(tmp_path / "corpus", texts, files)
    seen = []
    for rank in range(2):
        mine = [e["text"] for e in datasets.distributed.split_dataset_by_node(stream, rank=rank, world_size=2)]
        seen += mine
        reference = prepared(mine, tiny_tokenizer)
        blocks = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, ranks=(2, rank))
        assert_same(blocks.take(len(reference["num_tokens"])), reference)
    assert sorted(seen) == sorted(texts)


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_at_any_step_takes_the_batches_of_the_uninterrupted_run(texts, tiny_tokenizer, tmp_path,
                                                                          small_reads, world):
    """Stopped after every step in turn (mid-read, mid-document, across the epoch's end), saved to a
    checkpoint folder and loaded into a fresh reader: the remaining steps' blocks are the same."""
    stream = jsonl_stream(tmp_path / "corpus", texts, 3)
    per_step = 3
    for rank in range(world):
        mine = [e["text"] for e in datasets.distributed.split_dataset_by_node(stream, rank=rank, world_size=world)]
        steps = (len(prepared(mine, tiny_tokenizer)["num_tokens"]) + 4) // per_step  # into a 2nd epoch
        whole = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, ranks=(world, rank))
        uninterrupted = take_all(whole, [per_step] * steps)
        assert whole.epoch == 1
        first = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, ranks=(world, rank))  # saved after every step, as
        for stop in range(1, steps):  # a run does: a save changes nothing of what it reads next
            assert_same(joined(take_all(first, [per_step])), joined(uninterrupted[stop - 1:stop]))
            folder = tmp_path / f"ckpt-{rank}-{stop}"
            folder.mkdir()
            first.save(folder)
            resumed = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, ranks=(world, rank))
            resumed.load(folder)
            assert_same(joined(take_all(resumed, [per_step] * (steps - stop))), joined(uninterrupted[stop:]))


def test_held_out_documents_are_never_trained_on(texts, tiny_tokenizer):
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()
    held = held_out_documents(stream, 20)
    assert held == [t for t in texts if t.strip()][:20]
    blocks = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, held_out=held)
    reference = prepared([t for t in texts if t not in held], tiny_tokenizer)
    assert_same(blocks.take(len(reference["num_tokens"])), reference)


def test_a_resume_with_other_data_ranks_or_seq_len_is_refused(texts, tiny_tokenizer, tmp_path):
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()
    StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN).save(tmp_path)
    with pytest.raises(UserError, match="streamed on 1 data rank.*resumes only with both unchanged"):
        StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN * 2).load(tmp_path)
    with pytest.raises(UserError, match="no stream position for data rank 1"):
        StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, ranks=(2, 1)).load(tmp_path)


@pytest.mark.parametrize(("records", "error"), [
    ([{"body": "some text"}], "data.text_column=text is not in corpus.jsonl; its columns are \\['body'\\]"),
    ([{"text": 12}], "has text=12 \\(int\\), not text"),
    ([{"text": ""}, {"text": "  "}], "found no text in its part"),
])
def test_bad_streams_are_refused_in_one_line(tiny_tokenizer, tmp_path, records, error):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stream = datasets.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
    blocks = StreamingBlocks(stream, tiny_tokenizer, SEQ_LEN, source="corpus.jsonl")
    with pytest.raises(UserError, match=error):
        blocks.take(1)


def test_a_long_document_streams_a_chunk_at_a_time(tiny_texts, tiny_tokenizer, monkeypatch):
    """One document of more tokens than a chunk (and characters than a piece) is laid out in slices of
    at most CHUNK_TOKENS that continue it: the blocks equal the prepared path's."""
    from toolkit.data import packing

    line = " ".join(t.replace("\n", " ") for t in tiny_texts)[:60_000]
    texts = ["Hi.", line, "x = 1"]
    monkeypatch.setattr(packing, "PIECE_CHARS", 7_000)
    monkeypatch.setattr(packing, "CHUNK_TOKENS", 1_000)
    reference = prepared(texts, tiny_tokenizer)
    sizes = []
    add = packing.Layout.add
    monkeypatch.setattr(packing.Layout, "add", lambda self, flat, *a: sizes.append(flat.size) or add(self, flat, *a))
    blocks = StreamingBlocks(datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(), tiny_tokenizer, SEQ_LEN)
    assert_same(blocks.take(len(reference["num_tokens"])), reference)
    assert max(sizes) == 1_000


@pytest.mark.parametrize("world", [1, 2])
def test_a_mixture_of_streams_takes_each_source_by_weight_and_resumes_at_any_step(texts, tiny_tokenizer, tmp_path,
                                                                                  small_reads, world):
    """Two sources' streams (the second short: it wraps into new passes) at 0.7/0.3 of a global batch of 8 blocks,
    then 0.25/0.75 from step 6: each step's blocks by source, over the ranks, within one block of the weights
    (the ranks' parts add up to the global shares, which do not divide), and a resume after any step (each
    source's position saved by name) takes the uninterrupted run's blocks."""
    from toolkit.data.mixture import SourceConfig, StageConfig, weight_plan
    from toolkit.data.streaming import MixedStreams

    long, short = jsonl_stream(tmp_path / "long", texts, 2), jsonl_stream(tmp_path / "short", texts[:8], 2)
    plan = weight_plan([SourceConfig("long", weight=0.7), SourceConfig("short", weight=0.3)],
                       [StageConfig(7, {"long": 0.1})])

    def mixed(rank: int) -> MixedStreams:
        return MixedStreams([StreamingBlocks(s, tiny_tokenizer, SEQ_LEN, (world, rank), name=n)
                             for s, n in ((long, "long"), (short, "short"))], plan, seed=5)

    steps, n = 10, 8 // world
    by_step = np.zeros((steps, 2), dtype=int)
    for rank in range(world):
        whole = mixed(rank)
        uninterrupted = []
        for step in range(steps):
            uninterrupted.append(whole.take(n, step))
            by_step[step] += whole.source_blocks
            assert sum(whole.source_tokens) == int(uninterrupted[-1]["num_tokens"].sum())
        assert whole.streams[1].epoch >= 1  # the short source was read again
        for stop in range(1, steps):
            first = mixed(rank)
            for step in range(stop):
                first.take(n, step)
            folder = tmp_path / f"mix-{rank}-{stop}"
            folder.mkdir()
            first.save(folder)
            assert sorted(p.name for p in folder.iterdir()) == [f"stream_long_{rank}.npz", f"stream_short_{rank}.npz"]
            resumed = mixed(rank)
            resumed.load(folder)
            assert_same(joined([resumed.take(n, step) for step in range(stop, steps)]), joined(uninterrupted[stop:]))
    for step, counts in enumerate(by_step):  # step 7 is batch 6
        share = np.array([0.7, 0.3] if step < 6 else [0.25, 0.75]) * 8
        assert counts.sum() == 8 and np.all(np.abs(counts - share) < 1), (step, counts)
