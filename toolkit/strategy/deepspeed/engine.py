"""DeepSpeed's optimizer step, with the update dropped when a loss or gradient is not finite.

The step runs the engine's backward itself (Accelerate's would call `engine.step()` at once), then
`engine.step()` with the ZeRO optimizer's update made conditional on the global gradient norm: a dropped
update leaves the masters, Adam's state and the scheduler as they were, and is counted as DeepSpeed's own
overflow skips are (`global_steps` moves on, `skipped_steps` + 1).
Why, and what DeepSpeed drops itself: docs/internals.md, toolkit/strategy/deepspeed/engine.py.
"""

from __future__ import annotations

import math

import torch


def engine_of(accelerator):
    """The DeepSpeed engine a DeepSpeed launch trains through; None under any other strategy."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


def engine_backward(engine, loss: torch.Tensor, boundary: bool) -> None:
    """Accelerate's DeepSpeed backward without its `engine.step()`: the engine scales by the
    accumulation itself, and reduces the gradients on the last micro-batch (`boundary`)."""
    engine.set_gradient_accumulation_boundary(is_boundary=boundary)
    engine.backward(loss)


def _invalid(norm) -> bool:
    """DeepSpeed reports a norm over non-finite gradients as inf, NaN or -1."""
    value = float(norm)
    return not math.isfinite(value) or value < 0


def engine_step_unless_nonfinite(engine, loss_nonfinite: bool) -> str | None:
    """Collective: `engine.step()`, whose update is dropped when `loss_nonfinite` (already agreed
    by every rank) or when the global gradient norm is not finite. None if the update was made,
    else what was not finite: "loss" or "grad"."""
    zero = engine.optimizer
    # the torch optimizer(s) ZeRO steps on its partitions (ZeRO-3 partial offload has two); without
    # ZeRO in fp32, the engine's optimizer is the torch optimizer itself
    inner = [o for o in (getattr(zero, "optimizer", None), getattr(zero, "backup_optimizer", None)) if o is not None]
    inner = inner or [zero]
    check_grads = not engine.fp16_enabled()
    verdict: list[str | None] = []  # decided at the first update call: ZeRO-3 makes one per sub-group
    scheduler = engine.lr_scheduler

    def guarded(real_step):
        def step(*args, **kwargs):
            if not verdict:
                norm = getattr(zero, "_global_grad_norm", None)  # this step's, set before the update
                grads_bad = check_grads and norm is not None and _invalid(norm)
                verdict.append("loss" if loss_nonfinite else "grad" if grads_bad else None)
                if verdict[0] is not None:
                    engine.lr_scheduler = None  # stepped after the update unless None; restored below
            if verdict[0] is None:
                return real_step(*args, **kwargs)
            return None

        return step

    own = [vars(optimizer).get("step") for optimizer in inner]  # an instance's own step, if it has one
    for optimizer in inner:
        optimizer.step = guarded(optimizer.step)
    try:
        engine.step()
    finally:
        for optimizer, step in zip(inner, own, strict=True):
            if step is None:
                del optimizer.step  # the class's method again
            else:
                optimizer.step = step
        engine.lr_scheduler = scheduler
    if not verdict:  # the update was never reached
        if engine.was_step_applied():
            return None
        # DeepSpeed's own overflow path dropped it (and counted it)
        return "loss" if loss_nonfinite else "grad" if check_grads else None
    if verdict[0] is not None:
        engine.skipped_steps += 1
        engine._step_applied = False  # what was_step_applied() reports
    return verdict[0]
