"""bench/finetune_throughput.py's transformers.Trainer row on CPU: a LoRA of the shipped YAML's settings on a saved
tiny base, timed after its warm-up (the recipe rows are launches: `python bench/finetune_throughput.py --smoke`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import finetune_throughput as bench  # noqa: E402


def test_the_trainer_row_fine_tunes_the_base_with_the_shipped_lora_and_times_its_steps(tmp_path, tiny_model,
                                                                                        tiny_tokenizer):
    base = tmp_path / "base"
    tiny_model("llama", seed=0, tokenizer=tiny_tokenizer).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    spec = {"yaml": "finetune_smollm2_lora.yaml", "base": str(base), "seq_len": 32, "batch": 2, "warmup": 1, "steps": 2,
            "work": str(tmp_path / "trainer")}
    result = bench.trainer_worker(spec)
    assert result["tokens_per_s"] > 0 and result["peak_gib"] > 0 and result["blocks"] > 1000  # the docs in blocks of 32
    # r=16 x (in + out) on the 7 projections of 2 layers (hidden 64, keys and values 32, MLP 128), nothing else
    assert result["trainable"] == 2 * 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
