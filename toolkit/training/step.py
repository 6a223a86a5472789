"""One optimizer step over a rank's micro-batches, with gradient accumulation.

Shared by the recipes so that every one of them normalises the loss the same way: each
micro-batch's summed token loss is scaled by `toolkit.models.loss.backward_scale` (target tokens of
the whole global batch), Accelerate decides when gradients are synchronised and the optimizer
really steps, and clipping happens once, on the accumulated gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from accelerate import Accelerator

from toolkit.models.loss import forward_loss_sum


def optimizer_step(
    accelerator: Accelerator,
    model,
    optimizer,
    micro_batches: Iterable[dict[str, torch.Tensor]],
    scale: float,
    max_grad_norm: float,
    loss_chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(this rank's summed token loss as float64, the pre-clipping gradient norm or None).

    `loss_chunk_tokens` > 0: the loss is computed that many tokens at a time (model.loss=chunked).
    """
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    grad_norm = None
    for batch in micro_batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.accumulate(model):
            micro_loss = forward_loss_sum(model, batch, loss_chunk_tokens)
            accelerator.backward(micro_loss * scale)
            loss_sum += micro_loss.detach().double()
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm
