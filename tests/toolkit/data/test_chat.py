"""Chat SFT data: only assistant output is a target under any template, packing keeps every
conversation whole and apart, and a packed batch has the loss of its conversations run alone."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
from recipe_runner import CHATML

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.data.chat import (
    TOOL_TURNS,
    ChatDataConfig,
    chat_target_counts,
    chat_template_for,
    collate_chat,
    load_chat_records,
    pack_conversations,
    render_conversation,
    to_messages,
    tokenize_conversations,
)
from toolkit.data.packing import IGNORE_INDEX, column
from toolkit.data.python_chats import PYTHON_CHATS
from toolkit.data.records import REFUSE, UNRENDERED, unrendered
from toolkit.models.loss import token_loss_sum

# Meta-Llama-3-8B-Instruct's template, verbatim: BOS, headers, `| trim` on the content, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Zephyr's template: role tags that are plain text, turns ended by the EOS, a generation prompt
# that stops before the newline the real turn has.
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] "
    "+ eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
    "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)
# A system turn, multi-turn, instruction/input/output, and content the Llama 3 template trims.
CONVERSATIONS = [
    to_messages(PYTHON_CHATS[2], 2),
    to_messages(PYTHON_CHATS[12], 12),
    to_messages(PYTHON_CHATS[26], 26),
    [
        {"role": "user", "content": "  Say hi.  "},
        {"role": "assistant", "content": "\nHi! How can I help with Python today?\n"},
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "assistant"},  # the role name as content: must match the content
    ],
]


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf_path):
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the GGUF as the toolkit reads it (~2 s)."""
    from transformers import AutoTokenizer

    from toolkit.models.gguf_base import _parse_gguf_once

    path = smollm2_gguf_path
    with _parse_gguf_once():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def llama3_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    return tok


def _runs(tokenizer, ids, labels):
    """Contiguous runs of target / masked tokens, decoded: [(is_target, text), ...]."""
    runs: list[tuple[bool, list[int]]] = []
    for tid, lab in zip(ids, labels, strict=True):
        target = lab != IGNORE_INDEX
        if runs and runs[-1][0] == target:
            runs[-1][1].append(tid)
        else:
            runs.append((target, [tid]))
    return [(t, tokenizer.decode(r, skip_special_tokens=False)) for t, r in runs]


@pytest.mark.parametrize("template", ["smollm2", "llama3", "zephyr"])
def test_labels_are_exactly_the_assistant_output(template, request):
    """Targets decode to each assistant content + its turn-end token; the masked tokens decode
    to everything else in the template's own rendering (system/user turns, headers, boilerplate)."""
    if template == "llama3":
        tok, chat_template, end, trim = request.getfixturevalue("llama3_tokenizer"), LLAMA3_TEMPLATE, "<|eot_id|>", True
    else:
        tok = request.getfixturevalue("smol_tokenizer")
        chat_template = None if template == "smollm2" else ZEPHYR_TEMPLATE
        end, trim = tok.eos_token, False
    for messages in CONVERSATIONS:
        ids, labels = render_conversation(tok, messages, chat_template)
        # the same tokens as the template's own tokenization
        own = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=True, return_dict=False)
        assert ids == list(own)
        assert all(lab in (IGNORE_INDEX, tid) for tid, lab in zip(ids, labels, strict=True))
        runs = _runs(tok, ids, labels)
        rendered = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
        assert "".join(text for _, text in runs) == rendered
        expected = [(m["content"].strip() if trim else m["content"]) + end for m in messages if m["role"] == "assistant"]
        assert [text for target, text in runs if target] == expected
        masked = [text for target, text in runs if not target]
        assert all(m["content"].strip() in "".join(masked) for m in messages if m["role"] != "assistant")


