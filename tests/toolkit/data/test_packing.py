"""Packing: every token kept once, documents isolated in attention and in the loss, cached on disk."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading

import datasets
import numpy as np
import probe_ranks
import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.data import packing
from toolkit.data.packing import (
    IGNORE_INDEX,
    block_causal_mask,
    check_attention,
    collate,
    column,
    labels_for,
    pack_documents,
    packed_dataset,
    target_counts,
    tokenize_documents,
)

SEQ_LEN = 64


@pytest.fixture(scope="module")
def docs(tiny_texts) -> datasets.Dataset:
    """Documents of very different lengths: several longer than SEQ_LEN, some of 1-3 tokens."""
    texts = [
        tiny_texts[0][:900],  # several blocks long
        "a",
        "Hi.",
        tiny_texts[3][:120],
        tiny_texts[5][:40],
        "x = 1",
        tiny_texts[7][:400],
        tiny_texts[9][:10],
        "!",
        tiny_texts[11][:250],
    ]
    return datasets.Dataset.from_dict({"text": texts})


def reference_ids(docs, tokenizer) -> list[list[int]]:
    """Each document's ids followed by EOS, straight from the tokenizer (not through the toolkit)."""
    return [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in docs["text"]
    ]


def reference_layout(doc_ids: list[list[int]], seq_len: int):
    """Position ids and document-start flags of the real tokens, by walking the stream token by token."""
    positions, starts = [], []
    for ids in doc_ids:
        for j in range(len(ids)):
            g = len(positions)
            at_block_start = g % seq_len == 0
            positions.append(0 if (j == 0 or at_block_start) else positions[-1] + 1)
            starts.append(j == 0)
    return np.array(positions), np.array(starts)


@pytest.fixture(scope="module")
def packed(docs, tiny_tokenizer):
    tokenized = tokenize_documents(docs, tiny_tokenizer)
    return pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id)


def test_documents_are_long_and_short(docs, tiny_tokenizer):
    lengths = [len(x) for x in reference_ids(docs, tiny_tokenizer)]
    assert max(lengths) > 3 * SEQ_LEN and sum(n > SEQ_LEN for n in lengths) >= 2
    assert min(lengths) <= 3


def test_no_token_lost_or_duplicated(docs, tiny_tokenizer, packed):
    expected = np.concatenate([np.array(x) for x in reference_ids(docs, tiny_tokenizer)])
    ids = column(packed, "input_ids")
    num_tokens = column(packed, "num_tokens")

    assert ids.shape == (len(packed), SEQ_LEN)  # every block is exactly seq_len long
    assert len(packed) == -(-len(expected) // SEQ_LEN)
    got = np.concatenate([row[:n] for row, n in zip(ids, num_tokens, strict=True)])
    np.testing.assert_array_equal(got, expected)


def test_padding_only_in_last_block(docs, tiny_tokenizer, packed):
    total = sum(len(x) for x in reference_ids(docs, tiny_tokenizer))
    assert total % SEQ_LEN, "the test documents should leave a padded tail"
    ids, pos, num_tokens = (
        column(packed, "input_ids"),
        column(packed, "position_ids"),
        column(packed, "num_tokens"),
    )
    assert (num_tokens[:-1] == SEQ_LEN).all()
    n_last = total % SEQ_LEN
    assert num_tokens[-1] == n_last
    assert (ids[-1, n_last:] == tiny_tokenizer.pad_token_id).all()
    # the padding is a segment of its own: it restarts at 0 so block_causal_mask keeps it apart
    np.testing.assert_array_equal(pos[-1, n_last:], np.arange(SEQ_LEN - n_last))


def test_position_ids_restart_at_documents_and_blocks(docs, tiny_tokenizer, packed):
    doc_ids = reference_ids(docs, tiny_tokenizer)
    expected, _ = reference_layout(doc_ids, SEQ_LEN)
    pos = column(packed, "position_ids").reshape(-1)[: len(expected)]
    np.testing.assert_array_equal(pos, expected)
    assert (column(packed, "position_ids")[:, 0] == 0).all()


def test_pack_respects_selection_and_chunks(tiny_tokenizer, docs):
    """pack_documents sees the dataset it is given: shuffled/selected rows and multi-chunk tables."""
    tokenized = tokenize_documents(docs, tiny_tokenizer)
    order = [6, 0, 9, 2]
    parts = [
        tokenized.select(order),
        datasets.concatenate_datasets([tokenized.select(range(3)), tokenized.select(range(5, 8))]),
    ]
    for part in parts:
        blocks = pack_documents(part, SEQ_LEN, tiny_tokenizer.pad_token_id)
        expected = np.concatenate([np.array(x) for x in part["input_ids"]])
        ids, n = column(blocks, "input_ids"), column(blocks, "num_tokens")
        np.testing.assert_array_equal(np.concatenate([r[:k] for r, k in zip(ids, n, strict=True)]), expected)


# ------------------------------------------------------------------------- chunked packing
def stream_reference(doc_ids: list[list[int]], seq_len: int, pad_id: int):
    """(ids, position ids, num_tokens) of laying the whole stream out at once and cutting it, token by token."""
    positions, _ = reference_layout(doc_ids, seq_len)
    flat = np.concatenate([np.asarray(x) for x in doc_ids])
    pad = -len(flat) % seq_len
    ids = np.concatenate([flat, np.full(pad, pad_id)]).reshape(-1, seq_len)
    pos = np.concatenate([positions, np.arange(pad)]).reshape(-1, seq_len)
    num_tokens = np.full(len(ids), seq_len)
    num_tokens[-1] = seq_len - pad
    return ids, pos, num_tokens


def synthetic_docs(lengths: list[int], seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 30000, n).tolist() for n in lengths]
    return datasets.Dataset.from_dict(
        {"input_ids": ids}, features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    )


