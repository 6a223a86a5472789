"""Which settings train under which layouts, in one table: each rule's setting, the layouts (and precisions) it does
not train under with the reason, and the override that trains instead (None: only another layout does). The launch
raises the first rule a run breaks before the model loads (`check`); recipes/plan.py lifts or lists them (`refusals`).
What depends on the model itself (heads tp must divide, layers the stages must split) its applier asks of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout

Why = Callable[[Any, ParallelLayout, str], str | None]  # (recipe config, layout, precision) -> the line, or None


@dataclass(frozen=True)
class Rule:
    setting: str  # the setting as a user writes it: what the rule is about
    refused: Why
    instead: dict[str, str] | None  # the override that trains under the layout; None: only another layout does


def _objective(cfg) -> str:
    return getattr(cfg.train, "objective", "sft")  # pretraining has none


def _method(cfg) -> str | None:
    adapter = getattr(cfg, "adapter", None)  # pretraining has none
    return adapter.method if adapter is not None else None


def _degrees(layout: ParallelLayout) -> str:
    return ", ".join(f"{axis} {getattr(layout, axis)}" for axis in ("tp", "cp", "sp", "pp") if getattr(layout, axis) > 1)


def whole_model_refused(layout: ParallelLayout) -> str | None:
    """Why model.compile=model does not run under `layout` ("with pipeline stages ..."), or None where it runs."""
    if layout.pp > 1:  # the stages run their parts of the model, never its whole forward: it would compile nothing
        return "with pipeline stages (each stage runs its own part of the model)"
    if layout.tp > 1 or layout.sp > 1:  # dynamo fails on their hooks' tensors (torch 2.13: "Mixing fake modes", KeyError)
        return "with tensor or sequence parallelism"
    return None


def positions_refused(layout: ParallelLayout) -> str | None:
    """Why the output head cannot be computed on the target positions alone (model.loss_positions=targets) under
    `layout`, or None where it can: tensor parallel splits the head by vocabulary, a pipeline's last stage computes its
    loss from its own logits, and context and sequence parallel shards are untried with it."""
    return f"with model parallel ({_degrees(layout)})" if layout.model_parallel > 1 else None


def cast_refused(layout: ParallelLayout, precision: str) -> str | None:
    """Why the bf16 copy of the weights cannot be made once per step (model.cast_weights=per_step) under `layout`
    at `precision` ("no", "bf16" or "fp16"), or None where it can (toolkit.models.weight_cast)."""
    if precision not in ("bf16", "fp16"):
        return "the run computes in fp32 (train.mixed_precision), with no low-precision copy to make"
    if layout.kind not in ("single", "ddp"):
        return (f"{'FSDP2' if layout.kind == 'fsdp' else 'DeepSpeed'} casts the weights its own way "
                "(FSDP2 at each all-gather, DeepSpeed in its bf16 mode)")
    if layout.model_parallel > 1:
        return "tensor, sequence, context parallel and pipelines compute under autocast"
    return None


def _canary(cfg, layout: ParallelLayout, precision: str) -> str | None:
    # the canary's row goes through a rank's model alone, outside the strategy's hooks: that model must be whole
    if getattr(cfg.train, "canary", "none") == "none":
        return None
    why = ("FSDP, whose ranks each hold a shard of it" if layout.kind == "fsdp"
           else "ZeRO-3, whose ranks each hold a shard of it" if layout.zero_stage == 3
           else f"model parallel ({_degrees(layout)}), which splits it over ranks" if layout.model_parallel > 1
           else None)
    return None if why is None else (f"train.canary checks a rank's whole model: it does not run yet under {why}; "
                                     "use train.canary=none, or ddp.yaml, zero1.yaml or zero2.yaml")


def _qlora(cfg, layout: ParallelLayout, precision: str) -> str | None:
    # Its 4-bit base is bitsandbytes' packed NF4 weights (Params4bit, each with a quant state beside it): DDP holds
    # them whole on every process, FSDP2 shards them once held in a float dtype (toolkit.strategy.fsdp's
    # qlora_storage), ZeRO-3 partitions the uint8 bytes themselves (each rank's ds_tensor holds half on 2, the quant
    # state stays whole and the gathered Params4bit finds it again). Measured on 2 CPU processes under ZeRO-1/2/3
    # (and zero3_offload): one process's losses (fp32: equal; bf16: 1.7e-5 relative), resumed bit for bit, merged
    # and exported as a LoRA (tests/recipes/test_finetune_qlora.py). FSDP1 shards with flat parameters that the quant
    # state does not follow, and model parallel would split the layers.
    if _method(cfg) != "qlora" or layout.model_parallel == 1 and (
            layout.kind in ("single", "ddp", "deepspeed") or layout.kind == "fsdp" and layout.fsdp_version == 2):
        return None
    if layout.model_parallel > 1:
        return ("adapter.method=qlora trains under DDP, FSDP2 and DeepSpeed ZeRO (data parallel), not with model "
                f"parallel ({_degrees(layout)}), which would split its 4-bit base; launch with "
                "accelerate_configs/ddp.yaml, fsdp.yaml or zero3.yaml and no train.pipeline_stages")
    return ("adapter.method=qlora trains under DDP, FSDP2 and DeepSpeed ZeRO, not under FSDP1 (its flat parameters "
            "lose the 4-bit quant state); launch with accelerate_configs/fsdp.yaml (FSDP2) or zero3.yaml to shard "
            "its 4-bit base, or ddp.yaml")


# A pipeline's stages under a layout that cannot hold them, refused by the launch as it is made (toolkit.strategy's
# parallelism, before any process group, and distributed, once the accelerate config is read) by this rule: the
# pipelines side by side average their gradients as DDP's replicas do, and a stage is not split further yet.
PIPELINE_LAYOUT = Rule("train.pipeline_stages", lambda cfg, layout, precision: (
    f"train.pipeline_stages={layout.pp} runs under accelerate_configs/ddp.yaml (the pipelines side by side average "
    f"their gradients themselves), not under {layout.accelerate_name}; launch with it, or set train.pipeline_stages=1"
) if layout.pp > 1 and layout.kind not in ("single", "ddp") else (
    f"train.pipeline_stages={layout.pp} with an accelerate parallelism_config (cp, tp or sp) is not supported yet; "
    "use accelerate_configs/ddp.yaml"
) if layout.pp > 1 and layout.tp * layout.cp * layout.sp > 1 else None, None)

# fp16 in a pipeline is refused before any process group exists (toolkit.strategy.parallelism), by this rule
FP16_IN_A_PIPELINE = Rule("train.mixed_precision=fp16", lambda cfg, layout, precision: (
    f"train.pipeline_stages={layout.pp} with train.mixed_precision=fp16 is not supported (the schedule runs the "
    "backward itself, without fp16's loss scaling); use bf16"
) if precision == "fp16" and layout.pp > 1 else None, None)

def _fp8(cfg, layout: ParallelLayout, precision: str) -> str | None:
    # torchao converts tensor-parallel layers with float8 styles of its own, not ours; the rest are untried
    if cfg.train.mixed_precision == "fp8" and layout.model_parallel > 1:
        return (f"train.mixed_precision=fp8 trains under DDP, FSDP and ZeRO (data parallel), not with model parallel "
                f"({_degrees(layout)}) yet; use bf16 there")
    return None


RULES: tuple[Rule, ...] = (
    PIPELINE_LAYOUT,
    FP16_IN_A_PIPELINE,
    Rule("train.mixed_precision=fp8", _fp8, None),
    Rule("adapter.method=qlora", _qlora, None),
    # DeepSpeed's engine writes its checkpoint through calls of its own, not Accelerate's or DCP's save that
    # toolkit.checkpoint.background stages; a pipeline's stage files are written beside them, untried in the background
    Rule("checkpoint.async_save=true", lambda cfg, layout, precision: (
        "checkpoint.async_save=true writes DDP's and FSDP2's checkpoints in the background, not "
        + ("DeepSpeed's (its engine writes its own files) yet; use checkpoint.async_save=false, or fsdp.yaml"
           if layout.kind == "deepspeed" else
           "a pipeline's stage files yet; use checkpoint.async_save=false, or train.pipeline_stages=1")
    ) if cfg.checkpoint.async_save and (layout.kind == "deepspeed" or layout.pp > 1) else None,
        {"checkpoint.async_save": "false"}),
    Rule("adapter.method=lora", lambda cfg, layout, precision: (
        f"{'tensor' if layout.tp > 1 else 'pipeline'} parallel trains a whole model, not a LoRA adapter, yet; use "
        "fsdp.yaml or the zero configs"
    ) if _method(cfg) in ("lora", "qlora") and (layout.tp > 1 or layout.pp > 1) else None, None),
    # peft 0.21's trainable tokens (model.new_tokens' rows under a LoRA): FSDP2 refuses to shard the delta a tied head
    # shares ("Invariant encountered: value was None" in its DeviceMesh), and under ZeRO-3 peft gathers the rows on a
    # CUDA device of its own (it fails on CPU); DDP and ZeRO-1/2 train them with the same losses
    Rule("model.new_tokens", lambda cfg, layout, precision: (
        f"model.new_tokens under a LoRA trains the new rows through peft's trainable tokens, which do not train under "
        f"{'FSDP2' if layout.kind == 'fsdp' else 'ZeRO-3'} yet; use ddp.yaml, zero1.yaml or zero2.yaml, or "
        "adapter.method=full"
    ) if getattr(cfg.model, "new_tokens", None) and _method(cfg) in ("lora", "qlora") and (
        layout.kind == "fsdp" or (layout.kind == "deepspeed" and layout.zero_stage == 3)) else None, None),
    Rule("train.objective (a preference objective)", lambda cfg, layout, precision: (
        f"train.objective={_objective(cfg)} trains under DDP, FSDP and ZeRO (data parallel), not with model parallel "
        f"({_degrees(layout)}) yet; use accelerate_configs/ddp.yaml, fsdp.yaml or a zero*.yaml, and "
        "train.pipeline_stages=1"
    ) if _objective(cfg) != "sft" and layout.model_parallel > 1 else None, None),
    # the kept step is a checkpoint loaded back after training, and replay reweighs the mixture: both proven under
    # DDP, FSDP2 and ZeRO (tests/recipes/test_finetune_forgetting.py, the kill soak), not with model parallel
    Rule("forgetting.budget", lambda cfg, layout, precision: (
        f"forgetting.budget holds a run under DDP, FSDP and ZeRO (data parallel), not with model parallel "
        f"({_degrees(layout)}) yet; use accelerate_configs/ddp.yaml, fsdp.yaml or a zero*.yaml, or drop the budget "
        "(forgetting.general alone reports the general loss)"
    ) if getattr(getattr(cfg, "forgetting", None), "budget", None) is not None and layout.model_parallel > 1 else None,
        {"forgetting.budget": ""}),
    Rule("model.loss=chunked", lambda cfg, layout, precision: (
        "model.loss=chunked is not supported with train.pipeline_stages > 1 yet (the last stage computes the loss "
        "from its logits); use model.loss=full"
    ) if cfg.model.chunk_tokens and layout.pp > 1 else (
        # the head's weight is split by vocabulary over the tp ranks: its loss needs the vocab-parallel
        # cross-entropy, which the chunked head does not compute (it failed on mixed Tensor/DTensor)
        "model.loss=chunked is not supported with tensor parallel (parallelism_config_tp_size) yet; use "
        "model.loss=full"
    ) if cfg.model.chunk_tokens and layout.tp > 1 else (
        f"train.objective={_objective(cfg)} scores each answer from the full logits: model.loss=chunked is not "
        "supported with it yet; use model.loss=full"
    ) if cfg.model.chunk_tokens and _objective(cfg) != "sft" else (
        # a LoRA layer holds the head's weight and its own matrices: the chunks read one plain weight (a head trained
        # whole, adapter.modules_to_save, is one: a copy peft calls)
        "model.loss=chunked computes the loss inside the output head, and adapter.target_modules puts a LoRA on it "
        "(lm_head); use model.loss=full, or train the head whole with adapter.modules_to_save=[lm_head] in place of "
        "its LoRA"
    ) if cfg.model.chunk_tokens and _method(cfg) in ("lora", "qlora") and "lm_head" in cfg.adapter.target_modules
        else None, {"model.loss": "full"}),
    Rule("model.loss_positions=targets", lambda cfg, layout, precision: (
        f"model.loss_positions=targets does not run {why} yet; use model.loss_positions=all (auto takes it where it "
        "runs)"
    ) if getattr(cfg.model, "loss_positions", "all") == "targets" and (why := positions_refused(layout)) else None,
        {"model.loss_positions": "all"}),
    Rule("model.compile=model", lambda cfg, layout, precision: (
        f"model.compile=model does not run {why}; use model.compile=layers"
    ) if cfg.model.compile == "model" and (why := whole_model_refused(layout)) else None, {"model.compile": "layers"}),
    # ZeRO-3 gathers a weight in its module's hook, inside the layer, and again in the recompute whenever it was
    # released in between: torch's selective checkpointing refuses an operator the forward did not run
    # ("c10d._allgather_base_ encountered during backward but not found in storage")
    Rule("model.gradient_checkpointing=selective", lambda cfg, layout, precision: (
        "model.gradient_checkpointing=selective does not run under ZeRO-3 (its weight gathers inside each layer "
        "differ between the forward and the recompute); use full, or fsdp.yaml"
    ) if cfg.model.gradient_checkpointing == "selective" and layout.kind == "deepspeed" and layout.zero_stage == 3
        else None, {"model.gradient_checkpointing": "full"}),
    Rule("train.canary", _canary, {"train.canary": "none"}),
    Rule("model.cast_weights=per_step", lambda cfg, layout, precision: (
        f"model.cast_weights=per_step cannot cast the weights once per step here: {why}; use model.cast_weights=auto "
        "or per_forward"
    ) if cfg.model.cast_weights == "per_step" and (why := cast_refused(layout, precision)) else None,
        {"model.cast_weights": "auto"}),
)


@dataclass(frozen=True)
class Refusal:
    setting: str  # the rule's (Rule.setting)
    line: str  # the one error line
    instead: dict[str, str] | None  # the override that trains under the layout; None: another layout


def refusals(cfg: Any, layout: ParallelLayout, precision: str) -> list[Refusal]:
    """Every rule recipe config `cfg` breaks under `layout` at compute `precision` ("no", "bf16" or "fp16")."""
    found = [(rule, rule.refused(cfg, layout, precision)) for rule in RULES]
    return [Refusal(rule.setting, line, rule.instead) for rule, line in found if line is not None]


# What trains on GPUs only: (the setting's key, its value, the line on a machine without one)
GPU_ONLY = (
    ("model.attn_implementation", "flex_attention", "model.attn_implementation=flex_attention trains only on GPUs "
     "(torch has no CPU backward for it); use sdpa on CPU"),
)


def check(cfg: Any, layout: ParallelLayout, precision: str, device: str = "cuda") -> None:
    """The launch's question: the first rule the run breaks on a `device` ("cuda", "cpu"), as its one error line."""
    found = refusals(cfg, layout, precision)
    if found:
        raise UserError(found[0].line)
    for key, value, line in GPU_ONLY:
        section, name = key.split(".")
        if device == "cpu" and getattr(getattr(cfg, section), name) == value:
            raise UserError(line)
