"""The models the planner's tests estimate, on the meta device: the sharding probe's (its sizes, or another
architecture of them) and a 1B LLaMA."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from toolkit.config.load import load_config
from toolkit.models.scratch import hf_config
from toolkit.training.recipe_config import PretrainConfig

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


PROBE_SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=32, use_cache=False)


def probe_model(config_class=LlamaConfig) -> torch.nn.Module:
    """tests/support/sharding_probe.py's model (or another architecture of its sizes), on the
    meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_class(**PROBE_SIZES))


def llama_1b() -> torch.nn.Module:
    cfg = load_config(PretrainConfig, ROOT / "recipes/configs/pretrain_llama_1b.yaml", [])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(cfg.model, cfg.tokenizer.vocab_size, 0, None))
