"""Weights and steps that are not numbers: what the trainer checks, and the test-only injection.

The step itself (toolkit.training.step) finds a NaN/inf loss or gradient before the optimizer
step and every rank agrees; the trainer skips or aborts (train.on_nonfinite). This module holds
what else guards a run:

- `nonfinite_weight`: the first weight that is NaN or inf on any rank (after a resume, and for
  each checkpoint saved, so that rotation never prunes the last checkpoint that passed).
- `dead_model`: the first step after a resume predicted uniformly (loss = ln(vocab size)) and
  got a gradient norm of exactly 0: weights that are finite but garbage (a flipped exponent bit
  can zero a norm's gain), on which training would go on learning nothing.
- `injected`: non-finite values on chosen steps and ranks, for the tests only:

    LLM_TOOLKIT_NONFINITE="batch@3/1,grad@5"    kind@step[/rank], comma separated (no rank: rank 0)

  batch  the embedding's output is NaN: loss and gradients (a corrupt batch, an overflow)
  loss   the loss is NaN, the gradients stay finite
  grad   the gradients are NaN, the loss stays finite

  Unset (always, outside the tests), `injected` costs one environment lookup per step.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from accelerate.utils import gather_object

from toolkit.strategy.backends.base import held_values

ENV = "LLM_TOOLKIT_NONFINITE"
KINDS = ("batch", "loss", "grad")
DEAD_LOSS_RTOL = 1e-3  # how close to ln(vocab size) a loss is uniform guessing


def _planned(step: int) -> set[str]:
    """The kinds to inject on this rank at `step`."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return set()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kinds = set()
    for item in spec.split(","):
        head, _, at_rank = item.strip().partition("/")
        kind, _, at_step = head.partition("@")
        if kind not in KINDS or not at_step:
            raise RuntimeError(f"{ENV}: {item.strip()!r} is not kind@step[/rank] with a kind among {', '.join(KINDS)}")
        if int(at_step) == step and int(at_rank or 0) == rank:
            kinds.add(kind)
    return kinds


class _PoisonedLoss(torch.autograd.Function):
    """A NaN in every position's first logit (a loss already computed in the head, under
    model.loss=chunked: the loss itself), so that no ignored target can mask it; the backward
    passes on finite gradients."""

    @staticmethod
    def forward(ctx, output):
        output = output.clone()
        if output.dim() == 0:
            output.fill_(float("nan"))
        else:
            output[..., 0] = float("nan")
        return output

    @staticmethod
    def backward(ctx, grad):
        return torch.nan_to_num(grad, nan=0.0)


@contextlib.contextmanager
def injected(model, step: int):
    """Hooks putting the planned non-finite values into `model` (unwrapped) during `step` (1-based)."""
    kinds = _planned(step) if ENV in os.environ else ()
    handles = []
    embedding = model.get_input_embeddings() if kinds else None
    if "batch" in kinds:
        handles.append(embedding.register_forward_hook(lambda module, inputs, output: output * float("nan")))
    if "grad" in kinds:
        def on_output(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda grad: grad * float("nan"))

        handles.append(embedding.register_forward_hook(on_output))
    if "loss" in kinds:
        head = model.get_output_embeddings()
        handles.append(head.register_forward_hook(lambda module, inputs, output: _PoisonedLoss.apply(output)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def nonfinite_weight(accelerator, model: torch.nn.Module) -> str | None:
    """Collective: the name of a weight holding NaN or inf on some rank (each checks its own part), or None."""
    params = [(name, held_values(p).detach()) for name, p in model.named_parameters()]
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
