"""`--preview N` (toolkit/training/preview.py): the marks say what the labels train, the table counts what was
dropped and cut, and the shipped configs preview in seconds without a model or a run folder."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from recipe_runner import ROOT, recipe_module

from toolkit.data.chat import EMPTY_ANSWER, ChatDataConfig, chat_blocks, collate_chat
from toolkit.data.packing import IGNORE_INDEX, Seen
from toolkit.data.preference import collate_pairs, preference_blocks
from toolkit.training.entry import run
from toolkit.training.preview import column_of, examples, spans_of, table
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig


def answer(i: int, words: int = 3) -> str:
    return " ".join(f"answer{i}" for _ in range(words))


def records(tmp_path, planted: list[dict]) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in planted))
    return str(path)


def chat(question: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}


@pytest.mark.parametrize("blocks_of, collate_fn", [(chat_blocks, collate_chat), (preference_blocks, collate_pairs)])
def test_the_bracketed_spans_are_the_tokens_the_labels_train(blocks_of, collate_fn, chat_tokenizer):
    """Each [[...]] of a shown block is the text of one run of labelled tokens, in order, and nothing else is."""
    train, _, _ = blocks_of(ChatDataConfig(seq_len=256, val_fraction=0), chat_tokenizer, 0)
    shown = examples([("", train, collate_fn)], 3, chat_tokenizer, colour=False)
    assert len(shown) == 3
    for b, text in enumerate(shown):
        labels = np.asarray(train[b]["labels"])
        carried = labels != IGNORE_INDEX
        edges = np.flatnonzero(np.diff(np.concatenate([[0], carried.astype(int), [0]])))
        runs = [chat_tokenizer.decode(labels[a:z].tolist(), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False) for a, z in
                zip(edges[::2], edges[1::2], strict=True)]
        assert runs and spans_of(text) == runs
        starts = text.count("<#")
        assert starts == (int((np.asarray(train[b]["position_ids"])[:train[b]["num_tokens"]] == 0).sum()))


def test_the_table_counts_what_was_read_dropped_truncated_and_trained(tmp_path, chat_tokenizer):
    planted = [chat(f"question {i}", answer(i)) for i in range(6)]
    planted.append(chat("empty", ""))  # left out: nothing to learn
    planted.append(chat("long", answer(9, 120)))  # longer than seq_len: truncated
    cfg = ChatDataConfig(path=records(tmp_path, planted), seq_len=64, val_fraction=0)
    seen = Seen()
    train, _, _ = chat_blocks(cfg, chat_tokenizer, 0, seen)
    column = column_of("chat data", seen, train, collate_chat, chat_tokenizer, "data.chat_template=x", cfg.seq_len)
    said = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table([column]).splitlines()[2:])
    assert said["records read"] == "8"
    assert said[f"dropped: {EMPTY_ANSWER}"] == "1"
    assert said["packed for training"] == "7"
    long = seen.stats.lengths.max()
    assert long > 64 and said["truncated to data.seq_len"] == f"1 ({long - 64} tokens cut)"
    assert said["tokens per record"].endswith(f"max {long}")
    labels = np.concatenate([np.asarray(b) for b in train["labels"]])
    assert said["tokens with loss"].startswith(f"{(labels != IGNORE_INDEX).sum() / sum(train['num_tokens']):.1%}")
    # every answer's turn ends with <|im_end|>, but the truncated one, cut inside its answer
    stop = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert said["stop token"].startswith(f"'<|im_end|>' (id {stop}) ends 6 of 7 trained turns")


def test_a_dropped_overlong_record_is_counted_by_its_reason(tmp_path, chat_tokenizer):
    planted = [chat("q", answer(1)), chat("long", answer(9, 120))]
    seen = Seen()
    chat_blocks(ChatDataConfig(path=records(tmp_path, planted), seq_len=64, val_fraction=0, overlong="drop"),
                chat_tokenizer, 0, seen)
    assert seen.stats.why == {"longer than data.seq_len (data.overlong=drop)": 1}


@pytest.mark.parametrize("blocks_of", [chat_blocks, preference_blocks])
def test_what_is_seen_leaves_the_blocks_as_they_were(blocks_of, chat_tokenizer):
    cfg = ChatDataConfig(seq_len=128, val_fraction=0.2, overlong="truncate")
    plain, told = blocks_of(cfg, chat_tokenizer, 3), blocks_of(cfg, chat_tokenizer, 3, Seen())
    for a, b in zip(plain[:2], told[:2], strict=True):
        assert a.with_format("arrow")[:].equals(b.with_format("arrow")[:])
    assert plain[2] == told[2]


def test_preview_calls_the_recipes_preview_and_nothing_else(monkeypatch):
    called = []

    class Recipe:
        def __init__(self, cfg):
            self.cfg = cfg

        def preview(self, n):
            called.append(n)

        def setup(self):
            called.append("setup")

    monkeypatch.delenv("RANK", raising=False)
    tiny = str(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml")
    assert run("pretrain", PretrainConfig, Recipe, ["--config", tiny, "--preview=2"]) == 0
    assert called == [2]


@pytest.mark.parametrize("recipe, config, shows", [
    ("finetune", "finetune_smollm2_chat_lora", "'<|im_end|>' (id 2) ends"),
    ("pretrain", "pretrain_tiny", "the EOS after each document")])
def test_a_shipped_config_previews_in_seconds_and_writes_no_run(recipe, config, shows, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    module = recipe_module(recipe)
    out = tmp_path / "run"
    config_class = {"finetune": FinetuneConfig, "pretrain": PretrainConfig}[recipe]
    start = time.monotonic()
    code = run(recipe, config_class, getattr(module, f"{recipe.capitalize()}Recipe"),
               ["--config", str(ROOT / "recipes" / "configs" / f"{config}.yaml"), "--preview", "2",
                f"output_dir={out}"])
    printed = capsys.readouterr().out
    assert code == 0 and time.monotonic() - start < 60
    assert printed.count("--- block ") == 2 and "[[" in printed and shows in printed
    assert "\ntokens with loss" in printed and not out.exists()


def test_a_template_training_refuses_is_said_above_the_data_that_shows_why(tmp_path, capsys, monkeypatch):
    """Training refuses a template whose answers end with no stop token; the preview shows the data anyway, under the
    refusal's line, so that the user sees the answers' marks end with no stop."""
    monkeypatch.delenv("RANK", raising=False)
    module = recipe_module("finetune")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    code = run("finetune", FinetuneConfig, module.FinetuneRecipe,
               ["--config", str(ROOT / "recipes" / "configs" / "finetune_smollm2_chat_lora.yaml"), "--preview", "1",
                f"data.chat_template={template}", f"output_dir={tmp_path / 'run'}"])
    printed = capsys.readouterr().out
    assert code == 0 and printed.count("--- block ") == 1
    warning = next(line for line in printed.splitlines() if line.startswith("warning: training refuses"))
    assert "data.append_stop=true" in warning and printed.index(warning) < printed.index("--- block ")


def test_a_preview_piped_into_head_ends_quietly(tmp_path, capsys, monkeypatch):
    """`--preview 500 | head`: the reader leaves and print meets a closed pipe; BrokenPipeError is a ConnectionError,
    which was said as "a collective ... failed because another rank stopped" (exit code 4)."""
    monkeypatch.delenv("RANK", raising=False)
    module = recipe_module("finetune")

    def closed(self, n):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(module.FinetuneRecipe, "preview", closed)
    code = run("finetune", FinetuneConfig, module.FinetuneRecipe,
               ["--config", str(ROOT / "recipes" / "configs" / "finetune_smollm2_chat_lora.yaml"), "--preview", "3",
                f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 141 and "error" not in err and "Traceback" not in err, err


def test_a_template_that_renders_nothing_is_its_one_line_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }")
    code = run("finetune", FinetuneConfig, recipe_module("finetune").FinetuneRecipe,
               ["--config", str(ROOT / "recipes" / "configs" / "finetune_smollm2_chat_lora.yaml"), "--preview", "1",
                f"data.chat_template={template}", f"output_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2 and "warning" not in out and "--- block" not in out
    assert err.startswith(f"error: data.chat_template={template} does not parse")
    assert err.count("\n") == 1
