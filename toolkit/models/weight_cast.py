"""The low-precision copy of the weights that mixed precision computes with, made once per optimizer step.

With model.cast_weights=per_step each nn.Linear computes with one copy made when the step starts
(`WeightCast.step`), through the same differentiable cast as autocast's; the optimizer keeps stepping the fp32
weights. One process and DDP only (FSDP2 and DeepSpeed cast their own way; the other layouts keep autocast).
Why, and what it saves: docs/internals.md, toolkit/models/weight_cast.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from toolkit.config.combinations import cast_refused
from toolkit.parallel_layout import ParallelLayout

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a mixed precision's compute dtype (Accelerate's names)


class _StepCastLinear(torch.nn.Linear):
    """An nn.Linear that computes with its weight's copy of this step while there is one."""

    step_weight: torch.Tensor | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight if self.step_weight is None else self.step_weight, self.bias)


class WeightCast:
    """The copies of `model`'s nn.Linear weights in `dtype`, made by `step()` for the length of a step (until
    `release()`, after the last backward). Subclasses of nn.Linear (4-bit bases, peft's layers) are left as they
    are; peft's base and adapter matrices are plain nn.Linear and are cast. The output head is left to autocast:
    the chunked loss reads its weight itself, and its copy (vocabulary x hidden) would be held through the backward."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # a weight already in `dtype` (a bf16 frozen base under LoRA) is its own copy: `.to` would hand back the
        # Parameter itself, which nn.Module's setattr takes for a new parameter
        self.linears = [m for m in model.modules()
                        if type(m) is torch.nn.Linear and m is not head and m.weight.dtype != dtype]
        for module in self.linears:
            module.__class__ = _StepCastLinear  # the same parameters and state dict; only forward reads the copy

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        copies: dict[int, torch.Tensor] = {}  # a weight two modules share is cast once
        for module in self.linears:
            if id(module.weight) not in copies:
                copies[id(module.weight)] = module.weight.to(self.dtype)
            module.step_weight = copies[id(module.weight)]
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """The copies go: the backward is done, and the optimizer step needs its memory."""
        for module in self.linears:
            module.step_weight = None


def applies(layout: ParallelLayout, autocast_dtype: torch.dtype | None) -> str | None:
    """Why the copy cannot be made once per step here, or None where it can (`auto_applies` for what auto takes)."""
    return cast_refused(layout, "no" if autocast_dtype is None else "bf16")


def auto_applies(setting: str, layout: ParallelLayout, autocast_dtype: torch.dtype | None, compile_mode: str) -> bool:
    """Whether model.cast_weights (`setting`) makes the copies once per step. auto also leaves the whole model
    compiled under DDP of several ranks to autocast: dynamo cuts that graph at the parameters for DDP's bucketed
    all-reduce, and the copies are not parameters (unmeasured: the overlap with the backward could go)."""
    if setting == "per_forward" or applies(layout, autocast_dtype) is not None:
        return False
    return setting == "per_step" or not (compile_mode == "model" and layout.kind == "ddp" and layout.world > 1)


def weight_cast(setting: str, model: torch.nn.Module, layout: ParallelLayout, autocast_dtype: torch.dtype | None,
                compile_mode: str = "none") -> WeightCast | None:
    """model.cast_weights (auto, per_forward or per_step) for this run: a WeightCast, or None for autocast's
    casts at every forward. auto = per_step where it applies; per_step elsewhere the launch refused
    (toolkit.config.combinations)."""
    if not auto_applies(setting, layout, autocast_dtype, compile_mode):
        return None
    return WeightCast(model, autocast_dtype)
