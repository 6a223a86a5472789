"""Which weights a fine-tune trains: all of them, a LoRA adapter, or a LoRA on a 4-bit base (QLoRA).

LoRA comes from peft. The adapter is added before `accelerator.prepare`, on the whole model,
so DDP, FSDP2 and ZeRO-3 see an ordinary module with some parameters frozen: FSDP2 shards
frozen and trainable parameters alike, ZeRO-3 partitions the frozen base and builds its
optimizer over the adapter only, and nothing peft-specific happens inside the strategy.

QLoRA loads the base through bitsandbytes' 4-bit NF4 kernels, which need a CUDA GPU. Where
there is none the recipe stops with a message; it never trains in full precision instead.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from toolkit.config import UserError, field

# The attention and MLP projections of LLaMA/Mistral/Qwen2 (GPT-2 names them c_attn, c_proj, c_fc).
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class AdapterConfig:
    method: Literal["full", "lora", "qlora"] = field(
        "lora", help="full = train every weight; lora = train a LoRA adapter (peft); qlora = LoRA on a 4-bit base (CUDA)"
    )
    r: int = field(16, help="LoRA rank")
    alpha: float = field(32, help="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = field(
        0.0, help="dropout on the LoRA input (peft's default: 0); above 0 every adapted projection keeps a dropped "
        "copy of its input and a mask for the backward"
    )
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        help="module names (last name part) that get a LoRA, or [all-linear]",
    )
    merge: bool = field(True, help="also write the base with the adapter merged in, as final/ (LoRA/QLoRA)")
    dora: bool = field(False, help="DoRA (peft's use_dora): beside the low-rank direction, a learnt magnitude per "
                                   "output row; closer to a full fine-tune, slower a step")
    rslora: bool = field(False, help="rank-stabilised scaling (peft's use_rslora): the update scaled by alpha / "
                                     "sqrt(r) instead of alpha / r, for large ranks")
    modules_to_save: list[str] = field(
        default_factory=list, help="modules trained whole beside the adapter and saved with it, e.g. [embed_tokens, "
        "lm_head] when tokens were added"
    )
    layers: list[int] = field(default_factory=list, help="the decoder layers (0-based) to adapt; empty = every one")

    def validate(self) -> list[str]:
        problems = []
        if self.r < 1:
            problems.append(f"r={self.r} must be at least 1")
        if self.alpha <= 0:
            problems.append(f"alpha={self.alpha} must be positive")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            problems.append("target_modules is empty; name the projections to adapt, or use [all-linear]")
        problems += [f"{name} has a blank entry; name a module, or drop it" for name in ("target_modules", "modules_to_save")
                     if any(not str(m).strip() for m in getattr(self, name))]  # peft would match it to nothing, or fail
        if any(i < 0 for i in self.layers):
            problems.append(f"layers={self.layers}: layer indices start at 0")
        return problems

    @property
    def is_lora(self) -> bool:
        return self.method in ("lora", "qlora")


def qlora_problem(cfg: AdapterConfig, layout) -> str | None:
    """Why a QLoRA run cannot train under `layout` (a toolkit.parallel_layout.ParallelLayout), or None. Its 4-bit
    base is bitsandbytes' packed NF4 weights, which every process holds whole: FSDP and ZeRO-3 would shard them,
    DeepSpeed's bf16 mode casts the module, and model parallel splits the layers (none is supported yet)."""
    if cfg.method != "qlora" or (layout.kind in ("single", "ddp") and layout.model_parallel == 1):
        return None
    if layout.model_parallel > 1:
        return ("adapter.method=qlora trains under DDP only (model parallel would split its 4-bit base, which "
                "bitsandbytes keeps whole on each GPU); launch with accelerate_configs/ddp.yaml and no "
                "train.pipeline_stages")
    how = "FSDP would shard" if layout.kind == "fsdp" else "DeepSpeed would cast or shard"
    return (f"adapter.method=qlora trains under DDP only ({how} its 4-bit base, which bitsandbytes keeps whole on "
            "each GPU); launch with accelerate_configs/ddp.yaml, or use adapter.method=lora to shard a full-precision "
            "base")