def assert_blocks_equal(blocks: datasets.Dataset, expected) -> None:
    ids, pos, num_tokens = expected
    np.testing.assert_array_equal(column(blocks, "input_ids"), ids)
    np.testing.assert_array_equal(column(blocks, "position_ids"), pos)
    np.testing.assert_array_equal(column(blocks, "num_tokens"), num_tokens)


S = 16  # seq_len of the synthetic corpora
BORDER_LENGTHS = [1, S - 1, S, S + 1, 1, 1, 3 * S, 2 * S + 5, S - 2, 2, 7 * S + 3, S, 1, 5 * S - 1]


@pytest.mark.parametrize("chunk_tokens", [1, 2, S - 1, S, S + 1, 3 * S + 2, 40 * S, 10**9])
@pytest.mark.parametrize("lengths", [BORDER_LENGTHS, BORDER_LENGTHS[:-1] + [S - 2]], ids=["padded", "whole"])
def test_chunked_packing_equals_whole_stream(lengths, chunk_tokens, tmp_path):
    """Documents and chunks crossing block borders in every way (a document longer than a chunk,
    ending exactly at a border, a 1-token one at a border) give the blocks of the stream laid out at once."""
    docs = synthetic_docs(lengths)
    expected = stream_reference(docs["input_ids"], S, pad_id=0)
    assert (expected[2][-1] < S) == (sum(lengths) % S != 0)
    assert_blocks_equal(pack_documents(docs, S, 0, chunk_tokens=chunk_tokens), expected)
    on_disk = pack_documents(docs, S, 0, tmp_path / "blocks.arrow", chunk_tokens=chunk_tokens)
    assert_blocks_equal(on_disk, expected)
    np.testing.assert_array_equal(target_counts(on_disk, chunk_rows=3), target_counts(datasets.Dataset.from_dict(
        {"position_ids": expected[1], "num_tokens": expected[2]})))


