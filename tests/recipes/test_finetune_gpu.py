"""QLoRA of the real SmolLM2 on a CUDA GPU: a 4-bit NF4 base with a LoRA adapter on top, in bf16.

Skipped without a GPU (this file is what `pytest -m gpu` runs on a GPU machine); QLoRA on the CPU,
one process and FSDP2, is tests/recipes/test_finetune_qlora.py.
"""

from __future__ import annotations

import pytest
import torch
from recipe_runner import run_recipe
from transformers import AutoModelForCausalLM

from toolkit.training.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA needs a CUDA GPU"),
]


def test_qlora_trains_on_a_4bit_base_and_merges(tmp_path, data_cache, smollm2_gguf_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install -e '.[qlora]'")
    out = tmp_path / "qlora"
    proc = run_recipe(
        "finetune",
        ["train.max_steps=6", "logging.trackers=[]", "samples.max_new_tokens=16", "checkpoint.every=0", f"output_dir={out}"],
        nproc=1, cache=data_cache, config="finetune_smollm2_qlora.yaml", launcher=True,
    )
    log = proc.stdout + proc.stderr
    assert "quantised by BitsAndBytesConfig" in log and "weights: qlora" in log
    phases = {r["phase"]: r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "phase" in r}
    assert phases["after"] < phases["before"], phases
    merged = AutoModelForCausalLM.from_pretrained(out / "final")  # full precision base + adapter
    assert all(p.is_floating_point() for p in merged.parameters())
    assert (out / "samples.md").is_file()


def test_dpo_on_a_4bit_base_scores_its_reference_with_the_adapter_off(tmp_path, data_cache, smollm2_gguf_path):
    """The shipped DPO YAML with QLoRA's 4-bit base: the reference pass runs through the quantised base with the
    adapter off, the first step's rewards are exactly 0, and the held-out margin moves."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install -e '.[qlora]'")
    out = tmp_path / "qlora-dpo"
    proc = run_recipe(
        "finetune",
        ["adapter.method=qlora", "train.max_steps=6", "eval.every=0", "logging.trackers=[]", "samples.max_new_tokens=0",
         "checkpoint.every=0", f"output_dir={out}"],
        nproc=1, cache=data_cache, config="finetune_smollm2_dpo_lora.yaml", launcher=True,
    )
    log = proc.stdout + proc.stderr
    assert "weights: qlora" in log and "reference: one forward pass over the pairs with the adapter off" in log
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert steps[0]["rewards/margin"] == 0 and steps[-1]["rewards/margin"] > 0
    phases = {r["phase"]: r for r in rows if "phase" in r}
    assert phases["before"]["eval_rewards/margin"] == 0 and phases["after"]["eval_rewards/margin"] != 0
