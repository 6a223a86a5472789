"""Which weights a fine-tune trains: all of them, a LoRA adapter, or a LoRA on a 4-bit base (QLoRA).

LoRA comes from peft. The adapter is added before `accelerator.prepare`, on the whole model, so DDP, FSDP2 and
ZeRO-3 see an ordinary module with some parameters frozen: FSDP2 shards frozen and trainable parameters alike,
ZeRO-3 partitions the frozen base and builds its optimizer over the adapter only, and nothing peft-specific
happens inside the strategy. QLoRA loads the base through bitsandbytes' 4-bit NF4 kernels, which need a CUDA
GPU or (bitsandbytes>=0.50) the CPU; under FSDP2 its packed 4-bit bytes are sharded like any weight
(toolkit.strategy.fsdp's qlora_storage).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from toolkit.config.declarations import ALWAYS, FROM_NEXT_STEP, SHAPE, Need, free, refused
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.models.new_tokens import new_token_ids

# The attention and MLP projections of LLaMA/Mistral/Qwen2 (GPT-2 names them c_attn, c_proj, c_fc).
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


LORA = Need("adapter.method", ("lora", "qlora"), "LoRA's")  # what the LoRA keys need to have an effect


@dataclass
class AdapterConfig:
    method: Literal["full", "lora", "qlora"] = field(
        "lora", help="full = train every weight; lora = train a LoRA adapter (peft); qlora = LoRA on a 4-bit NF4 base (bitsandbytes: CUDA GPU or CPU)",
        resume=refused(SHAPE), used_when=ALWAYS,
    )
    r: int = field(16, help="LoRA rank", resume=refused(SHAPE), used_when=LORA, accepts={
        "2**31": "the layers' widths are known once the base is loaded: a rank past them is issue 44's adapter.r item, "
                 "for toolkit.models.adapter"})
    alpha: float = field(32, help="LoRA alpha (the update is scaled by alpha / r)", resume=refused(SHAPE), used_when=LORA)
    dropout: float = field(
        0.0, help="dropout on the LoRA input (peft's default: 0); above 0 every adapted projection keeps a dropped "
        "copy of its input and a mask for the backward", resume=FROM_NEXT_STEP, used_when=LORA,
        accepts={"0": "no dropout: peft's default"},
    )
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        help="module names (last name part) that get a LoRA, or [all-linear]",
        resume=refused(SHAPE), used_when=LORA, path=None, unique=True,
    )
    merge: bool = field(True, help="also write the base with the adapter merged in, as final/ (LoRA/QLoRA)",
                        resume=free("what final/ holds after training"), used_when=LORA)
    dora: bool = field(False, help="DoRA (peft's use_dora): beside the low-rank direction, a learnt magnitude per "
                                   "output row; closer to a full fine-tune, slower a step",
                       resume=refused(SHAPE), used_when=LORA)
    rslora: bool = field(False, help="rank-stabilised scaling (peft's use_rslora): the update scaled by alpha / "
                                     "sqrt(r) instead of alpha / r, for large ranks",
                         resume=refused(SHAPE), used_when=LORA)
    modules_to_save: list[str] = field(
        default_factory=list, help="modules trained whole beside the adapter and saved with it, e.g. [embed_tokens, "
        "lm_head] when tokens were added", resume=refused(SHAPE), used_when=LORA, path=None, unique=True,
        accepts={"[]": "none: the default"},
    )
    layers: list[int] = field(default_factory=list, help="the decoder layers (0-based) to adapt; empty = every one",
                              resume=refused(SHAPE), used_when=LORA, unique=True,
                              accepts={"[]": "every layer, as documented"})

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


def check_qlora_device(cfg: AdapterConfig) -> None:
    """QLoRA needs bitsandbytes (its 4-bit kernels run on a CUDA GPU and, from 0.50, on the CPU); say so before any
    work is done, and import it here, without its notice (import_bitsandbytes)."""
    if cfg.method != "qlora":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("adapter.method=qlora needs bitsandbytes; pip install -e '.[qlora]' (bitsandbytes>=0.50)")
    import_bitsandbytes()


class _NoKernelsHub(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


def import_bitsandbytes() -> None:
    """Import bitsandbytes for a run that loads a 4-bit base, without the warning its CPU backend logs at import on a
    CPU with AVX512-BF16 when the optional `kernels` package (a faster fused 4-bit matmul from the Hub) is missing:
    "Failed to load CPU gemm_4bit_forward from kernels-community". bitsandbytes falls back to its own kernels, which
    every QLoRA here is measured with; the line would tell users to install a package they do not need."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsHub())
    import bitsandbytes  # noqa: F401


