"""One optimizer step over a rank's micro-batches, with gradient accumulation.

Each micro-batch's summed token loss is scaled by `toolkit.models.loss.backward_scale` (target tokens of the
whole global batch), and clipping happens once, on the accumulated gradient. No rank steps if any rank's loss
or gradients hold a NaN or inf (one all-reduce of two flags, decided on the host or, under
train.step_sync=none, on the device).
Where the decision is taken under each setting: docs/internals.md, toolkit/training/step.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from accelerate import Accelerator

from toolkit.config.errors import UserError
from toolkit.models.loss import forward_loss_sum, on_targets, with_target_rows
from toolkit.models.preference_loss import STATS, PreferenceLoss
from toolkit.models.router import RouterLoss
from toolkit.strategy.family import DATA_PARALLEL, Family, nonfinite_flags, verdict


class Diverged(Exception):
    """A NaN/inf loss or gradient with train.on_nonfinite=abort, or train.max_nonfinite_skips
    skipped steps in a row; raised on every rank at the same step, before that step's update.
    The message is the run's one `error:` line."""


def optimizer_step(
    accelerator: Accelerator,
    model,
    optimizer,
    micro_batches: Iterable[dict[str, torch.Tensor]],
    scale: float,
    max_grad_norm: float,
    loss_chunk_tokens: int = 0,
    router: RouterLoss | None = None,
    objective: PreferenceLoss | None = None,
    skip_on_device: bool = False,
    weight_cast=None,
    family: Family = DATA_PARALLEL,
) -> tuple[torch.Tensor, torch.Tensor | None, str | torch.Tensor | None, torch.Tensor]:
    """(this rank's summed loss as float64, the pre-clipping gradient norm or None, what was not
    finite, this rank's sums of what else it counts: the router loss, then the objective's STATS).

    The third value is None when the optimizer stepped; "loss" (a rank's loss was NaN/inf) or
    "grad" (the gradients were) when it did not: weights and optimizer state are untouched and
    the gradients cleared, the same on every rank.
    `loss_chunk_tokens` > 0: the loss is computed that many tokens at a time (model.loss=chunked).
    `router` (a mixture of experts, toolkit.models.router): each micro-batch's router loss joins
    its loss with weight router.coef, so that the gradient is of the mean over all ranks'
    micro-batches (the backward's division by ranks x accumulation does the averaging); the
    fourth value sums the unweighted router losses (zero for a model without routers).
    `objective` (a preference objective, toolkit.models.preference_loss): each micro-batch gives its
    pairs' summed loss in place of the token loss, and `scale` divides by the global batch's pairs.
    `skip_on_device` (train.step_sync=none, `skips_on_device`): the fused optimizer skips on the device, and the
    third value is the flags [loss, grad] (counts of ranks, on the device) in place of the verdict.
    `weight_cast` (model.cast_weights=per_step, toolkit.models.weight_cast): its copies go after the last backward.
    """
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    router_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    stats = torch.zeros(len(STATS) if objective is not None else 0, device=accelerator.device, dtype=torch.float64)
    grad_norm = nonfinite = None
    rows = on_targets(model)  # model.loss_positions=targets: the rows found before the batch leaves the host
    for batch in micro_batches:
        batch = on_device(with_target_rows(batch) if rows else batch, accelerator.device)
        with accelerator.accumulate(model):
            if router is not None:
                router.start()
            if objective is None:
                token_sum = forward_loss_sum(model, batch, loss_chunk_tokens)
            else:
                token_sum, micro_stats = objective.sums(model, batch)
                stats += micro_stats.double()
            micro_loss = token_sum * scale
            if router is not None:
                router_loss = router.loss()
                router_sum += router_loss.detach().double()
                micro_loss = micro_loss + router.coef * router_loss
            loss_sum += token_sum.detach().double()
            family.backward(accelerator, micro_loss)
            if accelerator.sync_gradients:
                grad_norm, nonfinite = family.update(accelerator, model, optimizer, loss_sum + router_sum,
                                                      max_grad_norm, skip_on_device, weight_cast)
    return loss_sum, grad_norm, nonfinite, torch.cat([router_sum[None], stats])


def on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors copied to `device` without waiting for it. A blocking copy from pageable host memory waits
    for the GPU's queue to drain first: on an H200 that idled the GPU 2-7 ms at every micro-batch's start (4 % of a
    1B step). A non-blocking one stages the host memory at once and queues the copy behind the work already queued."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def skips_on_device(setting: str, accelerator: Accelerator, optimizer, family: Family = DATA_PARALLEL) -> bool:
    """Whether train.step_sync (`setting`: auto, host or none) leaves the skip decision on the device:
    only torch's fused AdamW takes it there. auto: wherever that optimizer steps; none: refused elsewhere."""
    inner = getattr(optimizer, "optimizer", optimizer)
    why = host_decides(family, accelerator.scaler is not None,
                       type(inner) is torch.optim.AdamW and bool(inner.defaults.get("fused")))
    check_step_sync(setting, why)
    return setting != "host" and why is None


def host_decides(family: Family, fp16: bool, fused: bool) -> str | None:
    """Why a non-finite step's skip is decided on the host under `family` (fp16's loss scaler, torch's `fused` AdamW),
    or None where the optimizer can skip it on the device."""
    return (family.host_decides if family.host_decides is not None
            else "fp16's loss scaler decides on the host" if fp16
            else "it needs torch's fused AdamW (optim.fused=true; auto fuses on CUDA only)" if not fused else None)


def check_step_sync(setting: str, why: str | None) -> None:
    """train.step_sync=none where the host decides (`why`, host_decides), refused in one line. The launch asks it
    from the config (the family, the precision, optim.fused on this device) before any data or model."""
    if setting == "none" and why is not None:
        raise UserError(f"train.step_sync=none cannot skip a non-finite step on the device here: {why}; "
                        "use train.step_sync=auto or host")


def pipeline_step(
    accelerator: Accelerator,
    pipeline,
    optimizer,
    micro_batches: Iterable[dict[str, torch.Tensor]],
    scale: float,
    max_grad_norm: float,
    meter=None,
) -> tuple[torch.Tensor, torch.Tensor, str | None, torch.Tensor]:
    """optimizer_step's contract for a model cut into pipeline stages (toolkit.strategy.pipeline.stages):
    the schedule runs every micro-batch's forward and backward, the gradients are clipped by the whole
    model's norm, and the optimizer steps unless a loss or gradient is not finite on some rank. The
    loss is the last stage's (0 on the others: a sum over ranks counts every token once). `meter`
    (toolkit.strategy.sharding.GradientMeter) measures the gradients held before the update."""
    loss_sum = pipeline.step(list(micro_batches), scale)
    grad_norm = pipeline.clip_grad_norm_(max_grad_norm)
    if meter is not None:
        meter.measure(at_boundary=True)
    nonfinite = verdict(nonfinite_flags(accelerator, loss_sum, grad_norm).tolist())
    if nonfinite is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, nonfinite, torch.zeros(1, dtype=torch.float64, device=accelerator.device)
