"""Tensor parallelism: a causal LM's layers split over `tp` ranks by transformers' own plan.

The engine is transformers' distributed API (DistributedConfig, the model's `base_model_tp_plan`,
`prepare_distribute_model` + `maybe_distribute_model`): weights become DTensors, attention split by
heads, the MLP's first matrices by columns and its last by rows, the embedding by rows. Accelerate's
ParallelismConfig is not used: it refuses CPU processes, and its FSDP2 + TP branch imports a class
transformers 5.23 no longer has (docs/parallelism.md, "Which engine each will use").

The split slices each rank's own copy of the weights (no broadcast), so every rank must build the
model from the same seed, as the recipes do.

A mixture of experts is split the same way, but its experts are not cut: each of the tp ranks holds
num_experts / tp whole experts (expert parallel, transformers' `base_model_ep_plan` with ep_size = tp),
and every MoE layer sends each token to the ranks of its chosen experts and back with two all_to_all
(transformers' AllToAllEP while training; at evaluation, without gradients, each rank runs its own
experts on the whole batch and one all-reduce sums them). The expert weights, most of an MoE's, are
then 1/tp per rank, as the split attention is.

What cannot be split is refused in one line before anything is built (`problems`): a model without a
plan (or, for a mixture of experts, without an expert-parallel plan), head counts or MLP widths that
the tp degree does not divide (transformers would cut a head in two and compute garbage, not fail),
and expert counts it does not divide.

The strategy that trains with it is toolkit.strategy.distributed's (accelerate_configs/fsdp_tp.yaml):
Accelerate takes the split model as the FSDP2 module it is, so checkpoints (torch.distributed.checkpoint
of the 2-D DTensors) and final/ (gathered whole) follow the FSDP2 contract.
"""

from __future__ import annotations

import re

import torch
from transformers import PretrainedConfig

from toolkit.config import UserError
from toolkit.models.router import expert_count

# the sizes a tensor-parallel plan cuts into tp equal parts, per config attribute
_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
# transformers' style for a weight every tp rank holds whole but whose gradient each computes only a
# part of (Qwen3's per-head q_norm and k_norm: each rank normalises its own heads)
_PARTIAL_GRADIENT = "replicated_with_grad_allreduce"


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
    experts = expert_count(config)
    if experts and not getattr(config, "base_model_ep_plan", None):
        # without one, transformers' TP plan cuts every expert's matrices instead (moe_tp_experts); that
        # trains (Qwen3-MoE at ep_size=1: one process's losses), but torch.distributed.checkpoint refuses
        # to save its packed gate_up_proj ("overlapping chunks"), so the run dies at its first checkpoint
        found.append(f"model_type={config.model_type} is a mixture of experts with no expert-parallel plan in "
                     "transformers; use a Qwen2-MoE, Qwen3-MoE or Mixtral model, or fsdp.yaml / the zero configs")
    elif experts % tp:
        found.append(f"model.config.num_experts={experts} is not divisible by tp={tp}: each rank must hold whole "
                     f"experts (expert parallel over the tp ranks); use a number of experts divisible by {tp}, or "
                     "fsdp.yaml / the zero configs")
    return found


def expert_parallel(config: PretrainedConfig, tp: int) -> int:
    """Ranks a model's experts are split over when its layers are split over `tp` ranks: the same tp
    ranks for a mixture of experts (they share one batch, and each sends its 1/tp share of the tokens),
    1 for a dense model. Over the data-parallel ranks instead, an accelerate config has no line to ask
    for it (docs/parallelism.md, "Expert parallelism")."""
    return tp if expert_count(config) else 1


def expert_ranks(model: torch.nn.Module) -> int:
    """Ranks a split model's experts are spread over, as transformers applied it (1 for a dense model
    or one not split)."""
    applied = getattr(model.config, "distributed_config", None)
    return getattr(applied, "ep_size", None) or 1


def split(model: torch.nn.Module, tp: int, dp: int = 1) -> torch.nn.Module:
    """`model` (built from the same seed, or loaded from the same files, on every rank; process group
    started) with its layers split over `tp` ranks (a mixture of experts' experts spread whole over the
    same ranks) and, across the `dp` groups of tp ranks, sharded by
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

    ep = expert_parallel(model.config, tp)
    partial = [pattern for pattern, style in model.tp_plan.items() if style == _PARTIAL_GRADIENT]
    config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(
        tp_size=tp, ep_size=ep, fsdp_size=dp,
        # None, not {}: an empty tp_plan override would replace the whole plan
        tp_plan=dict.fromkeys(partial, "replicate") or None,
    ))
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied:
        # transformers 5.23 looks the plan's lm_head.weight up among named_parameters(), which lists a
        # tied weight once, under the embedding's name (KeyError): untied for the split, and tied again
        # after it by transformers itself, as from_pretrained does (its FSDP plan wraps a tied pair once)
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
    model = type(model).maybe_distribute_model(model, config, mesh)
    if partial:
        sum_gradients_over(model, partial, mesh.get_mesh("tp").get_group())
    if tied:
        model.tie_weights()
    if dp == 1:
        fully_shard(model, mesh=mesh.get_mesh("fsdp"))
    return model


class _SumGradient(torch.autograd.Function):
    """The weight as it is; its gradient summed over the tp group on the way back."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradients_over(model: torch.nn.Module, patterns: list[str], group) -> None:
    """The weights of the modules `patterns` name (plan keys, `*` for a layer number) get their gradient
    summed over `group` inside autograd, each backward's own part only.

    transformers' replicated_with_grad_allreduce all-reduces `param.grad` in a post-accumulate hook: the
    gradient accumulated so far, not this backward's part. When micro-batches accumulate without FSDP's
    reduce in between (Accelerate's no_sync, every micro-batch but the last), the earlier micro-batches'
    gradients are summed again at every backward (measured, Qwen3 tp 2, 2 micro-batches: q_norm and
    k_norm gradients 1.3-1.7x the whole model's; a 6-step Qwen3-MoE run's final/ logits 4e-3 off one
    process's)."""
    names = re.compile("|".join(re.escape(p).replace(r"\*", r"\d+") for p in patterns)).fullmatch
    for name, module in model.named_modules():
        if names(name):
            _sum_gradients(module, group)


def _sum_gradients(module: torch.nn.Module, group) -> None:
    forward = module.forward

    def summed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # FSDP2 puts the gathered weights into the module before the forward: swapped here for the
        # summing view, and put back, for the forward's time only
        own = dict(module._parameters)
        for key, weight in own.items():
            if weight is not None and weight.requires_grad:
                module._parameters[key] = _SumGradient.apply(weight, group)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(own)

    module.forward = summed