def test_chunked_packing_across_row_windows_and_selection(tmp_path):
    """More documents than one read window (4096 rows), shuffled through an indices mapping."""
    lengths = np.random.default_rng(1).integers(1, 3 * S, 9000).tolist()
    docs = synthetic_docs(lengths, seed=2)
    order = np.random.default_rng(3).permutation(len(docs))[:8500]
    part = docs.select(order)
    expected = stream_reference([docs["input_ids"][i] for i in order], S, pad_id=5)
    blocks = pack_documents(part, S, 5, tmp_path / "blocks.arrow", chunk_tokens=1000)
    assert_blocks_equal(blocks, expected)
    pos, n = expected[1], expected[2]
    valid = (pos != 0) & (np.arange(S)[None, :] < n[:, None])
    valid[:, 0] = False
    np.testing.assert_array_equal(target_counts(blocks, chunk_rows=700), valid.sum(axis=1))


def test_document_chunks_hold_at_most_chunk_tokens():
    lengths = [3, 4, 10, 2, 2, 2, 9, 1, 30, 5]
    docs = synthetic_docs(lengths)
    chunks = list(packing._document_chunks(docs, chunk_tokens=10, window_rows=4))
    got = [list(n) for _, n, _ in chunks]
    # whole documents in order, a window's border never crossed, a 30-token document in 3 slices that continue it
    assert got == [[3, 4], [10], [2], [2, 2], [9, 1], [10], [10], [10], [5]]  # windows: 3 4 10 2 | 2 2 9 1 | 30 5
    assert [c for _, _, c in chunks] == [False] * 5 + [False, True, True, False]
    assert max(f.size for f, _, _ in chunks) == 10
    np.testing.assert_array_equal(np.concatenate([f for f, _, _ in chunks]), np.concatenate(docs["input_ids"]))


def test_empty_corpus_is_refused():
    with pytest.raises(UserError, match="0 tokens"):
        pack_documents(synthetic_docs([]), S, 0)


# ---------------------------------------------------------------------------------- isolation
def forward_logits(model, batch):
    """The model's logits for a collated batch, called as toolkit.models.loss calls it (no KV cache)."""
    return model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits


def segments(position_ids: torch.Tensor, num_tokens: int):
    """(start, end) of each run of real tokens whose position ids count up from 0."""
    starts = [i for i in range(num_tokens) if position_ids[i] == 0] + [num_tokens]
    return list(zip(starts[:-1], starts[1:], strict=True))


@pytest.mark.parametrize(
    "model_type, attn",
    [("llama", "sdpa"), ("gpt2", "sdpa"), ("qwen2", "sdpa"), ("llama", "flex_attention"), ("qwen2", "flex_attention")],
)
def test_packed_document_logits_equal_alone(model_type, attn, docs, tiny_tokenizer, tiny_model):
    """Every document's logits equal those of the document run alone, under each attention kind
    as the toolkit feeds it (flex_attention: forward only, torch has no CPU backward for it).
    Blocks of 32: flex_attention then runs at 5 x 32, a shape test_loss.py compiles too (each compile
    of its CPU kernels is ~15 CPU-s; inductor's cache serves the second)."""
    SEQ_LEN = 32  # noqa: N806
    packed = pack_documents(tokenize_documents(docs, tiny_tokenizer), SEQ_LEN, tiny_tokenizer.pad_token_id)
    model = tiny_model(model_type, tokenizer=tiny_tokenizer).eval()
    # the blocks that hold several documents (some of them the tail of a split one), and the padded last
    pos, n_real = column(packed, "position_ids"), column(packed, "num_tokens")
    rows = [i for i in range(len(packed)) if (pos[i, : n_real[i]] == 0).sum() > 1] + [len(packed) - 1]
    batch = collate(packed[rows], attn)
    if attn == "sdpa":
        assert batch["attention_mask"].shape == (len(rows), 1, SEQ_LEN, SEQ_LEN)
    else:
        assert "attention_mask" not in batch
        model.set_attn_implementation(attn)
    # Control: a causal mask that ignores document boundaries (what a broken block_causal_mask
    # would give). transformers 5 infers packing from position_ids when no mask is passed, so
    # "no mask" is not a usable control here; an explicit causal-only mask is.
    causal_only = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril().expand(len(rows), 1, SEQ_LEN, SEQ_LEN)
    with torch.no_grad():
        masked = forward_logits(model, batch)
        model.set_attn_implementation("sdpa")
        unmasked = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=causal_only
        ).logits

    checked = behind_others = 0
    worst_unmasked = 0.0
    for b, row in enumerate(rows):
        n = int(packed[row]["num_tokens"])
        for start, end in segments(batch["position_ids"][b], n):
            ids = batch["input_ids"][b, start:end][None]
            with torch.no_grad():
                alone = model(input_ids=ids, position_ids=torch.arange(end - start)[None]).logits[0]
            torch.testing.assert_close(masked[b, start:end], alone, atol=1e-5, rtol=0)
            checked += 1
            if start > 0:
                behind_others += 1
                worst_unmasked = max(worst_unmasked, (unmasked[b, start:end] - alone).abs().max().item())
    assert behind_others >= 6
    assert worst_unmasked > 1e-3  # the data would reveal attention across documents


