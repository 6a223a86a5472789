"""Preference records -> pairs -> packed blocks: the targets are each answer's tokens only, a pair is never split,
each sequence is its own document, and the counts, truncation and odd records are as the log says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.data.chat import ChatDataConfig
from toolkit.data.packing import IGNORE_INDEX
from toolkit.data.preference import (
    collate_pairs,
    embedded_records,
    pack_pairs,
    pair_counts,
    preference_blocks,
    to_pair,
    tokenize_pairs,
    with_reference,
)


def test_record_forms():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert to_pair({"prompt": "Q", "chosen": "a", "rejected": "b"}, 0) == ([{"role": "user", "content": "Q"}], "a", "b")
    # TRL's conversational form: the answers as one-message lists
    assert to_pair({"prompt": messages, "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": {"role": "assistant", "content": "b"}}, 0) == (messages, "a", "b")
    # TRL's implicit prompt: two whole conversations, the same but for the assistant's last turn
    said = [*messages, {"role": "assistant", "content": "a"}]
    assert to_pair({"chosen": said, "rejected": [*messages, {"role": "assistant", "content": "b"}]}, 0) == (
        messages, "a", "b")
    with pytest.raises(UserError, match="record 2: `chosen` and `rejected` without `prompt` must share every turn but"):
        to_pair({"chosen": said, "rejected": [{"role": "user", "content": "other"}, said[-1]]}, 2)
    with pytest.raises(UserError, match="record 3 lacks `chosen`, `rejected`"):
        to_pair({"prompt": "Q"}, 3)
    with pytest.raises(UserError, match="record 0: `rejected` must be a string or one assistant message"):
        to_pair({"prompt": "Q", "chosen": "a", "rejected": 7}, 0)
    # whole conversations whose last turn is not the assistant's: the role said (it said "must be a string or one
    # assistant message", of a shape the implicit prompt takes)
    bot = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "a"}]
    with pytest.raises(UserError, match="record 4: the answer of `chosen` \\(its last message\\) has role 'bot'; an "
                                        "answer is the assistant's"):
        to_pair({"chosen": bot, "rejected": [*bot[:1], {"role": "bot", "content": "b"}]}, 4)


def test_trl_s_standard_implicit_prompt_is_the_words_both_texts_open_with():
    """TRL's fourth preference shape: `chosen` and `rejected` as whole texts, no `prompt` (it was refused as lacking
    one). The shared opening words are the user's turn; no word is split between prompt and answer."""
    assert to_pair({"chosen": "The sky is blue.", "rejected": "The sky is green."}, 0) == (
        [{"role": "user", "content": "The sky is"}], "blue.", "green.")
    assert to_pair({"chosen": "Q: 2 + 2? A: no thanks", "rejected": "Q: 2 + 2? A: nope"}, 0) == (
        [{"role": "user", "content": "Q: 2 + 2? A:"}], "no thanks", "nope")
    with pytest.raises(UserError, match=r"^record 4: `chosen` and `rejected` without `prompt` share no opening words to "
                                        r"take as the prompt; give `prompt` apart$"):
        to_pair({"chosen": "Blue.", "rejected": "Bleak."}, 4)


def test_a_chat_record_given_as_a_pair_says_it_is_one():
    with pytest.raises(UserError, match=r"^record 0 lacks `prompt`, `chosen`, `rejected` \(has \['conversations'\]\) \(a chat "
                                        r"record, ShareGPT \(conversations of from/value\): train on it with "
                                        r"data.format=chat\); a preference record needs"):
        to_pair({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}, 0)


def test_the_log_says_the_trl_shape_of_each_record(tmp_path, chat_tokenizer):
    """The first data line counts the records by TRL's shape, as chat records are counted by theirs."""
    said = [{"role": "user", "content": "Q"}]
    records = [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"chosen": "Q: x is a", "rejected": "Q: x is b"},
               {"chosen": [*said, {"role": "assistant", "content": "a"}],
                "rejected": [*said, {"role": "assistant", "content": "b"}]},
               {"chosen": "Q: y is a", "rejected": "Q: y is c"}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _, _, notes = preference_blocks(ChatDataConfig(path=str(tmp_path / "pairs.jsonl"), seq_len=256, val_fraction=0),
                                    chat_tokenizer, 0)
    assert notes[0] == ("4 preference records: 0 with chosen equal to rejected and 0 with an empty answer left out; "
                        "TRL's 2 standard (text), implicit prompt, 1 standard (text), prompt given, 1 conversational "
                        "(messages), implicit prompt")