def check_qlora_device(cfg: AdapterConfig) -> None:
    """QLoRA needs bitsandbytes' 4-bit CUDA kernels; say so before any work is done."""
    if cfg.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise UserError(
            "adapter.method=qlora needs a CUDA GPU (bitsandbytes 4-bit kernels) and this machine has none; "
            "use adapter.method=lora, which trains the same adapter on a full-precision base"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("adapter.method=qlora needs bitsandbytes; pip install bitsandbytes")


def leave_out_bitsandbytes() -> None:
    """Mark bitsandbytes absent for this process: for a run that does not load a 4-bit base.

    peft imports bitsandbytes whenever it is installed (peft/helpers.py), and transformers' schedules
    import peft; bitsandbytes 0.50 then logs "Failed to load CPU gemm_4bit_forward from
    kernels-community" on each rank of a run that never calls it. A `None` in sys.modules is Python's
    own "not installed": peft and transformers take it so. Call it before anything imports peft.
    """
    if "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None


def quantization_config(cfg: AdapterConfig):
    """The 4-bit NF4 load of the QLoRA paper (double quantisation, bf16 compute); None otherwise."""
    if cfg.method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """Last name parts of the model's linear layers (what target_modules can name)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Conv1D", "Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def apply_adapter(model: torch.nn.Module, cfg: AdapterConfig) -> tuple[torch.nn.Module, str]:
    """The model to train and a line for the log (trainable parameter count)."""
    if not cfg.is_lora:
        n = sum(p.numel() for p in model.parameters())
        return model, f"weights: full fine-tune, {n:,} trainable parameters"
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.target_modules != ["all-linear"]:
        present = linear_names(model)
        missing = [t for t in cfg.target_modules if t not in present]
        if missing:
            raise UserError(
                f"adapter.target_modules {missing} match no layer of this {type(model).__name__}; "
                f"its linear layers are {', '.join(present)} (or use [all-linear])"
            )
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [m for m in cfg.modules_to_save if m not in names]
    if unknown:
        raise UserError(f"adapter.modules_to_save {unknown} name no module of this {type(model).__name__}; "
                        "name them as the model does (e.g. embed_tokens, lm_head)")
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if depth is not None and any(i >= depth for i in cfg.layers):
        raise UserError(f"adapter.layers={cfg.layers}: this {type(model).__name__} has layers 0-{depth - 1}")
    if cfg.method == "qlora":
        # fp32 norms and an input hook so that checkpointed activations still get gradients
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=cfg.dora,
        use_rslora=cfg.rslora,
        modules_to_save=list(cfg.modules_to_save) or None,
        layers_to_transform=list(cfg.layers) or None,
    )
    try:
        model = get_peft_model(model, lora)
    except ValueError as exc:  # peft's refusals of this config on this model, as one line
        hint = ("set adapter.dropout=0: peft's LoRA on a mixture of experts' expert weights (all-linear takes them "
                "too) has no dropout" if "lora_dropout" in str(exc) else "change the adapter section")
        raise UserError(f"peft cannot put this LoRA on {type(model).__name__} ({str(exc).strip()}); {hint}") from None
    trainable, total = model.get_nb_trainable_parameters()
    kind = "+".join([cfg.method, *(["dora"] if cfg.dora else []), *(["rslora"] if cfg.rslora else [])])
    where = f" of layers {cfg.layers}" if cfg.layers else ""
    whole = f", {', '.join(cfg.modules_to_save)} trained whole" if cfg.modules_to_save else ""
    return model, (
        f"weights: {kind} r={cfg.r} alpha={cfg.alpha:g} on {', '.join(cfg.target_modules)}{where}{whole}: "
        f"{trainable:,} trainable of {total:,} parameters ({trainable / total:.2%})"
    )


BASE_MODEL_FILE = "base_model.json"  # how the base was loaded (toolkit.models.base_model.BaseModelConfig)


def load_with_adapter(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The base with the saved adapter on top (what an inference user does with the folder)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def merge(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """An ordinary transformers model with the adapter's update added into the base weights."""
    return load_with_adapter(base, adapter_dir).merge_and_unload()