def test_block_causal_mask_shape_and_content():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(pos)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


# ------------------------------------------------------------------------------------- labels
def test_labels_mask_document_starts_and_padding(docs, tiny_tokenizer, packed):
    doc_ids = reference_ids(docs, tiny_tokenizer)
    _, is_start = reference_layout(doc_ids, SEQ_LEN)
    total = len(is_start)
    n_blocks = len(packed)
    flat_start = np.zeros(n_blocks * SEQ_LEN, dtype=bool)
    flat_start[:total] = is_start
    is_pad = np.arange(n_blocks * SEQ_LEN) >= total
    ids = column(packed, "input_ids")

    batch = collate(packed[list(range(n_blocks))], "sdpa")
    labels = batch["labels"].numpy()
    expected = np.where((flat_start | is_pad).reshape(n_blocks, SEQ_LEN), IGNORE_INDEX, ids)
    # column 0 is shifted away (nothing predicts it), so it only needs to be ignored or a token
    np.testing.assert_array_equal(labels[:, 1:], expected[:, 1:])

    # same thing through labels_for directly
    direct = labels_for(
        torch.as_tensor(ids),
        torch.as_tensor(column(packed, "position_ids")),
        torch.as_tensor(column(packed, "num_tokens")),
    )
    assert torch.equal(direct, batch["labels"])

    counts = target_counts(packed)
    np.testing.assert_array_equal(counts, (labels[:, 1:] != IGNORE_INDEX).sum(axis=1))
    # independent total: each document predicts all its tokens but the first, except at block cuts
    cuts_inside_docs = sum(1 for g in range(SEQ_LEN, total, SEQ_LEN) if not is_start[g])
    assert counts.sum() == sum(len(x) - 1 for x in doc_ids) - cuts_inside_docs


# ---------------------------------------------------------------------------------- attention
def test_check_attention_names_what_keeps_documents_apart():
    with pytest.raises(UserError) as info:
        check_attention("sdpa_paged")
    message = str(info.value)
    assert message.startswith("model.attn_implementation=sdpa_paged cannot keep packed documents apart")
    assert all(kind in message for kind in ("sdpa", "eager", "flex_attention", "flash_attention_2"))
    for kind in ("sdpa", "eager", "flex_attention", "flash_attention_2"):
        check_attention(kind)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_eager_keeps_packed_documents_apart_as_sdpa_does(packed, tiny_tokenizer, tiny_model, model_type):
    """eager adds its 4-D mask to the scores: the boolean one sdpa takes would add 0 or 1 (logit error 0.48), the
    additive one gives sdpa's logits; Gemma 2 (no sdpa in transformers) against its own documents run one by one."""
    # blocks that hold several documents
    rows = [r for r in range(len(packed)) if len(segments(packed[r]["position_ids"], SEQ_LEN)) > 1][:3]
    eager = collate(packed[rows], "eager")
    assert eager["attention_mask"].dtype == torch.bfloat16
    model = tiny_model(model_type, tokenizer=tiny_tokenizer, attn="eager").eval()
    with torch.no_grad():
        logits = forward_logits(model, eager)
        if model_type == "llama":
            model.set_attn_implementation("sdpa")
            expected = forward_logits(model, collate(packed[rows], "sdpa"))
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
            return
        # the documents of a block holding several, each run alone
        row = 0
        for a, b in segments(eager["position_ids"][row], SEQ_LEN)[:3]:
            alone = model(input_ids=eager["input_ids"][row:row + 1, a:b]).logits
            torch.testing.assert_close(logits[row, a:b], alone[0], atol=1e-5, rtol=0)


