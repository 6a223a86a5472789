"""Tensor parallelism: a causal LM's layers split over `tp` ranks by transformers' own plan.

The split slices each rank's own copy of the weights (no broadcast), so every rank must build the model from
the same seed, as the recipes do. What cannot be split is refused in one line before anything is built
(`problems`); a mixture of experts is split by whole experts, and a dense model under sdpa or eager attention
also gets Megatron's sequence parallelism (`sequence_layout`). It trains under toolkit.strategy.distributed's
strategy (accelerate_configs/fsdp_tp.yaml), so checkpoints and final/ follow the FSDP2 contract.
Why this engine, and how each part is split: docs/internals.md, toolkit/strategy/tensor_parallel.py.
"""

from __future__ import annotations

import logging
import re
import warnings

import torch
from transformers import PretrainedConfig

from toolkit.config.errors import UserError
from toolkit.models.router import expert_count
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.parallelism import device_mesh

# attention kinds whose packed-document mask arrives whole (4-D) and so survives the sequence split
SEQUENCE_ATTENTION = ("sdpa", "eager")
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


def sequence_problem(tp: int, seq_len: int) -> str | None:
    """Why blocks of `seq_len` tokens cannot be split evenly over tp ranks between the layers (None when
    they can). Asked of every model before it is built: only a dense model's layout splits them, but a
    rank refusing after building the model could be far ahead of rank 0, still preparing the data."""
    if tp <= 1 or seq_len % tp == 0:
        return None
    return (f"data.seq_len={seq_len} is not divisible by parallelism_config_tp_size={tp}: tensor parallel splits every "
            f"sequence between layers (sequence parallel); use a multiple of {tp}")


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


def sequence_layout(model: torch.nn.Module, attn_implementation: str) -> tuple[dict, str | None]:
    """(module name -> torch parallel style, None) for splitting `model` with Megatron's sequence
    parallelism, or ({}, why not) when its layout is not the one the styles assume: every decoder
    layer a residual stream of norms around one attention and one MLP, transformers' plan only
    colwise/rowwise matrices inside them (and Qwen3's whole per-head norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if expert_count(model.config):
        return {}, "a mixture of experts keeps transformers' plan (its experts' all-to-all takes whole sequences)"
    if attn_implementation not in SEQUENCE_ATTENTION:
        return {}, f"attention {attn_implementation} builds its mask from the sequence it is handed"
    base = model.base_model_prefix
    body = getattr(model, base, None)
    head = model.get_output_embeddings()
    if body is None or head is None or not isinstance(getattr(body, "layers", None), torch.nn.ModuleList) \
            or not isinstance(getattr(body, "norm", None), torch.nn.Module):
        return {}, f"{type(model).__name__} has no {base}.layers / {base}.norm / output head"
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, torch.nn.Embedding) or embedding is not getattr(body, "embed_tokens", None) \
            or head is not getattr(model, "lm_head", None):
        return {}, f"{type(model).__name__}'s embedding or head is not {base}.embed_tokens / lm_head"
    styles = {}
    for key, style in model.config.base_model_tp_plan.items():
        if style == _PARTIAL_GRADIENT:
            continue  # whole on every rank, its gradient summed (split)
        if style not in ("colwise", "rowwise") or not key.startswith("layers.*."):
            return {}, f"its plan has {key}: {style}"
        # a row-split matrix ends attention or the MLP: its output goes back to the rank's part of the sequence
        styles[key] = ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=Shard(1))
    splits = {key.rsplit(".", 1)[0] for key in styles}  # layers.*.self_attn, layers.*.mlp
    layout = {
        f"{base}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        f"{base}.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i, layer in enumerate(body.layers):
        for name, child in layer.named_children():
            key = f"layers.*.{name}"
            if key in splits and "attn" in name:  # called with hidden_states=...
                layout[f"{base}.layers.{i}.{name}"] = PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()})
            elif key in splits:  # the MLP: hidden states its one argument
                layout[f"{base}.layers.{i}.{name}"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            elif "norm" in type(child).__name__.lower():
                layout[f"{base}.layers.{i}.{name}"] = SequenceParallel()
            elif any(True for _ in child.parameters()):
                return {}, f"its decoder layer has {name} ({type(child).__name__}), neither a norm nor split by the plan"
        for key, style in styles.items():
            layout[f"{base}.layers.{i}.{key.removeprefix('layers.*.')}"] = style
    return layout, None


def split(model: torch.nn.Module, tp: int, dp: int = 1, attn_implementation: str = "", mesh=None) -> torch.nn.Module:
    """`model` (built from the same seed, or loaded from the same files, on every rank; process group
    started) with its layers split over `tp` ranks (a mixture of experts' experts spread whole over the
    same ranks) and, across the `dp` groups of tp ranks, sharded by FSDP2 (the 2-D mesh dp x tp, rank =
    dp index x tp + tp index); refused in one line if it cannot be split. A dense model under
    `attn_implementation` sdpa or eager gets Megatron's sequence parallelism besides
    (`sequence_layout`; `model.tp_whole_between_layers` is None then, else why not). With dp = 1 the model is still an
    FSDP2 module over a mesh of one, so that the strategy sees it already sharded and wraps it no further.
    `mesh`: the launch's (toolkit.strategy.parallelism.device_mesh), else one is built for dp x tp alone; a mixture of
    experts is split by transformers' own plan, over the mesh transformers builds for it."""
    found = problems(model.config, tp)
    if found:
        raise UserError(found[0])
    if tp == 1:
        return model
    layout, whole = sequence_layout(model, attn_implementation)
    partial = [pattern for pattern, style in model.tp_plan.items() if style == _PARTIAL_GRADIENT]
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied:
        # transformers 5.23 looks the plan's lm_head.weight up among named_parameters(), which lists a
        # tied weight once, under the embedding's name (KeyError), and torch's styles would cut the one
        # weight twice: untied for the split, and tied again after it (both halves are cut by vocabulary)
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
    if layout:
        model = _split_sequence(model, tp, dp, layout, partial, tied, mesh)
    else:
        model = _split_by_plan(model, tp, dp, partial, tied)
    model.tp_whole_between_layers = whole
    # The head's output is its DTensor's local tensor, a view (torch's to_local), and the FSDP2 root
    # (FSDPLlamaForCausalLM, say) warns that an in-place op on it would skip the backward's all-gather;
    # the loss only reads it.
    warnings.filterwarnings(
        "ignore", message=rf"FSDP2-wrapped module \({re.escape(type(model).__name__)}\) returned a view tensor",
        category=UserWarning,
    )
    return model