def test_smollm2_template_masks_its_default_system_prompt(smol_tokenizer):
    """SmolLM2's template adds its own system turn when there is none: never a target."""
    ids, labels = render_conversation(smol_tokenizer, to_messages(PYTHON_CHATS[0], 0))
    text = smol_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    first_target = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
    assert smol_tokenizer.decode(ids[:first_target]).endswith("<|im_start|>assistant\n")


def test_record_forms():
    assert to_messages({"instruction": "Add.", "input": "1 + 1", "output": "2"}, 0) == [
        {"role": "user", "content": "Add.\n\n1 + 1"},
        {"role": "assistant", "content": "2"},
    ]
    assert to_messages({"instruction": "Say yes.", "input": "", "output": "yes"}, 0)[0]["content"] == "Say yes."
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert to_messages({"messages": msgs, "source": "x"}, 0) == msgs
    assert all(to_messages(r, i) for i, r in enumerate(load_chat_records(ChatDataConfig())))


@pytest.mark.parametrize(
    "record, match",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
            r"record 7: turn 1 of `messages` has role 'bot'; use one of system, user, assistant",
        ),
        ({"question": "hi", "answer": "hello"}, r"record 7 has keys \['answer', 'question'\]; a chat record needs"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "record 7 has no assistant message"),
        ({"messages": [{"role": "user", "content": None}]}, r"record 7: turn 0 of `messages` \(user\) has no text"),
    ],
)
def test_bad_records(record, match):
    with pytest.raises(UserError, match=match) as exc:
        to_messages(record, 7)
    assert "\n" not in str(exc.value)


def test_tokenizer_without_chat_template(tiny_tokenizer):
    with pytest.raises(UserError, match="has no chat template; set data.chat_template") as exc:
        render_conversation(tiny_tokenizer, CONVERSATIONS[0])
    assert "\n" not in str(exc.value)


def test_template_that_rejects_a_conversation(llama3_tokenizer):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    strict += LLAMA3_TEMPLATE
    records = [PYTHON_CHATS[0], PYTHON_CHATS[2]]  # the second has a system turn
    with pytest.raises(UserError, match="record 1: the chat template rejected the conversation: no system role") as exc:
        tokenize_conversations(records, llama3_tokenizer, strict)
    assert "\n" not in str(exc.value)