def test_collate_builds_mask_only_for_sdpa(packed):
    assert "attention_mask" in collate(packed[[0, 1]], "sdpa")
    flex = collate(packed[[0, 1]], "flex_attention")
    assert "attention_mask" not in flex and flex["position_ids"].shape == (2, SEQ_LEN)
    flash = collate(packed[[0, 1]], "flash_attention_2")
    assert "attention_mask" not in flash and "position_ids" in flash


def test_varlen_rows_never_predict_across_their_border():
    """Chat labels need not ignore a block's first token; once rows are one, it must be ignored,
    or the last token of a row would learn to predict the next row's first."""
    ids = torch.arange(12).reshape(3, 4)
    batch = packing.attention_inputs(
        {"input_ids": ids, "position_ids": torch.arange(4).repeat(3, 1), "labels": ids.clone()}, "flash_attention_2"
    )
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 1, 2, 3, IGNORE_INDEX, 5, 6, 7, IGNORE_INDEX, 9, 10, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3] * 3]


def test_varlen_batch_is_one_row_with_the_same_loss(packed, tiny_tokenizer, tiny_model):
    """transformers' flash varlen path reads document boundaries from position ids only for a
    batch of one row; the blocks are flattened into one, and that changes no target and no loss.
    (flash-attention needs CUDA: here the flattened row goes through sdpa with the mask that its
    own position ids give, which is what varlen attention computes.)"""
    from toolkit.models.loss import token_loss_sum

    rows = list(range(min(4, len(packed))))
    flat = collate(packed[rows], "flash_attention_2")
    assert {k: tuple(v.shape) for k, v in flat.items()} == {k: (1, len(rows) * SEQ_LEN) for k in flat}
    per_row = collate(packed[rows], "sdpa")
    model = tiny_model("llama", tokenizer=tiny_tokenizer).eval()
    with torch.no_grad():
        flat_logits = model(
            input_ids=flat["input_ids"], position_ids=flat["position_ids"],
            attention_mask=block_causal_mask(flat["position_ids"]),
        ).logits
        row_logits = forward_logits(model, per_row)
    torch.testing.assert_close(flat_logits.reshape(row_logits.shape), row_logits, atol=1e-5, rtol=0)
    assert (flat["labels"] != IGNORE_INDEX).sum() == (per_row["labels"][:, 1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(
        token_loss_sum(flat_logits, flat["labels"]), token_loss_sum(row_logits, per_row["labels"]), rtol=1e-6, atol=0
    )


# -------------------------------------------------------------------------------------- cache
def no_tokenizing(*args, **kwargs):
    raise AssertionError("tokenized again although the cache holds these blocks")


def test_packed_dataset_cache(docs, tiny_tokenizer, tmp_path, monkeypatch):
    first = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path, "source-a", num_proc=2)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].startswith("packed-")
    # only the blocks stay (the two tokenizing processes' scratch ids are gone), and they are read
    # through a memory map: a rank's batches come off the file, the columns are never loaded whole
    blocks_file = tmp_path / entries[0] / "blocks-00000-of-00001.arrow"
    assert sorted(p.name for p in (tmp_path / entries[0]).iterdir()) == [blocks_file.name, "blocks.json"]
    assert isinstance(first.data, datasets.table.MemoryMappedTable)
    assert [f["filename"] for f in first.cache_files] == [str(blocks_file)]
    tokenized = tokenize_documents(docs, tiny_tokenizer)
    assert_blocks_equal(first, tuple(column(pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id), name)
                                     for name in ("input_ids", "position_ids", "num_tokens")))

    monkeypatch.setattr(packing, "tokenize_documents", no_tokenizing)
    again = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path, "source-a")
    np.testing.assert_array_equal(column(again, "input_ids"), column(first, "input_ids"))
    assert sorted(p.name for p in tmp_path.iterdir()) == entries
    monkeypatch.undo()

    shorter = packed_dataset(docs, tiny_tokenizer, SEQ_LEN // 2, tmp_path, "source-a")
    assert column(shorter, "input_ids").shape[1] == SEQ_LEN // 2
    other_source = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path, "source-b")
    assert len(other_source) == len(first)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and all(n.startswith("packed-") for n in names)  # no .tmp left behind


