"""The model state a rank holds, tensor by tensor, as each strategy lays it out (docs/memory.md): exact, checked
against the live tensors' bytes at 2 and 3 ranks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from toolkit.models.router import expert_count
from toolkit.planner.facts import Run
from toolkit.strategy.families import family_of


@dataclass
class Held:
    name: str
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool  # QLoRA's 4-bit base weight
    tp_dim: int | None = None  # the dimension tensor parallel cuts (transformers' plan); None: whole on every rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tp_slice(self, tp: int) -> tuple[int, ...]:
        """This tensor's shape on the first rank of a tensor-parallel group (DTensor's Shard gives the
        first ranks ceil(size / tp))."""
        if tp == 1 or self.tp_dim is None:
            return self.shape
        return tuple(math.ceil(n / tp) if d == self.tp_dim else n for d, n in enumerate(self.shape))


def model_tensors(model: torch.nn.Module, quantized_base: bool = False) -> list[Held]:
    """Every parameter once (tied weights once, under the embedding's name), in the optimizer's order:
    decay (matrices) first; each with the dimension the model's tensor-parallel plan cuts. A mixture of
    experts is split by its expert-parallel plan over the same ranks (toolkit.strategy.tensor_parallel:
    ep = tp), which cuts the expert weights by experts (dim 0; measured on 2 gloo processes)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    config = getattr(model, "config", None)
    ep_plan = getattr(config, "base_model_ep_plan", None) if config is not None and expert_count(config) else None
    if ep_plan:
        prefix = getattr(model, "base_model_prefix", "model")
        plan.update({f"{prefix}.{key}": "experts" for key, style in ep_plan.items() if style == "grouped_gemm"})
    out = []
    for name, p in model.named_parameters():
        linear_in_layer = p.ndim == 2 and ".layers." in name and "lora_" not in name
        out.append(Held(
            name, tuple(p.shape), p.requires_grad, quantized_base and linear_in_layer and not p.requires_grad,
            _tp_dim(plan, name, p.ndim),
        ))
    return out


def _tp_dim(plan: dict[str, str], name: str, ndim: int) -> int | None:
    """The dimension of parameter `name` that transformers' plan cuts (its styles in
    transformers.distributed.tensor_parallel): colwise (and the head's colwise_gather_output) the
    output features, which is dim 0 of a weight and of a bias; rowwise the input features of the
    weight, its bias whole; embedding_rowwise the vocabulary rows. Anything else (norms, Qwen3's
    per-head q/k norms) is whole on every rank."""
    module, _, param = name.rpartition(".")
    style = plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", module))
    if plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", name)) == "experts":  # the experts' 3-D weights are named whole
        return 0
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise", "experts"):
        return 0
    if style == "rowwise" and param == "weight":
        return ndim - 1
    return None


def _groups(tensors: list[Held]) -> list[list[Held]]:
    """toolkit.training.optim's parameter groups: trainable matrices (decay), then vectors."""
    trainable = [t for t in tensors if t.trainable]
    return [g for g in ([t for t in trainable if len(t.shape) >= 2], [t for t in trainable if len(t.shape) < 2]) if g]


@dataclass
class Stage:
    """What one rank runs: the whole model, or stage `index` of a pipeline of `stages`."""

    index: int
    stages: int
    layers: range  # the decoder layers it runs, by their index in the whole model
    in_flight: int  # micro-batches whose activations it keeps at once

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def pipeline_stages(layers: int, stages: int, micro_batches: int) -> list[Stage]:
    """toolkit.strategy.pipeline.stages's cut (layer_ranges), each stage with the micro-batches torch's
    Schedule1F1B keeps alive on it: stage s runs p - s forwards before its first backward, then one
    forward per backward, so min(p - s, m) micro-batches' activations at most (the first stage the most)."""
    from toolkit.strategy.pipeline.stages import layer_ranges

    return [Stage(i, stages, r, min(stages - i, micro_batches)) for i, r in enumerate(layer_ranges(layers, stages))]


def stage_tensors(model: torch.nn.Module, tensors: list[Held], stage: Stage) -> list[Held]:
    """The tensors of model_tensors() that `stage` holds: its decoder layers, the input embedding on the
    first stage, everything else (final norm, head) on the last; a tied embedding/head is a copy on the
    first and on the last stage (Pipeline sums their gradients), so both count it."""
    if stage.stages == 1:
        return tensors
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {id(m): n for n, m in base.named_modules()}
    layers_prefix = names[id(base.get_decoder().layers)] + "."
    embedding = names[id(base.get_input_embeddings())] + ".weight"
    output = base.get_output_embeddings()
    tied = output is not None and output.weight is base.get_input_embeddings().weight
    held = []
    for t in tensors:
        name = t.name.removeprefix("base_model.model.")
        if name.startswith(layers_prefix):
            mine = int(name[len(layers_prefix):].split(".", 1)[0]) in stage.layers
        elif name == embedding:
            mine = stage.first or (tied and stage.last)
        else:
            mine = stage.last
        if mine:
            held.append(t)
    return held


def state_bytes(tensors: list[Held], run: Run) -> dict[str, int]:
    """The largest rank's params, grads (at the accumulation boundary), optimizer state and fp32
    master weights, in the terms of toolkit.strategy.sharding.held_bytes, as its strategy family holds them."""
    backend = family_of(run.strategy.layout)
    pb = backend.planned_parameter_bytes(run, torch.finfo(run.param_dtype).bits // 8)
    gb = pb  # gradients come in the weights' dtype
    step = 4  # torch AdamW's step: one fp32 scalar per state-holding tensor
    frozen = backend.planned_parameter_bytes(run, 4)  # QLoRA's fp32 non-4-bit weights, as the family holds them

    def stored(t: Held, numel: int | None = None) -> float:
        n = t.numel if numel is None else numel
        # QLoRA: a 4-bit weight is its packed bytes (half a byte a weight; FSDP2 shards them, held in a float dtype) and
        # its quant state, whole on every rank (an fp32-coded uint8 absmax per 64 weights, double-quantised: ~0.016 a
        # weight). peft's prepare_model_for_kbit_training casts every weight it did not quantise to fp32 (embeddings,
        # head, norms), which DeepSpeed's bf16 mode casts back to 16 bits (measured under ZeRO-2 and 3)
        if t.quantized:
            return n * 0.5 + t.numel * 0.016
        return n * (frozen if run.quantized_base and not t.trainable else pb)

    return backend.planned_state(run, tensors, _groups(tensors), stored, gb, step)
