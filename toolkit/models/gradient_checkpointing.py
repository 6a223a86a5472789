"""Activation (gradient) checkpointing: recompute layer activations in the backward pass.

Always non-reentrant: the reentrant variant breaks with ZeRO-3 and FSDP, which gather
parameters in hooks that the reentrant autograd function bypasses.
"""

from __future__ import annotations

import torch


def apply_gradient_checkpointing(model: torch.nn.Module, mode: str, every_k: int = 2) -> None:
    """`mode`: "none", "full" (every decoder layer) or "every_k" (every k-th layer)."""
    if mode == "none":
        return
    if mode not in ("full", "every_k"):
        raise ValueError(f"gradient checkpointing mode {mode!r}: use none, full or every_k")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; set it to none")
    every = 1 if mode == "full" else every_k
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:  # transformers < 5 names it differently and has no every_n_layers
        if every != 1:
            raise ValueError("every_k gradient checkpointing needs transformers >= 5")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