def test_template_that_drops_the_content(llama3_tokenizer):
    with pytest.raises(UserError, match="does not render assistant message 1 verbatim") as exc:
        render_conversation(llama3_tokenizer, CONVERSATIONS[2], "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert "\n" not in str(exc.value)


def test_template_from_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "chat.jinja"
    path.write_text(LLAMA3_TEMPLATE)
    assert chat_template_for(tiny_tokenizer, str(path)) == LLAMA3_TEMPLATE
    cfg = load_config(ChatDataConfig, None, [f"chat_template={path}", "overlong=drop", "seq_len=64"])
    assert (cfg.overlong, cfg.seq_len) == ("drop", 64)
    with pytest.raises(ConfigError, match="chat_template=.*missing.jinja does not exist"):
        load_config(ChatDataConfig, None, [f"chat_template={tmp_path / 'missing.jinja'}"])
    with pytest.raises(ConfigError, match=f"chat_template={tmp_path} is a folder; give a .jinja file"):
        load_config(ChatDataConfig, None, [f"chat_template={tmp_path}"])
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{# résumé #}".encode("latin-1") + LLAMA3_TEMPLATE.encode())
    with pytest.raises(UserError, match=r"chat_template=.*latin1.jinja is not UTF-8 text \(byte 0xe9 at offset 4"):
        chat_template_for(tiny_tokenizer, str(latin1))


def test_jsonl_records(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"messages": [{"role": "user"\n')
    with pytest.raises(UserError, match=r"chats.jsonl line 3 is not valid JSON"):
        load_chat_records(ChatDataConfig(path=str(path)))
    path.write_text('{"instruction": "a", "output": "b"}\n')
    assert load_chat_records(ChatDataConfig(path=str(path))) == [{"instruction": "a", "output": "b"}]


def test_chat_records_that_are_not_utf8_name_the_file_and_the_byte(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = '{"instruction": "a", "output": "b"}\n'
    path.write_bytes((good + '{"instruction": "caf\u00e9", "output": "b"}\n').encode("latin-1"))  # é is 0xe9
    with pytest.raises(UserError) as info:
        load_chat_records(ChatDataConfig(path=str(path)))
    assert str(info.value) == (
        f"data.path={path} is not UTF-8 text (byte 0xe9 at offset {len(good) + 20}, line 2); "
        "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
    )


# --- packing -------------------------------------------------------------------------------------


def _synthetic(lengths, seed=0):
    """(ids, labels) pairs: distinct ids per conversation, targets on its second half."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        ids = rng.integers(10, 1000, n).tolist()
        labels = [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]
        rows.append((ids, labels))
    return rows


def _segments(blocks):
    """Every segment of real tokens, in order: (block, ids, labels, positions)."""
    out = []
    ids, pos, labels, n = (column(blocks, c) for c in ("input_ids", "position_ids", "labels", "num_tokens"))
    for b in range(len(n)):
        starts = np.flatnonzero(pos[b, : n[b]] == 0).tolist() + [int(n[b])]
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            out.append((b, ids[b, s:e].tolist(), labels[b, s:e].tolist(), pos[b, s:e].tolist()))
    return out


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_packing_keeps_conversations_whole_and_apart(overlong):
    seq_len = 32
    lengths = [5, 30, 32, 1, 12, 40, 7, 7, 19, 100, 2, 25]
    rows = _synthetic(lengths)
    blocks, stats = pack_conversations(rows, seq_len, pad_id=0, overlong=overlong)
    kept, truncated = [], 0  # what should survive: too long -> truncated or dropped; no target left -> dropped
    for ids, labels in rows:
        if len(ids) > seq_len and overlong == "drop":
            continue
        if any(lab != IGNORE_INDEX for lab in labels[1:seq_len]):
            kept.append((ids[:seq_len], labels[:seq_len]))
            truncated += len(ids) > seq_len
    assert 0 < len(kept) < len(rows)
    segments = _segments(blocks)
    # every kept conversation once, in one block, positions 0..n-1; labels: the conversation's,
    # except its first token (nothing before it in the segment)
    got = sorted((s[1], s[2]) for s in segments)
    assert got == sorted((ids, [IGNORE_INDEX] + lab[1:]) for ids, lab in kept)
    assert all(s[3] == list(range(len(s[1]))) for s in segments)
    # padding: after num_tokens, pad id, no target, its own segment starting at position 0
    ids, pos, labels, n = (column(blocks, c) for c in ("input_ids", "position_ids", "labels", "num_tokens"))
    for b in range(len(n)):
        assert (ids[b, n[b] :] == 0).all() and (labels[b, n[b] :] == IGNORE_INDEX).all()
        assert pos[b, n[b] :].tolist() == list(range(seq_len - n[b]))
    # best-fit decreasing packs these lengths into as few blocks as their tokens allow (filled in
    # data order they took 8 and 6 blocks instead of 6 and 5)
    assert len(n) == -(-int(n.sum()) // seq_len)
    assert (stats.truncated, stats.dropped) == (truncated, len(rows) - len(kept))
    assert truncated == (1 if overlong == "truncate" else 0)  # 40 tokens; 100 loses all its targets
    assert stats.kept == len(kept) and stats.blocks == len(blocks) and stats.tokens == int(n.sum())
    assert stats.targets == int(chat_target_counts(blocks).sum())
    assert f"{stats.kept} of {len(rows)} conversations" in str(stats)


def test_truncation_that_leaves_no_target_drops_the_conversation():
    ids = list(range(10, 60))
    rows = [(ids, [IGNORE_INDEX] * 40 + ids[40:]), (ids[:8], [IGNORE_INDEX] + ids[1:8])]
    blocks, stats = pack_conversations(rows, 32, pad_id=0)
    assert (stats.kept, stats.dropped, stats.truncated) == (1, 1, 0)
    with pytest.raises(UserError, match="no training conversation fits data.seq_len=32") as exc:
        pack_conversations(rows[:1], 32, pad_id=0, overlong="drop")
    assert "\n" not in str(exc.value)


def test_no_target_anywhere_is_named_as_its_cause():
    """Empty assistant turns give no target: the error said "raise data.seq_len or set data.overlong=truncate",
    though length was not the cause and overlong already was truncate."""
    ids = list(range(10, 30))
    empty = [(ids, [IGNORE_INDEX] * 20), (ids[:5], [IGNORE_INDEX] * 5)]
    for overlong in ("truncate", "drop"):
        with pytest.raises(UserError) as exc:
            pack_conversations(empty, 64, pad_id=0, overlong=overlong)
        assert str(exc.value) == ("none of the 2 training conversations has an assistant token to train on (their assistant "
                                  "turns are empty, or the chat template renders none); give the assistant messages content")
    late = [(ids * 3, [IGNORE_INDEX] * 50 + ids[:10])]  # the assistant's tokens lie past seq_len
    with pytest.raises(UserError, match=r"no training conversation has an assistant token within its first data.seq_len=32 "
                                        r"tokens \(1 of 1 are longer, .*\); raise data.seq_len$"):
        pack_conversations(late, 32, pad_id=0, overlong="truncate")
    # the held-out split said as such: its one conversation is not the training data's
    with pytest.raises(UserError, match=r"^no held-out conversation has an assistant token"):
        pack_conversations(late, 32, pad_id=0, overlong="truncate", split="held-out")


def test_packed_sft_loss_equals_conversations_one_by_one(smol_tokenizer, tiny_model):
    """block_causal_mask + position ids make a packed batch exactly the sum of its conversations."""
    records = PYTHON_CHATS[:6] + PYTHON_CHATS[-3:]
    rows = tokenize_conversations(records, smol_tokenizer)
    blocks, stats = pack_conversations(rows, 256, smol_tokenizer.pad_token_id)
    assert stats.kept == len(records) and stats.blocks < len(records)  # several per block
    model = tiny_model("llama", tokenizer=smol_tokenizer).eval()

    with torch.no_grad():
        batch = collate_chat(blocks[:], "sdpa")
        labels = batch.pop("labels")
        packed_sum = token_loss_sum(model(**batch).logits, labels)
        packed_targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
        alone_sum, alone_targets = torch.zeros(()), 0
        for ids, labs in zip(rows["input_ids"], rows["labels"], strict=True):
            labs = torch.tensor([labs])
            alone_sum += token_loss_sum(model(torch.tensor([ids])).logits, labs)
            alone_targets += int((labs[:, 1:] != IGNORE_INDEX).sum())

    assert packed_targets == alone_targets == stats.targets > 0
    torch.testing.assert_close(packed_sum / packed_targets, alone_sum / alone_targets, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ every key a record or a turn carries
VALUES = {"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
          "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]}


def _keyed(key: str, place: str) -> dict:
    """A conversation carrying `key` on its answer's turn or as the record's own key (a tool's turn: TOOL_TURNS)."""
    turns = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "it is three"}]
    if key == TOOL_TURNS:
        return {"messages": [turns[0], {"role": "assistant", "content": "", "tool_calls": VALUES["tool_calls"]},
                             {"role": "tool", "content": "three"}, turns[1]]}
    value = VALUES.get(key, "zqx")
    if place == "turn":
        return {"messages": [turns[0], {**turns[1], key: value}]}
    return {"messages": turns, key: value}


def _rendering(key: str, place: str) -> str:
    """ChatML that renders `key` where `_keyed` puts it (and tool calls, for a tool's turn to follow one)."""
    shown = "{% if m.tool_calls %}<call>{{ m.tool_calls | tojson }}</call>{% endif %}"
    if place == "turn" and key not in (TOOL_TURNS, "tool_calls"):
        shown += f"{{% if m['{key}'] is defined %}}<k>{{{{ m['{key}'] | tojson }}}}</k>{{% endif %}}"
    head = f"{{% if {key} is defined %}}<k>{{{{ {key} | tojson }}}}</k>{{% endif %}}" if place == "record" else ""
    return (head + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}" + shown
            + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("key, place", [(key, place) for key in [*UNRENDERED, "a_key_no_row_names"]
                                        for place in ("turn", "record")
                                        if not (key == TOOL_TURNS and place == "record")])  # a tool's turns are turns
def test_every_key_a_record_carries_is_trained_refused_or_said(key, place, chat_tokenizer):
    """Issue 63: OpenAI's tool calls trained on the content alone, exit 0. Every key beyond role and content goes to
    the template: rendered, it trains (an answer's keys as its targets); not rendered, it is refused or said
    (records.UNRENDERED; any other key said), and the conversation trains as it would without it."""
    record = _keyed(key, place)
    notes: list[str] = []
    rows = tokenize_conversations([record], chat_tokenizer, _rendering(key, place), notes=notes)
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    text = chat_tokenizer.decode(ids)
    assert notes == []
    tag = "call" if key == "tool_calls" and place == "turn" else "k"
    shown = "<|im_start|>tool\nthree" if key == TOOL_TURNS else f"<{tag}>{json.dumps(VALUES.get(key, 'zqx'))}</{tag}>"
    assert shown in text
    targets = chat_tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    if place == "turn" and key != TOOL_TURNS:
        assert targets == f"it is three{shown}<|im_end|>"  # the answer's keys are its output

    plain = copy.deepcopy(record)  # the template renders none of it
    if unrendered(key) == REFUSE:
        with pytest.raises(UserError, match=rf"^record 0 has .*{re.escape(key.split()[-1])}.*, which the chat template "
                                            "renders nothing of .*; set data.chat_template") as refused:
            tokenize_conversations([plain], chat_tokenizer, CHATML)
        assert "\n" not in str(refused.value)
        return
    rows = tokenize_conversations([plain, plain], chat_tokenizer, CHATML, notes=notes)
    assert notes == [f"left out, the chat template rendering nothing of them: `{key}` in 2 records"]
    bare = {"messages": [{k: v for k, v in m.items() if k != key} for m in record["messages"]]}
    assert rows[0] == tokenize_conversations([bare], chat_tokenizer, CHATML)[0]


def test_text_parts_are_their_text_and_other_parts_one_line(chat_tokenizer):
    """OpenAI's content as a list of {type: text, text} parts was "has no text content"."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "1"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "one"}]}]}
    assert to_messages(parts, 0) == [{"role": "user", "content": "add 1"}, {"role": "assistant", "content": "one"}]
    parts["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x.png"}})
    with pytest.raises(UserError, match=r"^record 0: turn 0 of `messages` \(user\) has content parts of type "
                                        r"image_url; only text trains a text model: leave the others out$"):
        to_messages(parts, 0)


def test_empty_answers_are_left_out_and_counted_as_such(chat_tokenizer):
    """An answer of "" was counted among "longer than seq_len, or no target left" (or trained the turn's end alone)."""
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    full = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    notes: list[str] = []
    rows = tokenize_conversations([empty, full, empty], chat_tokenizer, notes=notes)
    assert len(rows) == 1 and notes == ['2 conversations with an empty answer (every assistant turn "") left out']
    with pytest.raises(UserError, match=r'^every one of the 2 conversations has only empty answers \(assistant content '
                                        r'""\), so nothing to learn from; give the assistant messages content$'):
        tokenize_conversations([empty, empty], chat_tokenizer)