# ------------------------------------------------------------------ preparation shared by ranks
def run_ranks(world: int, fn):
    """fn(ranks) on `world` threads that gather through a barrier, like ranks of a process group."""
    barrier, slots = threading.Barrier(world, timeout=120), [None] * world
    results, errors = [None] * world, []

    def ranks_of(rank: int) -> packing.Ranks:
        def gather(value):
            slots[rank] = value
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return packing.Ranks(rank, world, gather)

    def body(rank: int):
        try:
            results[rank] = fn(ranks_of(rank))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("lengths", [BORDER_LENGTHS, [1, 2, 40, 1, 1, 3, 2 * S]], ids=["borders", "tiny-shards"])
def test_shards_packed_by_ranks_add_up_to_the_whole_stream(world, lengths, tmp_path):
    """Each rank packs its contiguous share; the files in rank order are the one-process blocks,
    also where a share lies inside one block or the corpus's last block spans several shares."""
    docs = synthetic_docs(lengths)
    expected = stream_reference(docs["input_ids"], S, pad_id=0)

    def pack(ranks):
        shard = docs.shard(ranks.world, ranks.rank, contiguous=True)
        path = tmp_path / f"blocks-{ranks.rank}.arrow"
        return path, packing.pack_shard(shard, S, 0, path, ranks, chunk_tokens=S + 3)

    files = run_ranks(world, pack)
    if lengths[1] == 2 and world > 2:  # a share of 1-2 small documents lies inside a block begun before it
        assert any(n == 0 for _, n in files)
    parts = [datasets.Dataset.from_file(str(p)) for p, n in files if n]
    assert [len(x) for x in parts] == [n for _, n in files if n]
    assert_blocks_equal(datasets.concatenate_datasets(parts), expected)


def test_packed_dataset_by_ranks_equals_one_process(docs, tiny_tokenizer, tmp_path):
    alone = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "one", "src")
    shared = run_ranks(3, lambda ranks: packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "three", "src",
                                                       ranks=ranks))
    for blocks in shared:
        assert_blocks_equal(blocks, tuple(column(alone, n) for n in ("input_ids", "position_ids", "num_tokens")))
    folder = next((tmp_path / "three").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [f"blocks-{r:05d}-of-00003.arrow" for r in range(3)] + ["blocks.json"]
    # a cache made by 3 ranks is read by 1 (the key does not name the world size)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(packing, "tokenize_documents", no_tokenizing)
        again = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "three", "src")
    np.testing.assert_array_equal(column(again, "input_ids"), column(alone, "input_ids"))


def test_ranks_that_do_not_share_the_cache_folder_are_refused(docs, tiny_tokenizer, tmp_path):
    """Two nodes with node-local cache folders: each would see only its own share."""
    with pytest.raises(UserError, match="not one folder for all 2 ranks"):
        run_ranks(2, lambda ranks: packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / f"node{ranks.rank}", "s",
                                                  ranks=ranks))


@pytest.mark.distributed
def test_two_processes_prepare_their_shares_through_the_process_group(docs, tiny_tokenizer, tmp_path):
    """The same as one process, through torch.distributed's gather on 2 gloo processes."""
    tiny_tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "corpus.json").write_text(json.dumps(list(docs["text"])))
    probe = probe_ranks.SUPPORT / "packing_ranks_probe.py"
    proc = probe_ranks.run(probe, [tmp_path / "tokenizer", tmp_path / "corpus.json", tmp_path / "cache", SEQ_LEN], nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    folder = next((tmp_path / "cache").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [f"blocks-0000{r}-of-00002.arrow" for r in (0, 1)] + ["blocks.json"]
    alone = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "one", "probe")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(packing, "tokenize_documents", no_tokenizing)  # read from the two processes' cache
        shared = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "cache", "probe")
    assert_blocks_equal(shared, tuple(column(alone, n) for n in ("input_ids", "position_ids", "num_tokens")))