def test_targets_are_each_answer_and_its_turn_end_after_one_prompt(chat_tokenizer):
    record = {"prompt": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "earlier answer"},
                         {"role": "user", "content": "Q2"}], "chosen": "the good one", "rejected": "the bad one"}
    (ids_c, lab_c, ids_r, lab_r), = tokenize_pairs([record], chat_tokenizer, None)[0]
    for ids, labels, answer in ((ids_c, lab_c, "the good one"), (ids_r, lab_r, "the bad one")):
        targets = [t for t in labels if t != IGNORE_INDEX]
        assert chat_tokenizer.decode(targets) == answer + "<|im_end|>"  # not the earlier assistant turn
        assert len(ids) == len(labels) and ids[-len(targets):] == targets
        assert labels[-1] != IGNORE_INDEX  # the sequence ends at its answer's turn end
    start = next(i for i, t in enumerate(lab_c) if t != IGNORE_INDEX)
    assert ids_c[:start] == ids_r[:start]  # one prompt, rendered alike before each answer


def test_equal_and_empty_answers_are_left_out_and_counted(chat_tokenizer):
    records = [{"prompt": "Q", "chosen": "a", "rejected": "a"}, {"prompt": "Q", "chosen": "", "rejected": "b"},
               {"prompt": "Q", "chosen": "a", "rejected": "b"}]
    rows, said = tokenize_pairs(records, chat_tokenizer, None)
    assert len(rows) == 1
    assert said == "3 preference records: 1 with chosen equal to rejected and 1 with an empty answer left out"


def test_blocks_hold_whole_pairs_chosen_then_rejected_each_its_own_document(chat_tokenizer):
    rows, _ = tokenize_pairs(embedded_records(), chat_tokenizer, None)
    blocks, stats = pack_pairs(rows, 2048, chat_tokenizer.pad_token_id)
    cols = blocks.with_format("numpy")[:]
    assert stats.truncated == stats.dropped == 0
    assert stats.kept == len(rows) == int(pair_counts(blocks).sum()) and stats.blocks == len(blocks) < len(rows)
    found = []
    for b in range(len(blocks)):
        seq, pos, ids, labels = cols["sequence"][b], cols["position_ids"][b], cols["input_ids"][b], cols["labels"][b]
        assert sorted(set(seq[seq >= 0].tolist())) == list(range(2 * cols["pairs"][b]))
        sides = []
        for s in range(2 * cols["pairs"][b]):
            where = np.flatnonzero(seq == s)
            assert np.array_equal(pos[where], np.arange(len(where)))  # a document of its own, contiguous
            assert labels[where[0]] == IGNORE_INDEX  # nothing before it in the block predicts its first token
            sides.append((tuple(ids[where]), tuple(labels[where][1:])))
        found += [(sides[k], sides[k + 1]) for k in range(0, len(sides), 2)]
        assert (labels[seq < 0] == IGNORE_INDEX).all() and (seq[cols["num_tokens"][b]:] == -1).all()
    # every pair is in the blocks whole, its chosen sequence (2k) before its rejected one (2k + 1), tokens unchanged
    expected = [((tuple(c), tuple(lc[1:])), (tuple(r), tuple(lr[1:]))) for c, lc, r, lr in rows]
    assert sorted(found) == sorted(expected)


