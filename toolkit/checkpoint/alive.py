"""Whether the weights a checkpoint holds are a live model: no weight NaN or inf on any rank (checked after a load,
and at each save, so that rotation keeps the last checkpoint that passed), and not a dead model (the first step after
a load guessing uniformly with a gradient norm of exactly 0: finite garbage)."""

from __future__ import annotations

import math

import torch
from accelerate.utils import gather_object

from toolkit.models.adapter import layer_kind
from toolkit.strategy.family import held_values

DEAD_LOSS_RTOL = 1e-3  # how close to ln(vocab size) a loss is uniform guessing


def nonfinite_weight(accelerator, model: torch.nn.Module) -> str | None:
    """Collective: the name of a weight holding NaN or inf on some rank (each checks its own part), or None. A 4-bit
    weight (QLoRA's bitsandbytes Linear4bit) is packed bytes, not numbers: held in a float dtype for FSDP2, some read
    as NaN; it is frozen, the base's, and left out."""
    packed = {f"{name}.weight" for name, m in model.named_modules() if layer_kind(m) == "Linear4bit"}
    params = [(name, held_values(p).detach()) for name, p in model.named_parameters() if name not in packed]
    flags = [torch.isfinite(t).all() for _, t in params if t.numel()]
    # one host sync for all weights; the names only when something is wrong
    found = None
    if flags and not bool(torch.stack(flags).all()):
        found = next(name for name, t in params if t.numel() and not bool(torch.isfinite(t).all()))
    names = gather_object([found])
    return next((name for name in names if name is not None), None)


def dead_model(loss: float, grad_norm: float | None, vocab_size: int) -> bool:
    """Uniform predictions over the vocabulary and not a single gradient: nothing left to train."""
    uniform = math.log(vocab_size)
    return grad_norm is not None and float(grad_norm) == 0.0 and abs(loss - uniform) <= DEAD_LOSS_RTOL * uniform


def dead_after_resume(loss: float, grad_norm, vocab_size: int | None, preference: bool) -> str | None:
    """What the first step after a resume got that only a dead model gets ("gave a loss of ..."), or None. A preference
    loss is not a token loss: there, no gradient at all is the sign (a pair's loss has one wherever the model is alive,
    its first step included)."""
    if preference:
        if grad_norm is not None and float(grad_norm) == 0.0:
            return "got a gradient norm of exactly 0 (its weights are garbage, e.g. zeroed)"
        return None
    if vocab_size and dead_model(loss, grad_norm, vocab_size):
        return (f"gave a loss of {loss:.4f}, ln(vocabulary {vocab_size}) = uniform guessing, and a gradient norm of "
                "exactly 0 (its weights are garbage, e.g. a flipped exponent bit)")
    return None
