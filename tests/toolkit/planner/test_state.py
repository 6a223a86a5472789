"""The model state a rank holds (toolkit.planner.state) against the live tensors of real launches: every
strategy at 2 and 3 ranks (the strategy matrix's runs and the sharding probe, tests/conftest.py), a mixture of
experts, sequence parallel; and the shares each strategy's sharding gives at 8 ranks."""

from __future__ import annotations

import pytest
import torch
from planner_models import ROOT, STRATEGIES, llama_1b, probe_model
from transformers import AutoModelForCausalLM

from toolkit.planner.facts import Run, read_strategy
from toolkit.planner.state import model_tensors, state_bytes


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "nproc"), [
    # DDP replicates: 3 ranks hold what 2 do. ZeRO-1 partitions its optimizer state as ZeRO-2 does (one
    # DeepSpeed optimizer for both stages): zero2 at 3 checks the padding of an odd partition for both.
    (s, n) for s in STRATEGIES for n in (2, 3) if (s, n) not in {("ddp", 3), ("zero1", 3)}
])
def test_model_state_per_rank_equals_the_live_tensors(sharding_probe, matrix_sharding, strategy, nproc):
    # at 2 processes the strategy matrix's run (its tied-embedding LLaMA), at 3 the sharding probe's model
    measured = matrix_sharding(strategy) if nproc == 2 else sharding_probe(strategy, nproc)
    model = measured["model"] if nproc == 2 else probe_model()
    run = Run(read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", model.config.hidden_size), nproc, 2, 32,
              precision="fp32")
    estimated = state_bytes(model_tensors(model), run)
    for key in ("params", "grads", "optimizer", "master"):
        real = max(rank[key] for rank in measured["ranks"])
        assert estimated[key] == pytest.approx(real, rel=0.01, abs=8), f"{strategy}@{nproc} {key}: {estimated[key]} vs {real}"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_a_mixture_of_experts_model_state_per_rank_equals_the_live_tensors(sharding_probe, strategy):
    """The sharding probe's Qwen3-MoE (4 experts of 3-D weights, the router) at 2 ranks: FSDP2 shards each
    expert tensor by its first dimension (the experts), ZeRO flattens it, as any tensor."""
    from transformers import Qwen3MoeConfig

    measured = sharding_probe(strategy, 2, "qwen3_moe")
    sizes = {k: v for k, v in probe_model().config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**sizes, moe_intermediate_size=64, num_experts=4,
                                                                num_experts_per_tok=2, head_dim=32, use_cache=False))
    run = Run(read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", 128), 2, 2, 32, precision="fp32")
    estimated = state_bytes(model_tensors(model), run)
    assert measured["n_params"] == sum(p.numel() for p in model.parameters())
    for key in ("params", "grads", "optimizer", "master"):
        assert [rank[key] for rank in measured["ranks"]] == [estimated[key]] * 2, key


@pytest.mark.distributed
def test_sequence_parallel_model_state_is_zero3s_over_every_rank(sharding_probe):
    """zero3_sp.yaml as shipped (sp 2 x dp_shard 1), one step with the attention split by Ulysses: each
    rank holds ZeRO-3's partition over both ranks, the weights not split by sequence parallel."""
    measured = sharding_probe("zero3_sp", 2)
    run = Run(read_strategy(ROOT / "accelerate_configs/zero3_sp.yaml", 128), 2, 2, 32, precision="fp32")
    estimated = state_bytes(model_tensors(probe_model()), run)
    for key in ("params", "grads", "optimizer", "master"):
        assert [rank[key] for rank in measured["ranks"]] == [estimated[key]] * 2, key


def test_sharding_divides_what_a_rank_holds():
    """At 8 ranks ZeRO-3 and FSDP2 hold 1/8 of every part of their 1-rank layout; ZeRO-1 of the optimizer's only."""
    tensors = model_tensors(llama_1b())

    def held(strategy: str, world: int) -> dict[str, int]:
        facts = read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", 2048)
        return state_bytes(tensors, Run(facts, world, 8, 2048, precision="fp32"))

    for strategy in ("zero3", "fsdp"):
        one, eight = held(strategy, 1), held(strategy, 8)
        for key in ("params", "grads", "optimizer", "master"):
            assert eight[key] == pytest.approx(one[key] / 8, rel=0.01), f"{strategy} {key}"
    one, eight = held("zero1", 1), held("zero1", 8)
    assert eight["params"] == one["params"] and eight["optimizer"] == pytest.approx(one["optimizer"] / 8, rel=0.01)