def test_a_pair_longer_than_a_block_is_cut_to_fit_or_dropped(chat_tokenizer):
    long = "word " * 200
    rows, _ = tokenize_pairs([{"prompt": "Q", "chosen": long, "rejected": "short"}], chat_tokenizer, None)
    blocks, stats = pack_pairs(rows, 64, chat_tokenizer.pad_token_id, "truncate")
    cols = blocks.with_format("numpy")[0]
    assert stats.truncated == 1 and cols["num_tokens"] == 64 == len(rows[0][0][:64 - len(rows[0][2])]) + len(rows[0][2])
    assert (cols["sequence"] == 1).sum() == len(rows[0][2])  # the short answer kept whole, the long one cut
    with pytest.raises(UserError, match="none of 1 preference pairs fits data.seq_len=64"):
        pack_pairs(rows, 64, chat_tokenizer.pad_token_id, "drop")


def test_overlong_drop_keeps_the_pairs_that_fit_and_counts_the_dropped(chat_tokenizer, tmp_path):
    long = "word " * 200
    short = [{"prompt": f"Q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(3)]
    records = [short[0], {"prompt": "Q", "chosen": long, "rejected": "short"}, short[1],
               {"prompt": "Q", "chosen": "short", "rejected": long}, short[2]]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = ChatDataConfig(path=str(path), seq_len=64, overlong="drop", val_fraction=0)
    train, val, notes = preference_blocks(cfg, chat_tokenizer, 1)
    assert val is None and notes[1].startswith("train: packed 3 of 5 pairs")
    assert "0 truncated to seq_len, 2 dropped" in notes[1]
    assert notes[-1] == ("2 training pairs are longer than data.seq_len=64 and were dropped (data.overlong=drop); "
                         "raise data.seq_len to keep them whole")
    cols = train.with_format("numpy")[:]
    found = sorted(tuple(cols["input_ids"][b][cols["sequence"][b] == s])
                   for b in range(len(train)) for s in range(2 * cols["pairs"][b]))
    rows, _ = tokenize_pairs(short, chat_tokenizer, None)
    assert found == sorted(tuple(ids) for row in rows for ids in (row[0], row[2]))  # the short pairs, whole


def test_collate_numbers_sequences_apart_across_rows_and_carries_the_reference(chat_tokenizer):
    train, val, notes = preference_blocks(ChatDataConfig(seq_len=512, val_fraction=0.25), chat_tokenizer, 1)
    assert notes[1].startswith("train: packed 24 of 24 pairs") and "held-out: packed 8 of 8" in notes[2]
    assert notes[3].endswith("training pairs are longer than data.seq_len=512 and were truncated "
                             "(data.overlong=truncate); raise data.seq_len to keep them whole")
    logps = np.random.default_rng(0).standard_normal((len(train), 512)).astype(np.float32)
    blocks = with_reference(train, logps).with_format("numpy")
    batch = collate_pairs(blocks[:2], "sdpa")
    assert torch.equal(batch["ref_logps"], torch.as_tensor(logps[:2]))
    first, second = batch["sequence"][0], batch["sequence"][1]
    assert set(first[first >= 0].tolist()).isdisjoint(second[second >= 0].tolist())
    assert batch["attention_mask"].shape == (2, 1, 512, 512)
    # varlen attention joins the rows into one: the numbers stay apart
    flat = collate_pairs(blocks[:2], "flash_attention_2")
    assert flat["sequence"].shape == (1, 1024) and torch.equal(flat["sequence"][0], batch["sequence"].reshape(-1))


def test_a_held_out_file_of_pairs_is_held_out_whole(tmp_path, chat_tokenizer):
    """data.val_path: every pair of data.path trains, every pair of data.val_path is held out."""
    from toolkit.data.preference import preference_blocks

    pair = {"prompt": "How do I reverse a list?", "chosen": "items[::-1]", "rejected": "You cannot."}
    for name, n in (("train", 6), ("held", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(pair) + "\n" for _ in range(n)))
    cfg = ChatDataConfig(path=str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "held.jsonl"), seq_len=256)
    train, val, notes = preference_blocks(cfg, chat_tokenizer, 0)
    assert sum(pair_counts(train)) == 6 and sum(pair_counts(val)) == 3
    assert notes[-1].startswith(f"held-out (data.val_path={tmp_path / 'held.jsonl'}): ")
