"""Tensor parallelism's model side (toolkit.strategy.tensor_parallel): what cannot be split is refused
in one line (a mixture of experts' too, whose experts spread whole over the tp ranks), and a tiny
LLaMA split over 2 CPU processes (gloo) gives the whole model's loss, gradient norm and next loss
after an AdamW step, its tied embedding and head still one weight."""

from __future__ import annotations

import json

import probe_ranks
import pytest
from transformers import AutoConfig

from toolkit.config.errors import UserError
from toolkit.strategy.tensor_parallel import expert_parallel, problems, split


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


def test_split_refuses_before_touching_the_model(tiny_model):
    model = tiny_model("gpt2")
    with pytest.raises(UserError, match="model_type=gpt2 has no tensor-parallel plan"):
        split(model, 2)
    assert split(model, 1) is model


def probe(tmp_path, model_type: str, attention: str) -> dict:
    out = tmp_path / f"{model_type}-{attention}.json"
    proc = probe_ranks.run(probe_ranks.SUPPORT / "tensor_parallel_probe.py", [out, model_type, attention], nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(out.read_text())


def assert_whole_models_numbers(result: dict) -> None:
    """Loss, gradients, gradient norm and the loss after a step of the whole model, within what fp32
    summed in another order allows (u = 2^-24; the split sums the same terms in another order).

    - loss: the probe's LOSS_REL (1e-6), from its 120 token cross-entropies over a 4096 vocabulary.
    - gradients: each element is off by ~u sqrt(K) of its row's rms, K = 4096 the longest reduction
      behind it (the vocabulary): 4e-6 of a gradient's norm, x 2 for two computations -> 1e-5.
    - exact_grad_norm (float64 norm of the gathered fp32 gradients): independent element errors
      move it by 1e-5 / sqrt(N), N ~ 10^6 elements; if each row's go one way (they share its
      upstream activations), N counts the ~250 rows: 6e-7 -> 1e-6.
    - grad_norm (torch's fp32 norm, as clipping takes it): one fp32 sum of N = 4096 x 128 squares
      in another order, u sqrt(N) = 4e-5, x 2 computations -> 1e-4.
    - the AdamW step: ~lr sign(g) on each weight, so a gradient whose sign is within its rounding
      (the probe's unsure) may step the other way; every other weight steps as in the whole model.
    - loss_after_step: each such flipped step moves it by 2 lr |dL/dw|, summed in after_step_bound
      (measured: on AVX-512 one flipped weight of Qwen3's layer-0 v_proj moves it 0.024 of 0.055)."""
    assert result["loss"][1] == pytest.approx(result["loss"][0], rel=result["loss_rel"])
    assert result["exact_grad_norm"][1] == pytest.approx(result["exact_grad_norm"][0], rel=1e-6)
    assert result["grad_norm"][1] == pytest.approx(result["grad_norm"][0], rel=1e-4)
    assert result["worst_grad_rel"] < 1e-5
    assert result["steps_apart"] == 0
    after = result["loss_after_step"]
    assert abs(after[1] - after[0]) <= result["after_step_bound"], (after, result["after_step_bound"])


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_split_model_with_sequence_parallel_trains_like_the_whole_one(tmp_path, model_type):
    """Megatron's layout: a norm sees half of every sequence on each of 2 ranks, every weight is cut
    or replicated as a DTensor, and the packed batch's loss, gradients (Qwen3's whole per-head norms
    summed over the ranks) and next loss are the whole model's."""
    result = probe(tmp_path, model_type, "sdpa")
    assert result["sequence_parallel"] and result["kinds"] == ["DTensor"]
    assert result["norm_input"] == [[2, 64, 128], [2, 32, 128]]
    assert result["tied"] == (model_type == "llama"), "the tied embedding and output head were left apart"
    assert_whole_models_numbers(result)


@pytest.mark.distributed
def test_attention_that_builds_its_own_mask_keeps_the_plan_without_sequence_parallel(tmp_path):
    result = probe(tmp_path, "llama", "flex_attention")
    assert not result["sequence_parallel"] and result["norm_input"] == [[2, 64, 128], [2, 64, 128]]
    assert result["tied"]
    assert_whole_models_numbers(result)


def test_the_sequence_layout_follows_the_model(tiny_model):
    from toolkit.strategy.tensor_parallel import sequence_layout

    layout, why = sequence_layout(tiny_model("llama"), "sdpa")
    assert why is None
    styles = {name: type(style).__name__ for name, style in layout.items()}
    assert styles["model.embed_tokens"] == "RowwiseParallel" and styles["lm_head"] == "ColwiseParallel"
    assert styles["model.layers.0.input_layernorm"] == styles["model.norm"] == "SequenceParallel"
    assert styles["model.layers.0.self_attn"] == styles["model.layers.0.mlp"] == "PrepareModuleInput"
    assert styles["model.layers.0.self_attn.o_proj"] == "RowwiseParallel"
    assert sequence_layout(tiny_model("llama"), "flex_attention") == (
        {}, "attention flex_attention builds its mask from the sequence it is handed")
