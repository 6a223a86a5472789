"""Build a causal LM from any transformers `model_type` plus sizes, with validated keys."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from toolkit.config.declarations import ALWAYS, SHAPE, free, refused
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.config.values import name_problems
from toolkit.data.packing import MASKED_ATTENTION
from toolkit.models.compute import ComputeConfig


@dataclass
class ModelConfig(ComputeConfig):
    model_type: str = field("llama", help="any transformers model_type with a causal LM head: llama, gpt2, qwen2, "
                            "mistral, ...", resume=refused(SHAPE), used_when=ALWAYS, path=None)
    config: dict[str, Any] = field(default_factory=dict, help="architecture sizes passed to the transformers config",
                                   resume=refused(SHAPE), used_when=ALWAYS, path=None)
    init_seed: int | None = field(
        None, help="seed for the random init; default: the run's seed", resume=free("the weights come from the checkpoint"),
        used_when=ALWAYS, accepts={"unset": "the run's seed", **dict.fromkeys(("0", "-1", "2**31"),
                                                                            "torch takes any 64-bit seed")},
    )

    def __post_init__(self):
        if self.model_type in CONFIG_MAPPING:
            self.config = _floats_where_expected(self.model_type, self.config)

    def validate(self) -> list[str]:
        problems = super().validate()
        if named := name_problems(self, ("model_type",), "give a transformers model type, e.g. llama"):
            problems += named
        elif self.model_type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(self.model_type, list(CONFIG_MAPPING), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"model_type={self.model_type[:60]} is not a transformers model type{hint}")
        elif self.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            # caught here, before any data work: transformers' own error lists ~190 classes
            problems.append(
                f"model_type={self.model_type} has no causal LM in transformers (it is not a text decoder); "
                "use one that has, e.g. llama, gpt2, qwen2, mistral"
            )
        else:
            unknown = _unknown_config_keys(self.model_type, self.config)
            problems += ([f"config.{p}" for p in unknown] or _sizes_below_one(self.model_type, self.config)
                         or _sizes_that_do_not_divide(self.model_type, self.config) or _unknown_activations(self.config)
                         or _eps_not_positive(self.config) or _wrong_types(self.model_type, self.config))
        return problems

    def positions(self) -> int | None:
        """The most positions the model takes (None where it has no limit, or model.config is refused already)."""
        try:
            return max_positions(AutoConfig.for_model(self.model_type, **self.config))
        except Exception:  # a wrong model_type or size: validate() names it
            return None


# a config built from scratch takes its special tokens from the tokenizer (hf_config): transformers' defaults
# (GPT-2's 50256) lie outside a trained tokenizer's smaller vocabulary, and its config warns of each
NO_SPECIAL_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def hf_config(cfg: ModelConfig, vocab_size: int, eos_id: int, pad_id: int | None) -> PretrainedConfig:
    kwargs = dict(cfg.config)
    kwargs.setdefault("vocab_size", vocab_size)
    if kwargs["vocab_size"] < vocab_size:
        raise UserError(
            f"model.config.vocab_size={kwargs['vocab_size']} is smaller than the tokenizer's {vocab_size} tokens; "
            "remove it to take the tokenizer's size"
        )
    # the tokenizer's ids from the start: GPT-2's default 50256 in a smaller vocabulary made transformers warn twice
    config = AutoConfig.for_model(cfg.model_type, **{**kwargs, **NO_SPECIAL_IDS})
    config.eos_token_id = config.bos_token_id = eos_id
    config.pad_token_id = pad_id
    config.use_cache = False  # training; generate() turns it back on
    return config


def check_seq_len(cfg: ModelConfig, seq_len: int) -> None:
    """Fail before any data work if blocks would not fit the model's positions."""
    config = AutoConfig.for_model(cfg.model_type, **cfg.config)
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise UserError(
            f"data.seq_len={seq_len} is larger than the model's max positions ({limit}); "
            f"lower data.seq_len or raise model.config.max_position_embeddings"
        )
    check_window(config, seq_len, cfg.attn_implementation, "model.config.sliding_window")


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of a model whose layers (some or all) attend to the last `sliding_window` tokens only, or None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def check_window(config: PretrainedConfig, seq_len: int, attn_implementation: str, what: str) -> None:
    """Refuse blocks longer than a sliding window where packing's 4-D mask stands in for the model's own: transformers
    hands that mask to every layer as it is, so a sliding layer would see the whole block (measured on Gemma 2: logits
    off by 0.41 past the window)."""
    window = sliding_window(config)
    if window is not None and seq_len > window and attn_implementation in MASKED_ATTENTION:
        raise UserError(
            f"data.seq_len={seq_len} is longer than {what}={window}, and model.attn_implementation="
            f"{attn_implementation} keeps packed documents apart with a mask that would drop the window; use "
            f"data.seq_len={window} or less, or flex_attention / flash_attention_2 on a GPU"
        )


