"""How any model trains, whether built from scratch or loaded pretrained: the attention kernel
and activation recomputation. Both recipes' `model` sections share these fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from toolkit.config import field


@dataclass
class ComputeConfig:
    attn_implementation: str = field("sdpa", help="sdpa (CPU/GPU) or flash_attention_2 (GPU)")
    gradient_checkpointing: Literal["none", "full", "every_k"] = field(
        "none", help="recompute activations in the backward: none, full (every layer) or every_k"
    )
    gradient_checkpointing_k: int = field(2, help="with every_k: checkpoint every k-th decoder layer")

    def validate(self) -> list[str]:
        if self.gradient_checkpointing_k < 1:
            return [f"gradient_checkpointing_k={self.gradient_checkpointing_k} must be at least 1"]
        return []