def test_ranks_of_a_node_share_its_tokenizing_processes(docs, tiny_tokenizer, tmp_path, monkeypatch):
    """data.num_proc is the node's: 2 ranks on a node with num_proc 4 start 2 tokenizing processes each."""
    asked, tokenize = [], packing.tokenize_documents
    monkeypatch.setattr(packing, "tokenize_documents",
                        lambda d, tok, num_proc, **kw: (asked.append(num_proc), tokenize(d, tok, num_proc, **kw))[1])
    run_ranks(2, lambda ranks: packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path, "s", num_proc=4,
                                              ranks=dataclasses.replace(ranks, local_world=2)))
    assert asked == [2, 2]


def test_documents_are_tokenized_a_window_at_a_time(docs, tiny_tokenizer, tmp_path, monkeypatch):
    """Fresh tokenizing processes for each window of TOKENIZE_DOCUMENTS per process (their memory follows
    the window): the windows' ids, read as one stream, give the blocks of one tokenization of everything."""
    alone = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "one", "s")
    sizes, tokenize = [], packing.tokenize_documents
    monkeypatch.setattr(packing, "TOKENIZE_DOCUMENTS", 2)
    monkeypatch.setattr(packing, "tokenize_documents",
                        lambda d, tok, num_proc, **kw: (sizes.append((len(d), num_proc)), tokenize(d, tok, num_proc, **kw))[1])
    windowed = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "windows", "s", num_proc=2)
    assert sizes == [(4, 2), (4, 2), (2, 2)]  # 10 documents, 2 processes of 2 documents each
    assert_blocks_equal(windowed, tuple(column(alone, n) for n in ("input_ids", "position_ids", "num_tokens")))
    assert [p.name for p in (tmp_path / "windows").iterdir()] and not list((tmp_path / "windows").rglob("ids-*"))


