"""A mixture-of-experts model's router loss (toolkit.models.router) on real transformers MoE models:
the same number transformers computes, with the toolkit's packed 4-D masks too, and a gradient
that reaches the routers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.config.errors import UserError
from toolkit.data.packing import attention_inputs
from toolkit.models.router import RouterLoss

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, router_aux_loss_coef=0.02)
MOE = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def moe_model(model_type: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES, **MOE[model_type]))


def test_a_dense_model_has_no_router_loss(tiny_model):
    assert RouterLoss.of(tiny_model("llama")) is None


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_the_recorded_router_loss_is_the_one_transformers_computes(model_type):
    model = moe_model(model_type)
    router = RouterLoss.of(model)
    assert router.coef == 0.02 and router.num_experts == 4 and router.top_k == 2
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(input_ids=ids, use_cache=False, output_router_logits=True).aux_loss
    router.start()
    model(input_ids=ids, use_cache=False)
    assert router.loss() == expected  # the model's own function on the same logits: equal, not close
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # an evaluation forward: nothing recorded
    assert router._logits == []
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    router.close()
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks - SIZES["num_hidden_layers"]


def test_packed_blocks_with_a_block_causal_mask_get_a_router_loss_and_a_gradient():
    """transformers' own computation fails on the 4-D mask the toolkit packs sdpa batches with; the
    recorded one trains the routers."""
    model = moe_model("qwen3_moe")
    router = RouterLoss.of(model)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4]])
    batch = attention_inputs({"input_ids": torch.arange(16).reshape(2, 8), "position_ids": positions,
                              "labels": torch.arange(16).reshape(2, 8)}, "sdpa")
    assert batch["attention_mask"].dim() == 4
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(RuntimeError, match="must match the size"):
        model(**inputs, use_cache=False, output_router_logits=True)
    router.start()
    model(**inputs, use_cache=False)
    loss = router.loss()
    assert torch.isfinite(loss) and loss > 0
    (router.coef * loss).backward()
    gates = [p for name, p in model.named_parameters() if "gate" in name and "proj" not in name]
    assert gates and all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates)


def test_a_forward_without_routers_is_an_error_not_a_zero():
    model = moe_model("mixtral")
    router = RouterLoss.of(model)
    router.start()
    with pytest.raises(RuntimeError, match="no MixtralTopKRouter ran in the forward"):
        router.loss()


def test_a_moe_config_without_a_loss_transformers_gives_is_refused(tiny_model):
    model = tiny_model("llama")
    model.config.output_router_logits = False  # a config that says it routes, on a model with no router
    with pytest.raises(UserError, match="has routers, but transformers gives no router load-balancing loss"):
        RouterLoss.of(model)
