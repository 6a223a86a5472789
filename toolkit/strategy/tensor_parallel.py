"""Tensor parallelism: a causal LM's layers split over `tp` ranks by transformers' own plan.

The engine is transformers' distributed API (DistributedConfig, the model's `base_model_tp_plan`,
`prepare_distribute_model` + `maybe_distribute_model`): weights become DTensors, attention split by
heads, the MLP's first matrices by columns and its last by rows, the embedding by rows. Accelerate's
ParallelismConfig is not used: it refuses CPU processes, and its FSDP2 + TP branch imports a class
transformers 5.23 no longer has (docs/parallelism.md, "Which engine each will use").

The split slices each rank's own copy of the weights (no broadcast), so every rank must build the
model from the same seed, as the recipes do.

What cannot be split is refused in one line before anything is built (`problems`): a model without a
plan, and head counts or MLP widths that the tp degree does not divide (transformers would cut a
head in two and compute garbage, not fail).

The strategy that trains with it is toolkit.strategy.distributed's (accelerate_configs/fsdp_tp.yaml):
Accelerate takes the split model as the FSDP2 module it is, so checkpoints (torch.distributed.checkpoint
of the 2-D DTensors) and final/ (gathered whole) follow the FSDP2 contract.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from toolkit.config import UserError

# the sizes a tensor-parallel plan cuts into tp equal parts, per config attribute
_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def problems(config: PretrainedConfig, tp: int) -> list[str]:
    """Why `config`'s model cannot be split over `tp` ranks (empty when it can)."""
    if tp < 1:
        return [f"tp={tp} must be at least 1"]
    if tp == 1:
        return []
    found = []
    if not getattr(config, "base_model_tp_plan", None):
        found.append(f"model_type={config.model_type} has no tensor-parallel plan in transformers; "
                     "use a LLaMA, Qwen2/3 or Mistral model, or FSDP2/ZeRO-3 to shard it")
    for name in _SPLIT:
        size = getattr(config, name, None)
        if isinstance(size, int) and size % tp:
            found.append(f"model.config.{name}={size} is not divisible by tp={tp}: each rank must hold whole "
                         f"{'heads' if 'heads' in name else 'columns'}; pick a tp that divides it")
    return found


def split(model: torch.nn.Module, tp: int, dp: int = 1) -> torch.nn.Module:
    """`model` (built from the same seed, or loaded from the same files, on every rank; process group
    started) with its layers split over `tp` ranks and, across the `dp` groups of tp ranks, sharded by
    FSDP2 (transformers' own plan: the 2-D mesh dp x tp, rank = dp index x tp + tp index); refused in
    one line if it cannot be split. With dp = 1 the model is still an FSDP2 module over a mesh of one,
    so that the strategy sees it already sharded and wraps it no further."""
    found = problems(model.config, tp)
    if found:
        raise UserError(found[0])
    if tp == 1:
        return model
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(tp_size=tp, fsdp_size=dp))
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied:
        # transformers 5.23 looks the plan's lm_head.weight up among named_parameters(), which lists a
        # tied weight once, under the embedding's name (KeyError): untied for the split, and tied again
        # after it by transformers itself, as from_pretrained does (its FSDP plan wraps a tied pair once)
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
    model = type(model).maybe_distribute_model(model, config, mesh)
    if tied:
        model.tie_weights()
    if dp == 1:
        fully_shard(model, mesh=mesh.get_mesh("fsdp"))
    return model