# ---------------------------------------------------------------- one long document (issue 26)
def one_line(texts: list[str], chars: int) -> str:
    """A document of `chars` characters on one line (no paragraph or line to split it at)."""
    line = " ".join(t.replace("\n", " ") for t in texts)
    return (line * (chars // len(line) + 1))[:chars]


def test_document_pieces_join_back_and_cut_before_a_space():
    text = "ab  cd\nefgh ij" * 50 + "x" * 40  # ends with a run no whitespace cuts
    pieces = packing.document_pieces(text, 16)
    assert "".join(pieces) == text
    assert max(len(p) for p in pieces) <= 16
    assert all(p[0].isspace() for p in pieces[1:-2])  # the next piece starts with its word's space
    assert all(not p[-1].isspace() for p in pieces[:-2])  # never inside a run of whitespace
    assert packing.document_pieces("short", 16) == ["short"]


def test_a_long_document_is_tokenized_in_bounded_pieces(tiny_texts, tiny_tokenizer):
    """The tokenizer never gets more than PIECE_CHARS characters at once (a 50 MB one-line document took
    ~9 GB in one call, then aborted); the pieces are one document: joined, with one EOS, and equal to
    tokenizing the text whole (every cut is before a space)."""
    text = one_line(tiny_texts, 300_000)
    calls = []

    class Spy:
        def encode_batch_fast(self, texts, add_special_tokens):
            calls.append(sum(len(t) for t in texts))
            return tiny_tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    class Tokenizer:
        eos_token_id, backend_tokenizer = tiny_tokenizer.eos_token_id, Spy()

    [ids, short] = packing.encoder(Tokenizer(), piece_chars=20_000)([text, "a b"])
    assert max(calls) <= 20_000 and len(calls) > 10
    whole = tiny_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    np.testing.assert_array_equal(ids, [*whole, tiny_tokenizer.eos_token_id])
    assert (ids == tiny_tokenizer.eos_token_id).sum() == 1
    assert short[-1] == tiny_tokenizer.eos_token_id


def test_a_long_document_is_packed_a_chunk_at_a_time_as_one_document(tiny_texts, tiny_tokenizer, monkeypatch):
    """A document of more tokens than a chunk reaches the layout in slices of at most CHUNK_TOKENS
    whose positions continue (no restart where a slice or a piece starts, only at block borders)."""
    docs = datasets.Dataset.from_dict({"text": ["Hi.", one_line(tiny_texts, 60_000), "x = 1"]})
    tokenized = tokenize_documents(docs, tiny_tokenizer)
    expected = stream_reference(tokenized["input_ids"], SEQ_LEN, tiny_tokenizer.pad_token_id)
    sizes = []
    add = packing.Layout.add
    monkeypatch.setattr(packing.Layout, "add", lambda self, flat, *a: sizes.append(flat.size) or add(self, flat, *a))
    assert_blocks_equal(pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id, chunk_tokens=1000), expected)
    assert max(sizes) == 1000 and sum(sizes) == sum(len(x) for x in tokenized["input_ids"])


def test_a_one_line_document_of_megabytes_holds_bounded_memory():
    """Peak RSS growth of tokenizing, then training a BPE on, one 6 MB line, in a fresh process: whole,
    the Rust tokenizer took ~130 bytes a character (~780 MB here, 6.5 GB for 50 MB); in pieces of
    PIECE_CHARS it is ~200 MB whatever the length. The peak only grows, so either one taking the line
    whole passes the bound."""
    script = """
import resource, datasets
from pydoc_data.topics import topics
from toolkit.data.packing import encoder
from toolkit.data.tokenizer import train_bpe
texts = [topics[k] for k in sorted(topics)]
tok = train_bpe(datasets.Dataset.from_dict({"text": texts}), 512)
line = " ".join(t.replace(chr(10), " ") for t in texts)
doc = (line * (6_000_000 // len(line) + 1))[:6_000_000]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
encoder(tok)([doc])
print("tokenize", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
train_bpe(datasets.Dataset.from_dict({"text": [doc]}), 512)
print("train a BPE", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    grown = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines()[-2:])
    assert list(grown) == ["tokenize", "train a BPE"] and all(int(mb) < 350 for mb in grown.values()), out.stdout


def test_a_corpus_of_fewer_documents_than_ranks_is_packed_by_the_ranks_that_have_one(tiny_texts, tiny_tokenizer,
                                                                                    tmp_path):
    """A small source of a mixture (or a held-out split of one document) on more ranks than it has documents:
    the ranks without one pack nothing (was datasets' IndexError on rank 1 of 2 for a 1-document split)."""
    docs = datasets.Dataset.from_dict({"text": tiny_texts[:2]})
    alone = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "one", "few")
    shared = run_ranks(3, lambda ranks: packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path / "three", "few",
                                                       ranks=ranks))
    for blocks in shared:
        assert_blocks_equal(blocks, tuple(column(alone, n) for n in ("input_ids", "position_ids", "num_tokens")))


def test_two_runs_packing_one_corpus_at_once_pack_it_once(docs, tiny_tokenizer, tmp_path, monkeypatch, at_once):
    """Two runs on one data.cache_dir packing the same blocks at once wrote into one temporary folder, each clearing
    it for itself (issue 44); the second now waits for the first and reads its blocks."""
    import time

    tokenized, tokenize = [], tokenize_documents
    monkeypatch.setattr(packing, "tokenize_documents",
                        lambda *a, **k: (tokenized.append(1), time.sleep(0.3), tokenize(*a, **k))[2])
    got, failed = at_once(lambda: packed_dataset(docs, tiny_tokenizer, SEQ_LEN, tmp_path, "source-a"))
    assert not failed, failed
    assert len(tokenized) == 1
    np.testing.assert_array_equal(column(got[0], "input_ids"), column(got[1], "input_ids"))
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("packed-*")]  # no .tmp, no lock
