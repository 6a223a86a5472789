"""DDP: a whole model and optimizer on every rank, gradients averaged by Accelerate's DistributedDataParallel."""

from __future__ import annotations

import torch

from toolkit.strategy.ddp import files
from toolkit.strategy.family import DataParallel, PlannedBuffers, Strategy, named_groups


class Ddp(DataParallel):
    """Its files (the whole model, an optimizer keyed by parameter order) are the same for any world size
    (measured on CPU): the default native resume, by files alone."""

    name = "ddp"
    files = files

    def optimizer_names(self, strategy: Strategy) -> list[list[str]] | None:
        """optimizer.bin numbers the parameters; the checkpoint says which is which (a conversion needs it)."""
        return named_groups(strategy)

    def planned_buffers(self, run, shapes, tensors, head, stage, grads_held, dtype_bytes) -> PlannedBuffers:
        """DistributedDataParallel's buckets hold a copy of every trainable gradient, in the weights' dtype."""
        if run.world == 1:
            return PlannedBuffers()
        trainable = sum(t.numel for t in tensors if t.trainable)
        return PlannedBuffers(static=trainable * (torch.finfo(run.param_dtype).bits // 8))


FAMILY = Ddp()
