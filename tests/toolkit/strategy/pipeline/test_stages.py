"""Pipeline parallelism (toolkit.strategy.pipeline.stages): how layers are cut into stages, what
cannot be cut named in one line, and a tiny LLaMA on packed rows cut into 2 or 3 stages (and 2
replicas x 2 stages) trained one step by torch's 1F1B schedule, giving the whole model's loss, every
weight's gradient, the clipped norm and the next loss (CPU gloo)."""

from __future__ import annotations

import json

import probe_ranks
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.strategy.pipeline.stages import StageModel, layer_ranges, problems


def tiny(model_type: str = "llama", **extra) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=2, **extra)
    return AutoModelForCausalLM.from_config(config)


def test_layers_are_cut_into_consecutive_stages_as_even_as_they_divide():
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert layer_ranges(2, 2) == [range(0, 1), range(1, 2)]


def test_a_stage_holds_its_layers_under_their_whole_model_names():
    model = tiny()
    names = set(dict(model.named_parameters()))
    held = []
    for index in range(3):
        torch.manual_seed(0)
        stage = StageModel(tiny(), index, 3, "sdpa")
        held += [stage.whole_name(n) for n, _ in stage.named_parameters()]
    assert sorted(held) == sorted(names)  # every weight once (untied), each where it belongs
    last = StageModel(tiny(), 2, 3, "sdpa")
    assert last.whole_name("model.model.layers.0.mlp.up_proj.weight") == "model.layers.4.mlp.up_proj.weight"
    decoder = last.model.get_decoder()
    assert decoder.config.num_hidden_layers == 1 and decoder.embed_tokens is None
    assert last.model.config.num_hidden_layers == 5  # the whole model's config, for what is saved


def test_what_cannot_be_cut_is_named():
    assert problems(tiny(), 1) == [] and problems(tiny(), 5) == []
    assert problems(tiny(), 6) == ["model.config.num_hidden_layers=5 cannot fill 6 pipeline stages; use at most 5 stages"]
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    assert "model_type=gpt2 cannot be cut into pipeline stages" in problems(gpt2, 2)[0]
    moe = tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert "mixture of experts" in problems(moe, 2)[0]


def run_probe(tmp_path, processes: int, stages: int, tied: bool) -> dict:
    out = tmp_path / "result.json"
    proc = probe_ranks.run(probe_ranks.SUPPORT / "pipeline_parallel_probe.py", [out, stages, int(tied), "1.0"],
                           nproc=processes)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize(("processes", "stages", "tied"), [(2, 2, False), (3, 3, True), (4, 2, True)],
                         ids=["2-stages", "3-stages-tied", "2-replicas-x-2-stages-tied"])
def test_a_model_cut_into_stages_trains_like_the_whole_one(tmp_path, processes, stages, tied):
    result = run_probe(tmp_path, processes, stages, tied)
    assert result["names_held"] == result["names_whole"]  # every weight on some stage
    whole, pipeline = result["whole"], result["pipeline"]
    assert whole["grad_norm"] > 1.0, "the norm must exceed max_grad_norm=1, so that clipping is checked"
    # fp32 in another order (u = 2^-24; test_context_parallel.py's assert_same_numbers derives the loss's
    # and the gradients' 1e-5); the norm is of the same tensors in the same kernel, off by their gradients'
    # errors only. The loss after the AdamW step: within the steps of the weights whose gradient's sign is
    # within its rounding (adam_step.py); every other weight steps alike.
    for key in ("loss", "grad_norm"):
        assert pipeline[key] == pytest.approx(whole[key], rel=1e-5), key
    assert result["worst_grad_rel"] < 1e-5
    assert result["steps_apart"] == 0
    bound = result["after_step_bound"] + 1e-5 * whole["loss_after_step"]
    assert abs(pipeline["loss_after_step"] - whole["loss_after_step"]) <= bound, (pipeline, whole, bound)
