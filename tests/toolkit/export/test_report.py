"""The export report: held-out blocks, perplexity measured the same way for source and export, speed,
size on disk, and the markdown a user reads."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from toolkit.data.corpus import DataConfig, load_corpus, split_documents
from toolkit.export.report import (
    EVAL_BLOCK,
    EVAL_TOKENS,
    ExportReport,
    held_out_ids,
    perplexity,
    size_on_disk,
    tokens_per_second,
)


@pytest.fixture(scope="module")
def model(tiny_model, tiny_tokenizer):
    return tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=0.2)


# held_out_ids


def test_held_out_ids_of_a_text(tiny_tokenizer, tiny_texts):
    text = "\n\n".join(tiny_texts[:40])
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    blocks = held_out_ids(tiny_tokenizer, text)
    assert blocks.shape == (EVAL_TOKENS // EVAL_BLOCK, EVAL_BLOCK) and blocks.dtype == torch.long
    assert blocks.flatten().tolist() == ids[:EVAL_TOKENS]  # the first tokens, in order


def test_held_out_ids_keeps_only_whole_blocks(tiny_tokenizer, tiny_texts):
    text = "\n\n".join(tiny_texts[:40])
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    blocks = held_out_ids(tiny_tokenizer, text, n_tokens=EVAL_BLOCK * 2 + 100)
    assert blocks.shape == (2, EVAL_BLOCK)
    assert blocks.flatten().tolist() == ids[: 2 * EVAL_BLOCK]


def test_held_out_ids_of_too_little_text(tiny_tokenizer):
    n = len(tiny_tokenizer("a short text", add_special_tokens=False)["input_ids"])
    with pytest.raises(
        ValueError, match=rf"the held-out text has {n} tokens; it needs at least {EVAL_BLOCK}"
    ):
        held_out_ids(tiny_tokenizer, "a short text")


def test_the_default_text_is_the_default_corpus_held_out_split(tiny_tokenizer):
    corpus, _ = load_corpus(DataConfig())
    train, val = split_documents(corpus, DataConfig().val_fraction, 1234)
    blocks = held_out_ids(tiny_tokenizer)
    assert blocks.shape == (EVAL_TOKENS // EVAL_BLOCK, EVAL_BLOCK)
    assert torch.equal(blocks, held_out_ids(tiny_tokenizer, "\n\n".join(val["text"])))
    assert torch.equal(blocks, held_out_ids(tiny_tokenizer))  # the same every time
    # and it is not the start of the training documents
    assert not torch.equal(blocks, held_out_ids(tiny_tokenizer, "\n\n".join(train["text"])))


# perplexity


def hand_perplexity(model, blocks: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=blocks).logits.double()
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(2, blocks[:, 1:, None]).squeeze(-1)
    return math.exp(nll.mean().item())


def test_perplexity_is_exp_of_the_mean_next_token_loss(model, tiny_tokenizer, tiny_texts):
    blocks = held_out_ids(tiny_tokenizer, "\n\n".join(tiny_texts[:40]), n_tokens=3 * EVAL_BLOCK)
    model.train()
    ppl = perplexity(model, blocks, batch=2)  # 2 + 1 blocks: an uneven last batch
    assert not model.training
    assert ppl == pytest.approx(hand_perplexity(model, blocks), rel=1e-5)
    assert ppl == pytest.approx(perplexity(model, blocks, batch=3), rel=1e-6)
    assert 1 < ppl < 10 * 300  # a random model, but not absurd for a 300-token vocabulary


def test_perplexity_tells_an_export_from_its_source(model, tiny_tokenizer, tiny_texts):
    blocks = held_out_ids(tiny_tokenizer, "\n\n".join(tiny_texts[:40]), n_tokens=2 * EVAL_BLOCK)
    source = perplexity(model, blocks)
    same = copy.deepcopy(model)
    assert perplexity(same, blocks) == source
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # what a bf16 export loses
    changed = perplexity(rounded, blocks)
    assert changed != source and changed == pytest.approx(source, rel=0.05)


# speed and size


def test_tokens_per_second_is_positive(model, tiny_tokenizer):
    speed = tokens_per_second(model, tiny_tokenizer, new_tokens=8)
    assert math.isfinite(speed) and speed > 0
    assert not model.training


def test_size_on_disk_of_a_file_and_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 234)
    assert size_on_disk(tmp_path / "a.bin") == 1000
    assert size_on_disk(tmp_path) == 1234


# ExportReport


def report(**kwargs) -> ExportReport:
    values = dict(
        output=Path("exports/tiny-q8"),
        fmt="int8",
        source="runs/tiny/final",
        size_bytes=2_500_000,
        source_ppl=20.0,
        export_ppl=20.5,
        tokens_per_s=123.45,
        notes=[],
    )
    return ExportReport(**{**values, **kwargs})


def test_ppl_change():
    assert report().ppl_change == pytest.approx(0.025)
    assert report(export_ppl=19.0).ppl_change == pytest.approx(-0.05)
    assert report(export_ppl=20.0).ppl_change == 0


def test_markdown_names_every_figure():
    md = report().markdown()
    assert md.startswith("# Export report: tiny-q8\n")
    for line in (
        "| format | int8 |",
        "| source | runs/tiny/final |",
        "| size on disk | 2.50 MB |",
        "| perplexity on the CPython docs' held-out documents: the source, fp32 | 20.0000 |",
        "| perplexity on the CPython docs' held-out documents: the export | 20.5000 |",
        "| change | +2.500% |",
        "| generation speed here (transformers, CPU) | 123.5 tokens/s |",
    ):
        assert line + "\n" in md, line
    assert (f"Perplexity on the first {EVAL_TOKENS} tokens of the CPython docs' held-out documents, in blocks of "
            f"{EVAL_BLOCK}: the source and the export on the same tokens;") in md
    assert "at training time" not in md


def test_each_figure_says_what_it_measured_beside_the_runs_own():
    """Training's held-out perplexity and the export's are two measurements of two texts: both shown, each named;
    a GGUF's speed is transformers on its dequantised weights, not llama.cpp's."""
    md = report(fmt="gguf q8_0", trained_ppl=13.79, text="--eval-text notes.txt").markdown()
    assert "| perplexity on --eval-text notes.txt: the export | 20.5000 |" in md
    assert "| held-out perplexity at training time (the run's own held-out blocks) | 13.7900 |" in md
    assert "which are not the run's own held-out blocks" in md
    assert "| generation speed here (transformers on the GGUF's weights, dequantised, CPU) | 123.5 tokens/s |" in md
    assert "## Notes" not in md
    assert md.endswith("\n") and not md.endswith("\n\n")


def test_markdown_lists_the_notes():
    md = report(notes=["lm_head kept in bf16", "tied embeddings"], export_ppl=19.0).markdown()
    assert "| change | -5.000% |" in md
    assert md.endswith("## Notes\n\n- lm_head kept in bf16\n- tied embeddings\n")
