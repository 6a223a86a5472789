"""A real fine-tune of a real pretrained model: LoRA on SmolLM2-135M-Instruct, in this process.

The recipe class is driven in-process (one process, as `python recipes/finetune.py` runs it) so
that the live model at the end of training can be compared with what was written: the adapter
reloaded onto the base, and the merged final/ model.
"""

from __future__ import annotations

import json
import os
import shutil
from pydoc_data.topics import topics

import pytest
import torch
from harness_tasks import write_tasks
from recipe_runner import ROOT, assert_generates_with_the_cache, recipe_module
from transformers import AutoModelForCausalLM

from toolkit.config.load import load_config
from toolkit.models.adapter import load_with_adapter
from toolkit.models.base_model import load_base_model
from toolkit.training.metrics import read_metrics
from toolkit.training.recipe_config import FinetuneConfig

HELD_OUT_TOPICS = ("with", "try", "lambda")
SMOL_LORA = [  # continued pretraining on the CPython docs: a few steps of 4 x 64 tokens
    "data.seq_len=64",
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "optim.lr=2e-3",
    "optim.warmup_steps=0",
    "adapter.r=8",
    "logging.every=1",
    "eval.blocks=8",
    "logging.trackers=[]",
    "checkpoint.every=0",
    "samples.prompts=[The with statement]",
    "samples.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory, smollm2_gguf_path):
    out = tmp_path_factory.mktemp("smol-lora") / "run"
    held_out = out.parent / "held_out.jsonl"  # data.val_path: the user's own held-out text, in place of val_fraction
    held_out.write_text("".join(json.dumps({"text": topics[name]}) + "\n" for name in HELD_OUT_TOPICS))
    write_tasks(out.parent / "tasks")
    harness = ["eval.harness_tasks=[pydoc_continuation]", f"eval.harness_include_path={out.parent / 'tasks'}",
               "eval.harness_limit=4"]  # the base and the result scored at the end
    # a cache of its own, which a test moves away: the adapter's base must not live in it
    cfg = load_config(FinetuneConfig, ROOT / "recipes" / "configs" / "finetune_smollm2_lora.yaml",
                      [*SMOL_LORA, f"output_dir={out}", f"data.val_path={held_out}", *harness,
                       f"model.cache_dir={out.parent / 'cache'}"])
    recipe = recipe_module("finetune").FinetuneRecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    trainer = recipe.trainer
    batch = trainer.feed.collate(trainer.feed.val.with_format("numpy")[:2], "sdpa")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    live = trainer.accelerator.unwrap_model(trainer.model).eval()
    with torch.no_grad():
        live_logits = live(**inputs).logits
    yield out, recipe, inputs, live_logits
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_lora_steps_lower_the_held_out_loss(smol_run):
    out, recipe, _, _ = smol_run
    phases = {r["phase"]: r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"}
    assert phases["after"] < phases["before"] - 0.01, phases
    assert recipe.trainer.state.eval_before["eval_loss"] == phases["before"]
    # held out: data.val_path's documents, whole (the first of them opens the first block), the corpus all trained on
    val = recipe.trainer.feed.val
    first = recipe.tokenizer.decode(val[0]["input_ids"][:40])
    assert topics[HELD_OUT_TOPICS[0]].startswith(first.strip()[:60]), first


def test_the_harness_scores_the_base_and_the_result_into_the_before_after_table(smol_run):
    """eval.harness_tasks: two rows of metrics.jsonl, the base's at step 0, and the table's harness rows; the result
    is final/, scored as recipes/evaluate.py scores it."""
    out, recipe, _, _ = smol_run
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "harness"]
    assert [(r["step"], r["phase"]) for r in rows] == [(0, "before"), (2, "after")]
    assert all(0 <= r["harness/pydoc_continuation/acc"] <= 1 for r in rows)
    phases = {r["phase"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"}
    recipe = recipe_module("finetune")
    table = recipe._table(recipe._before_after({**phases["before"], **rows[0]}, {**phases["after"], **rows[1]})).splitlines()
    assert table[0].split() == ["held-out", "before", "after"] and table[4].split() == ["harness", "before", "after"]
    assert table[6].split() == ["pydoc_continuation/acc", f"{rows[0]['harness/pydoc_continuation/acc']:.4f}",
                                f"{rows[1]['harness/pydoc_continuation/acc']:.4f}"]
    timed = read_metrics(out / "metrics.jsonl")[-1]["seconds"]  # what the scoring cost, the end summary's too
    assert timed["harness"] > 0 and list(timed)[-2:] == ["merge and reload", "harness"]


def test_a_scoring_that_fails_after_training_is_a_warning(smol_run, monkeypatch, capsys):
    """The run's files are written by then: a harness that fails (out of memory, say) is one warning, no table rows."""
    out, recipe, _, _ = smol_run

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setitem(type(recipe).harness_scores.__globals__, "score", out_of_memory)  # the recipe's module
    assert recipe.harness_scores(out / "final") == ({}, {})
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[finetune] warning: the harness could not score the base (RuntimeError: CUDA out of memory. Tried to allocate "
        "2.00 GiB); the run's files are written, score them with recipes/evaluate.py")


def test_adapter_reloads_onto_the_base_with_the_same_logits(smol_run):
    out, recipe, inputs, live_logits = smol_run
    base, _, _ = load_base_model(recipe.cfg.model)
    reloaded = load_with_adapter(base, out / "adapter")
    with torch.no_grad():
        logits = reloaded(**inputs).logits
    torch.testing.assert_close(logits, live_logits, atol=1e-5, rtol=0)


def test_merged_model_equals_base_plus_adapter(smol_run):
    out, _, inputs, live_logits = smol_run
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        logits = merged(**inputs).logits
    # W + BA in fp32 sums in another order than x W + (x A) B: up to 1.1e-4 apart on these logits (CPython text, 30
    # layers); a merge of the wrong model is whole units apart (issue 44: a loss of 9.45 against 7.88)
    torch.testing.assert_close(logits, live_logits, atol=2e-4, rtol=0)


def test_samples_before_and_after_are_written(smol_run):
    out, _, _, _ = smol_run
    text = (out / "samples.md").read_text()
    assert "## 1. The with statement" in text and "**before**" in text and "**after**" in text
    card = (out / "final" / "README.md").read_text()
    assert "fine-tuned from" in card and "lora" in card


def test_the_adapter_loads_by_itself_with_peft_and_has_a_card(smol_run, capsys):
    """adapter_config.json names a base transformers loads alone: the run's own float copy of the GGUF (base/, linked
    from the cache, not the GGUF's folder nor the cache itself), so peft's own loader takes the folder on a machine
    whose cache was cleared or moved, and --from RUN --base names it; its README.md is the run's card, not peft's
    template, and publishes no path of the machine that trained it."""
    import json

    from peft import AutoPeftModelForCausalLM

    from toolkit.export.consolidate import load_model, resolve_source
    from toolkit.export.run_base import run_base

    out, recipe, inputs, live_logits = smol_run
    named = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((out / "base").resolve()), named
    assert json.loads((out / "adapter" / "base_model.json").read_text())["loads_from"] == named
    assert run_base(out) == str(out / "base")
    cache = out.parent / "cache"
    assert (out / "base" / "model.safetensors").stat().st_nlink == 2  # linked, not copied, from the cache's copy
    for folder in (named, out / "final"):  # the adapter's base generates with the KV cache, as final/ does
        assert_generates_with_the_cache(folder)
    moved = cache.rename(out.parent / "cache-moved-away")
    try:
        loaded = AutoPeftModelForCausalLM.from_pretrained(out / "adapter").eval()
        merged, _, _ = load_model(resolve_source(out / "adapter"), merge_lora=True)  # export --merge-lora
        with torch.no_grad():
            torch.testing.assert_close(loaded(**inputs).logits, live_logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(merged(**inputs).logits, live_logits, atol=2e-4, rtol=0)
        chat = recipe_module("chat")  # the README's `--from runs/ft --base`: the base the run started from
        assert chat.main(["--from", str(out), "--base", "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
        assert f"[chat] source: Hugging Face model folder {out / 'base'}" in capsys.readouterr().err
        # the run folder moved too: the toolkit's merge finds base/ beside adapter/ (peft's loader reads the old path)
        shutil.copytree(out, out.parent / "run-moved", copy_function=os.link)
        (out / "base").rename(out.parent / "base-away")
        again, _, _ = load_model(resolve_source(out.parent / "run-moved" / "adapter"), merge_lora=True)
        with torch.no_grad():
            torch.testing.assert_close(again(**inputs).logits, live_logits, atol=2e-4, rtol=0)
        assert not cache.exists()  # not the GGUF parsed again into a cache the user cleared
    finally:
        moved.rename(cache)
        if (out.parent / "base-away").exists():
            (out.parent / "base-away").rename(out / "base")
        shutil.rmtree(out.parent / "run-moved", ignore_errors=True)
    card = (out / "adapter" / "README.md").read_text()
    assert "More Information Needed" not in card
    assert "AutoPeftModelForCausalLM.from_pretrained" in card
    assert "base_model:" not in card and str(cache) not in card and named not in card  # a GGUF base has no hub id
    assert "`base/` beside this folder: SmolLM2-135M-Instruct.Q4_1.gguf dequantised" in card
    assert "| steps | 2 |" in card and "rank 8" in card and "--merge-lora" in card
