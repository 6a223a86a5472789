"""Tensor parallelism's model side (toolkit.strategy.tensor_parallel): what cannot be split is refused
in one line (a mixture of experts' too, whose experts spread whole over the tp ranks), and a tiny
LLaMA split over 2 CPU processes (gloo) gives the whole model's loss, gradient norm and next loss
after an AdamW step, its tied embedding and head still one weight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launching
import pytest
from transformers import AutoConfig

from toolkit.config import UserError
from toolkit.strategy.tensor_parallel import expert_parallel, problems, split

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


def test_a_mixture_of_experts_spreads_its_experts_over_the_tp_ranks_if_they_divide():
    moe = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    for model_type, experts in (("qwen3_moe", "num_experts"), ("qwen2_moe", "num_experts"),
                                ("mixtral", "num_local_experts")):
        config = AutoConfig.for_model(model_type, **moe, **{experts: 4})
        assert problems(config, 2) == [] and expert_parallel(config, 2) == 2, model_type
    assert expert_parallel(AutoConfig.for_model("llama"), 2) == 1
    assert problems(AutoConfig.for_model("qwen3_moe", **moe, num_experts=3), 2) == [
        "model.config.num_experts=3 is not divisible by tp=2: each rank must hold whole experts (expert parallel "
        "over the tp ranks); use a number of experts divisible by 2, or fsdp.yaml / the zero configs"
    ]
    # LLaMA-4 has a tensor-parallel plan but no expert-parallel one
    assert problems(AutoConfig.for_model("llama4_text", **moe), 2) == [
        "model_type=llama4_text is a mixture of experts with no expert-parallel plan in transformers; use a "
        "Qwen2-MoE, Qwen3-MoE or Mixtral model, or fsdp.yaml / the zero configs"
    ]


def test_a_lora_adapter_under_tensor_parallel_is_refused_before_the_split(tiny_model):
    from peft import LoraConfig, get_peft_model

    from toolkit.strategy.distributed import Strategy

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    strategy = Strategy(accelerator=None, world_size=2, accumulation=1, ds_owned=(), tp=2)
    with pytest.raises(UserError, match="tensor parallel trains a whole model, not a LoRA adapter, yet; use fsdp.yaml"):
        strategy.apply_model_parallel(model, 64, "sdpa")


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
