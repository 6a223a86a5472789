"""`torch.compile` in place (`model.compile`): each decoder layer (`layers`) or the whole forward with its loss
(`model`).

In place (`module.compile()`), not `torch.compile(module)`: the module keeps its class and its parameter names
for checkpoints, FSDP and DeepSpeed. It runs before the strategy wraps the model; compilation itself happens at
the first forward, when every wrapper's hooks are in place.
What each mode compiles, and why: docs/internals.md, toolkit/models/compilation.py.
"""

from __future__ import annotations

import torch

from toolkit.config.errors import UserError
from toolkit.models.loss import put_loss_in_forward, unwrapped


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder layers (the classes transformers keeps whole: `_no_split_modules`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in base.modules() if type(m).__name__ in names]


def compile_model(model: torch.nn.Module, how: str) -> None:
    """`how`: "none", "layers" or "model" (model.compile; where "model" does not run, the launch refused it:
    toolkit.config.combinations)."""
    if how == "layers":
        compile_layers(model)
    elif how == "model":
        inner = unwrapped(model)
        put_loss_in_forward(inner)
        inner.compile()


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer in place; returns how many."""
    layers = decoder_layers(model)
    if not layers:
        raise UserError(
            f"model.compile=layers: {type(model).__name__} names no decoder layer class to compile "
            "(transformers' _no_split_modules); set model.compile=model or none"
        )
    # As Accelerate does for compiled layers under activation checkpointing: the recompute in the
    # backward must not replay the forward's Python side effects.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile()
    return len(layers)
