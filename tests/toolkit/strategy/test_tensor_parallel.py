"""Tensor parallelism's model side (toolkit.strategy.tensor_parallel): what cannot be split is refused
in one line, and a tiny LLaMA split over 2 CPU processes (gloo) gives the whole model's loss,
gradient norm and next loss after an AdamW step, its tied embedding and head still one weight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launching
import pytest
from transformers import AutoConfig

from toolkit.config import UserError
from toolkit.strategy.tensor_parallel import problems, split

ROOT = Path(__file__).resolve().parents[3]


def test_models_with_a_plan_and_divisible_sizes_split():
    for model_type in ("llama", "qwen2", "mistral"):
        config = AutoConfig.for_model(model_type, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
        assert problems(config, 2) == [], model_type
    assert problems(AutoConfig.for_model("gpt2"), 1) == []  # tp=1 splits nothing


def test_what_cannot_be_split_is_named():
    config = AutoConfig.for_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                   intermediate_size=126)
    assert problems(config, 4) == [
        "model.config.num_attention_heads=6 is not divisible by tp=4: each rank must hold whole heads; pick a tp "
        "that divides it",
        "model.config.num_key_value_heads=2 is not divisible by tp=4: each rank must hold whole heads; pick a tp "
        "that divides it",
        "model.config.intermediate_size=126 is not divisible by tp=4: each rank must hold whole columns; pick a tp "
        "that divides it",
    ]
    assert problems(AutoConfig.for_model("gpt2", n_head=4), 2) == [
        "model_type=gpt2 has no tensor-parallel plan in transformers; use a LLaMA, Qwen2/3 or Mistral model, or "
        "FSDP2/ZeRO-3 to shard it"
    ]
    assert problems(config, 0) == ["tp=0 must be at least 1"]


def test_split_refuses_before_touching_the_model(tiny_model):
    model = tiny_model("gpt2")
    with pytest.raises(UserError, match="model_type=gpt2 has no tensor-parallel plan"):
        split(model, 2)
    assert split(model, 1) is model


@pytest.mark.distributed
def test_a_split_llama_trains_like_the_whole_one_on_two_processes(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(launching.free_port()), str(Path(__file__).with_name("tensor_parallel_probe.py")),
           str(out)]
    proc = launching.run(cmd, 300, cwd=ROOT, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["tp"] == 2 and result["q_local_rows"] == 32  # 4 heads x 16 -> 2 heads per rank
    assert "DTensor" in result["split"]["kinds"]
    assert result["tied"], "the tied embedding and output head were left apart"
    for key in ("loss", "grad_norm", "loss_after_step"):
        assert result["split"][key] == pytest.approx(result["whole"][key], rel=1e-5), key