def leave_out_bitsandbytes() -> None:
    """Mark bitsandbytes absent for this process: for a run that does not load a 4-bit base.

    peft imports bitsandbytes whenever it is installed (peft/helpers.py), and transformers' schedules
    import peft; bitsandbytes 0.50 then logs "Failed to load CPU gemm_4bit_forward from
    kernels-community" on each rank of a run that never calls it. A `None` in sys.modules is Python's
    own "not installed": peft and transformers take it so. Call it before anything imports peft.
    """
    if "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None


def keep_4bit_trainable(model: torch.nn.Module) -> torch.nn.Module:
    """Keep bitsandbytes' 4-bit layers on their differentiable path on the CPU. On a CPU with AVX512-BF16, a
    Linear4bit's first forward in eval mode without gradients (the held-out loss before training, the samples)
    repacks its weight in place for a fused inference kernel (gemv_4bit) that has no backward: every training step
    after it ran through it ("an autograd kernel was not registered" at the first backward), the gradient into the
    layers below each 4-bit layer unsound. Off, the layers dequantise and matmul in training and eval alike, on
    every CPU the same.

    Also: a checkpoint resumes into them. A Linear4bit's state dict holds its quant state beside the packed weight
    (weight.absmax, weight.quant_map, ...), which it does not load back (torch: "Unexpected key(s)"); the frozen base
    is the one this run loaded, so the saved quant state is dropped where it equals the live one, and a different one
    is left for the load to refuse (toolkit.checkpoint.same_model's line)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            module._register_load_state_dict_pre_hook(_same_quant_state, with_module=True)
    return model


def _same_quant_state(module, state_dict, prefix, *args) -> None:
    quant_state = getattr(module.weight, "quant_state", None)
    if quant_state is None:
        return
    for key, live in quant_state.as_dict(packed=True).items():
        saved = state_dict.get(prefix + "weight." + key)
        if saved is not None and torch.equal(saved.to(live.device), live):
            del state_dict[prefix + "weight." + key]


def quantization_config(cfg: AdapterConfig, on_gpu: bool, mixed_precision: str, storage: torch.dtype | None = None):
    """The 4-bit NF4 load of the QLoRA paper (double quantisation); None for another method. It computes in bf16 on a
    GPU (the paper's), and on the CPU in the run's precision: fp32 unless train.mixed_precision=bf16. `storage`: the
    dtype the packed 4-bit bytes are held in (bitsandbytes' quant_storage, uint8 by default), see qlora_storage."""
    if cfg.method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if on_gpu or mixed_precision == "bf16" else torch.float32,
        bnb_4bit_quant_storage=storage or torch.uint8,
    )


def _linear_rank(module: torch.nn.Module) -> int:
    return min(module.in_features, module.out_features)


# Each kind of layer a LoRA may adapt (target_modules names a layer by the last part of its name), with its full
# rank: min(rows, columns) of its weight, past which a LoRA's rank adds parameters and nothing it can express. A
# layer of another kind is refused; subclasses count as their kind (Gemma's scaled embedding is an Embedding). What
# the merge makes of each kind, on a base with tied and untied embeddings, is MERGES below; Linear4bit and
# Linear8bitLt are bitsandbytes' 4- and 8-bit bases (QLoRA's is the 4-bit one).
ADAPTABLE = {
    "Linear": _linear_rank,
    "Conv1D": lambda module: min(module.weight.shape),  # GPT-2's linear layers, weight stored (in, out)
    "Embedding": lambda module: min(module.num_embeddings, module.embedding_dim),
    "Linear4bit": _linear_rank,
    "Linear8bitLt": _linear_rank,
}

# How the merged model (final/ with adapter.merge=true; export --merge-lora of an adapter or a LoRA checkpoint)
# comes to equal the base with the adapter on top, for each target and each other switch of the adapter section.
# tests/toolkit/models/test_adapter.py walks every row (tied and untied bases) and fails for an AdapterConfig field,
# method or target kind that has none.
UNTIED = ("merged into its own copy of the matrix that a base with tie_word_embeddings shares between embed_tokens "
          "and lm_head; the merged model is untied (config tie_word_embeddings=false, one vocab x hidden matrix more)")
MERGES = {
    "target_modules": {
        "attention": "W += (alpha / r) B A on q_proj, k_proj, v_proj, o_proj (GPT-2: c_attn, c_proj)",
        "mlp": "W += (alpha / r) B A on gate_proj, up_proj, down_proj (GPT-2: c_fc, c_proj)",
        "embed_tokens": "W += (alpha / r) (B A)^T; " + UNTIED,
        "lm_head": "W += (alpha / r) B A; " + UNTIED,
        "all-linear": "every linear layer but lm_head, as attention and mlp",
    },
    "method": {
        "full": "nothing to merge: final/ is the trained model",
        "lora": "the rows of target_modules",
        "qlora": "merged into the base reloaded in full precision, which the 4-bit base it trained on only "
                 "approximates",
    },
    "r": "the rank of B A; above the largest min(in, out) of the adapted layers it is refused before training",
    "alpha": "the scale alpha / r (alpha / sqrt(r) with rslora) of the update merged",
    "dropout": "off in the model merged and in the one compared (eval)",
    "dora": "W' = m (W + s B A) / |W + s B A| row by row, DoRA's magnitude merged in",
    "rslora": "the scale alpha / sqrt(r)",
    "modules_to_save": "the trained copy replaces the module; embed_tokens or lm_head of a tied base: " + UNTIED,
    "layers": "only the layers named carry an update; the others stay the base's",
    "merge": "whether final/ is written at all (the adapter alone otherwise)",
}
# walked by the QLoRA recipe runs instead (tests/recipes/test_finetune_qlora.py: merged, exported), not by the table's
NOT_WALKED = ("Linear4bit", "Linear8bitLt", "qlora")


def layer_kind(module: torch.nn.Module) -> str | None:
    """The row of ADAPTABLE that `module` is (its class or the nearest base class named there), or None."""
    return next((k.__name__ for k in type(module).__mro__ if k.__name__ in ADAPTABLE), None)


def adaptable_names(model: torch.nn.Module) -> list[str]:
    """Last name parts of the model's layers a LoRA can adapt (what target_modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and layer_kind(module)})


def _adapted(model: torch.nn.Module, cfg: AdapterConfig) -> dict[str, torch.nn.Module]:
    """The layers this LoRA config puts an adapter on (all-linear: every linear layer but the head), by name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = {}
    for name, module in model.named_modules():
        kind = layer_kind(module)
        if kind is None or not name:
            continue
        if cfg.target_modules == ["all-linear"]:
            if kind == "Embedding" or module is head:
                continue
        elif name.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        if cfg.layers and _layer_index(name) not in cfg.layers:  # peft's layers_to_transform
            continue
        out[name] = module
    return out


def _layer_index(name: str) -> int | None:
    found = re.search(r"\.(?:layers|h)\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else None


def _check_rank(model: torch.nn.Module, cfg: AdapterConfig) -> None:
    """A rank above min(in, out) of every adapted layer is a larger adapter (r=100000 on 128-wide layers: 3.7 GB for
    a 5 MB model) with nothing more it can express: refused before a byte of it is built."""
    ranks = {name: ADAPTABLE[layer_kind(module)](module) for name, module in _adapted(model, cfg).items()}
    if not ranks:
        return
    name, useful = max(ranks.items(), key=lambda item: item[1])
    if cfg.r > useful:
        raise UserError(
            f"adapter.r={cfg.r} is more than the adapted layers can use: a LoRA of rank r on a layer of in x out has "
            f"the expressiveness of rank min(in, out), and the largest here is {useful} ({name.rsplit('.', 1)[-1]}); "
            f"set adapter.r to at most {useful} (or use adapter.method=full to train every weight)"
        )


def apply_adapter(model: torch.nn.Module, cfg: AdapterConfig) -> tuple[torch.nn.Module, str]:
    """The model to train and a line for the log (trainable parameter count)."""
    if not cfg.is_lora:
        n = sum(p.numel() for p in model.parameters())
        return model, f"weights: full fine-tune, {n:,} trainable parameters"
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.target_modules != ["all-linear"]:
        present = adaptable_names(model)
        missing = [t for t in cfg.target_modules if t not in present]
        if missing:
            raise UserError(
                f"adapter.target_modules {missing} match no layer of this {type(model).__name__}; "
                f"its linear and embedding layers are {', '.join(present)} (or use [all-linear])"
            )
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [m for m in cfg.modules_to_save if m not in names]
    if unknown:
        raise UserError(f"adapter.modules_to_save {unknown} name no module of this {type(model).__name__}; "
                        "name them as the model does (e.g. embed_tokens, lm_head)")
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if depth is not None and any(i >= depth for i in cfg.layers):
        raise UserError(f"adapter.layers={cfg.layers}: this {type(model).__name__} has layers 0-{depth - 1}")
    _check_rank(model, cfg)
    untie = tied_and_adapted(model, cfg)
    kinds = {layer_kind(module) for module in _adapted(model, cfg).values()}
    tokens = _new_token_rows(model, cfg)
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
        fan_in_fan_out=kinds == {"Conv1D"},  # GPT-2's weights are stored (in, out); peft warns and sets it otherwise
        trainable_token_indices=tokens or None,
    )
    try:
        with no_tied_warnings():  # said in the line returned, and taken care of by merged()
            model = get_peft_model(model, lora)
    except ValueError as exc:  # peft's refusals of this config on this model, as one line
        hint = ("set adapter.dropout=0: peft's LoRA on a mixture of experts' expert weights (all-linear takes them "
                "too) has no dropout" if "lora_dropout" in str(exc) else "change the adapter section")
        raise UserError(f"peft cannot put this LoRA on {type(model).__name__} ({str(exc).strip()}); {hint}") from None
    trainable, total = model.get_nb_trainable_parameters()
    kind = "+".join([cfg.method, *(["dora"] if cfg.dora else []), *(["rslora"] if cfg.rslora else [])])
    where = f" of layers {cfg.layers}" if cfg.layers else ""
    whole = f", {', '.join(cfg.modules_to_save)} trained whole" if cfg.modules_to_save else ""
    whole += f", the rows of model.new_tokens on {' and '.join(tokens)}" if tokens else ""
    tied = (f"; this base ties its embedding and head (tie_word_embeddings) and the adapter changes {' and '.join(untie)}: "
            "the merged model unties them (one vocab x hidden matrix more)" if untie else "")
    return model, (
        f"weights: {kind} r={cfg.r} alpha={cfg.alpha:g} on {', '.join(cfg.target_modules)}{where}{whole}: "
        f"{trainable:,} trainable of {total:,} parameters ({trainable / total:.2%}){tied}"
    )


def _new_token_rows(model: torch.nn.Module, cfg: AdapterConfig) -> dict[str, list[int]]:
    """peft's trainable_token_indices for model.new_tokens' rows: on the embedding (peft ties a tied head to it), and
    on an untied head; none for a module modules_to_save already trains whole."""
    ids = new_token_ids(model)
    if not ids:
        return {}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    layers = [embed] if head is None or head.weight is embed.weight else [embed, head]
    names = [next(n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is layer) for layer in layers]
    return {name: ids for name in names if name not in cfg.modules_to_save}


BASE_MODEL_FILE = "base_model.json"  # how the base was loaded (toolkit.models.base_model.BaseModelConfig)


def load_with_adapter(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The base with the saved adapter on top (what an inference user does with the folder)."""
    from peft import PeftModel

    with no_tied_warnings():
        return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def merge(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """An ordinary transformers model with the adapter's update added into the base weights."""
    return merged(load_with_adapter(base, adapter_dir))


def merged(peft_model: torch.nn.Module) -> torch.nn.Module:
    """The peft model as an ordinary transformers model, its adapter added into the base weights: the same logits.

    A base with tie_word_embeddings holds one matrix as both embed_tokens and lm_head; peft's merge of an adapter on
    either adds the update to that one matrix, so to both (issue 44: the loss went from 7.88 to 9.45). Here each
    gets its own copy first, as peft's own warning advises, and the merged model says it is untied (MERGES)."""
    untied = untie_adapted(peft_model)
    with no_tied_warnings():
        model = peft_model.merge_and_unload()
    if untied:
        model.config.tie_word_embeddings = False
    return model


def untie_adapted(peft_model: torch.nn.Module) -> list[str]:
    """Give each module its own copy of a weight it shares with another when an adapter (a LoRA or a trained copy,
    modules_to_save) sits on one of them; the names of the modules that got a copy."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    wrapped = [name for name, module in peft_model.named_modules()
               if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))]
    owners: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    for name, module in peft_model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if not any(o[1] is module for o in owners.get(id(param), [])):
                owners.setdefault(id(param), []).append((name, module, attr))
    copies = []
    for shared in owners.values():
        if len(shared) > 1 and any(name.startswith(w + ".") or name == w for name, _, _ in shared for w in wrapped):
            for name, module, attr in shared[1:]:
                param = getattr(module, attr)
                setattr(module, attr, torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
                copies.append(name.removesuffix(".base_layer").removesuffix(".original_module").rsplit(".", 1)[-1])
    return copies


def tied_and_adapted(model: torch.nn.Module, cfg: AdapterConfig) -> list[str]:
    """embed_tokens or lm_head (as the model names them) that this LoRA config adapts on a base that ties them."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    tied = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if any(module is m for m in tied)}
    adapted = {name.rsplit(".", 1)[-1] for name in _adapted(model, cfg)} | set(cfg.modules_to_save)
    return sorted(names & adapted)


# peft's words for what merged() does about tied embeddings (a warning at each LoRA built, loaded or merged)
_TIED_WARNINGS = ("Model has `tie_word_embeddings=True` and a tied layer is part of the adapter",
                  "Model with `tie_word_embeddings=True` and the tied_target_modules",
                  "Input and output embeddings are no longer tied after merging")


@contextmanager
def no_tied_warnings():
    with warnings.catch_warnings():
        for text in _TIED_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)
        yield