def _split_by_plan(model, tp: int, dp: int, partial: list[str], tied: bool) -> torch.nn.Module:
    """transformers' own split: its plan, its expert parallelism, its FSDP2 over dp."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(
        tp_size=tp, ep_size=expert_parallel(model.config, tp), fsdp_size=dp,
        # None, not {}: an empty tp_plan override would replace the whole plan
        tp_plan=dict.fromkeys(partial, "replicate") or None,
    ))
    model = type(model).maybe_distribute_model(model, config, mesh)
    if partial:
        sum_gradients_over(model, partial, mesh.get_mesh("tp").get_group())
    if tied:
        model.tie_weights()  # as from_pretrained does (its FSDP plan wraps a tied pair once)
    if dp == 1:
        fully_shard(model, mesh=mesh.get_mesh("fsdp"))
    return model


def _mergeable_or_other(record: logging.LogRecord) -> bool:
    """False for torch's note that a redistribution over both mesh axes takes one collective per axis
    where no flattened mesh could merge them (axes in descending order, as when a weight sharded by FSDP2
    and by tp is gathered whole for saving; or a size the axes do not divide): nothing to change. The
    note that asks for a flattened mesh still shows."""
    return not (str(record.msg).startswith("While redistributing from")
                and "flatten mesh dimensions" not in str(record.args[-1] if record.args else ""))


def _split_sequence(model, tp: int, dp: int, layout: dict, partial: list[str], tied: bool, mesh) -> torch.nn.Module:
    """torch's parallelize_module with Megatron's sequence-parallel `layout` over the tp axis, then
    FSDP2 over the dp axis, each decoder layer its own unit."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh is None:
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        mesh = device_mesh(ParallelLayout("fsdp", dp * tp, tp=tp), device)
    # a DTensor placed on both axes (the gradient norm, a weight gathered whole) then moves in one
    # collective over the flattened mesh, not one per axis (torch logs each such pair as suboptimal)
    mesh._flatten("dp_tp")
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_mergeable_or_other)
    parallelize_module(model, mesh["tp"], layout)
    if tied:
        model.tie_weights()  # both halves cut by vocabulary (Shard(0)): one weight again, before FSDP2 sees it
    if partial:
        sum_gradients_over(model, partial, mesh["tp"].get_group())
    for layer in getattr(model, model.base_model_prefix).layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
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