def meta_model(cfg: ModelConfig, vocab_size: int | None = None) -> torch.nn.Module:
    """The architecture without memory (meta device), to check layer names and sizes before any work;
    `vocab_size` where model.config does not set one (the tokenizer's)."""
    sizes = dict(cfg.config) if vocab_size is None else {"vocab_size": vocab_size, **cfg.config}
    config = AutoConfig.for_model(cfg.model_type, **{**sizes, **NO_SPECIAL_IDS})  # sizes only: no token ids
    # the class itself, not from_config: under a ZeRO-3 launch from_config partitions the model with
    # deepspeed.zero.Init and then initialises its weights, which a meta tensor cannot be copied from
    with torch.device("meta"):
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def describe_sizes(cfg: ModelConfig, config: PretrainedConfig) -> str:
    """model.config as an error names it; an empty one says that transformers' defaults were taken."""
    if not cfg.config:
        return (f"model.config is empty, so transformers' default {cfg.model_type} (hidden_size={config.hidden_size}, "
                f"num_hidden_layers={config.num_hidden_layers}) was taken; it")
    given = ", ".join(f"{k}={v}" for k, v in cfg.config.items())
    return f"model.config ({cfg.model_type}, {given[:100]}{'...' if len(given) > 100 else ''})"


def max_positions(config: PretrainedConfig) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def build_model(cfg: ModelConfig, config: PretrainedConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(cfg.init_seed if cfg.init_seed is not None else seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
    except (ValueError, ImportError) as exc:
        raise UserError(f"model.attn_implementation={cfg.attn_implementation} is not usable here: {exc}") from None
    return model


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = False) -> int:
    # a 4-bit weight (QLoRA's bitsandbytes Params4bit) packs its values into fewer elements: its own shape counts
    total = sum(math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None else p.numel()
                for p in model.parameters())
    if exclude_embeddings:
        emb = model.get_input_embeddings()
        if emb is not None:
            total -= emb.weight.numel()
    return total


def _floats_where_expected(model_type: str, values: dict[str, Any]) -> dict[str, Any]:
    """YAML and overrides read `0` or `1` as an int, and transformers' configs are strict dataclasses
    that refuse an int for a float field (router_aux_loss_coef=0, rope_theta=10000): made floats."""
    cls = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(cls):
        return values
    expected = {f.name: f.type for f in dataclasses.fields(cls)}

    def wants_float(kind) -> bool:
        return kind is float or (isinstance(kind, types.UnionType) and float in kind.__args__ and int not in kind.__args__)

    return {key: float(value) if wants_float(expected.get(key)) and type(value) is int else value
            for key, value in values.items()}


def _wrong_types(model_type: str, values: dict[str, Any]) -> list[str]:
    """A value of the wrong type for the transformers config, as one problem instead of its traceback."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        AutoConfig.for_model(model_type, **values)
    except (StrictDataclassError, TypeError, ValueError) as exc:
        named = re.search(r"for field '(\w+)'", str(exc))
        where = f"config.{named.group(1)}" if named else "config"
        return [f"{where}: {str(exc.__cause__ or exc).splitlines()[-1].strip()}"]
    return []


# the activation's key in each family's config: llama-style (qwen2, mistral, ...), gemma, gpt2
ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")


def _unknown_activations(values: dict[str, Any]) -> list[str]:
    """An activation transformers does not have: a KeyError traceback from its ACT2FN once the model is built."""
    from transformers.activations import ACT2CLS

    problems = []
    for key in ACTIVATION_KEYS:
        if key in values and values[key] not in ACT2CLS:
            close = difflib.get_close_matches(str(values[key]), sorted(ACT2CLS), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(f"config.{key}={values[key]!r} is not an activation transformers has; {hint}its activations "
                            f"are {', '.join(sorted(ACT2CLS))}")
    return problems


def _eps_not_positive(values: dict[str, Any]) -> list[str]:
    """A norm's epsilon (rms_norm_eps, layer_norm_eps, gpt2's layer_norm_epsilon) of 0 or less: the square root of a
    variance of 0 plus it is NaN, and the run 'diverged' at its first step, blaming optim.lr."""
    return [f"config.{key}={value} must be > 0 (the norm divides by the square root of the variance plus it: "
            "NaN where the variance is 0); use e.g. 1e-5"
            for key, value in values.items() if key.endswith(("_eps", "_epsilon")) and isinstance(value, (int, float))
            and not isinstance(value, bool) and not value > 0]


def _unknown_config_keys(model_type: str, sizes: dict[str, Any]) -> list[str]:
    reference = CONFIG_MAPPING[model_type]()
    known = set(reference.to_dict()) | set(getattr(reference, "attribute_map", {}))
    problems = []
    rope = reference.to_dict().get("rope_parameters") or {}
    for key in sizes:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            if key in rope:  # rope_theta, a key of its own before transformers 5 (older configs and recipes have it)
                hint = (f"; transformers keeps it in rope_parameters: write config.rope_parameters="
                        f"{{rope_type: {rope.get('rope_type', 'default')}, {key}: {sizes[key]}}}")
            problems.append(f"{key} is not a {model_type} config key{hint}")
    return problems


# Sizes every decoder has, by their standard names (a config's attribute_map gives its own: gpt2's n_layer).
POSITIVE_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                  "vocab_size", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
                  "num_experts_per_tok", "moe_intermediate_size")


def _sizes_below_one(model_type: str, values: dict[str, Any]) -> list[str]:
    """Sizes of 0 or less as written (before transformers divides by them): a model with no layers,
    heads or features trains nothing, or cannot be built."""
    aliases = {alias: std for std, alias in (getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {}).items()}
    return [f"config.{key}={value} must be at least 1 (with 0 the model has nothing to train, or cannot be built)"
            for key, value in values.items()
            if aliases.get(key, key) in POSITIVE_SIZES and isinstance(value, int) and not isinstance(value, bool)
            and value < 1]


def _sizes_that_do_not_divide(model_type: str, values: dict[str, Any]) -> list[str]:
    """The hidden size not divisible by the heads, or the heads by the KV heads (the model cannot be built),
    named as the YAML wrote them, or as the default where it did not."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        config, built = AutoConfig.for_model(model_type, **values), True
    except (StrictDataclassError, TypeError, ValueError):  # a class that checks the division itself, naming no key
        config, built = CONFIG_MAPPING[model_type](), False
    aliases = getattr(config, "attribute_map", {}) or {}

    def size(std: str) -> Any:
        """The size as built; where the build failed, as written, or the class's default (None for the KV heads,
        whose default follows the heads)."""
        for key in (std, aliases.get(std)):
            if key in values:
                return values[key]
        return getattr(config, std, None) if built or std != "num_key_value_heads" else None

    def named(std: str) -> str:
        for key in (std, aliases.get(std)):
            if key in values:
                return f"config.{key}={values[key]}"
        return f"config.{std}={getattr(config, std)} ({model_type}'s default)"  # a key of model.config, as written

    problems = []
    hidden, heads, kv = size("hidden_size"), size("num_attention_heads"), size("num_key_value_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and "head_dim" not in values and hidden % heads:
        own_head_dim = "head_dim" in config.to_dict()  # llama-style: heads x head_dim need not be the hidden size
        problems.append(f"{named('hidden_size')} is not divisible by {named('num_attention_heads')}; each head "
                        f"takes hidden_size / heads features: use a multiple{', or set head_dim' if own_head_dim else ''}")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        problems.append(f"{named('num_attention_heads')} is not divisible by {named('num_key_value_heads')}; "
                        "each key/value head serves a whole group of query heads")
    return problems
