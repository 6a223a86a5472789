"""Which packed blocks each rank trains on at each optimizer step.

The order is a pure function of (seed, step): every rank can compute the whole global batch,
so the data position is just the step number (nothing to save for resume), a 2-process run
sees exactly the global batches of a 1-process run, and the loss normaliser (target tokens in
the global batch) is known on every rank without a collective.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from toolkit.config.errors import UserError


class BatchSchedule:
    def __init__(self, n_blocks: int, global_batch: int, micro_batch: int, world_size: int, rank: int, seed: int):
        if n_blocks < global_batch:
            raise UserError(
                f"the training data packs to {n_blocks} blocks, fewer than train.global_batch_size={global_batch}; "
                "add data, lower data.seq_len or lower train.global_batch_size"
            )
        self.n_blocks, self.global_batch, self.micro_batch = n_blocks, global_batch, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.steps_per_epoch = n_blocks // global_batch
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def global_indices(self, step: int) -> np.ndarray:
        epoch, offset = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:  # a fresh shuffle each epoch, reproducible from (seed, epoch)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.n_blocks, generator=gen).numpy()
        return self._order[offset * self.global_batch : (offset + 1) * self.global_batch]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's share of the global batch, cut into micro-batches."""
        per_rank = self.global_batch // self.world_size
        mine = self.global_indices(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch)]

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def steps_for(self, epochs: float) -> int:
        """The optimizer steps of `epochs` passes (train.epochs): at least one."""
        return max(1, math.ceil(epochs * self.steps_per_epoch))

    def epochs_said(self, epochs: float, steps: int) -> str:
        """train.epochs' line: its steps, and the blocks each pass leaves out (every step's global batch is whole; each
        pass is reshuffled, so another few are left out of the next)."""
        left = self.n_blocks - self.steps_per_epoch * self.global_batch
        out = (f"; a pass trains {self.n_blocks - left} of the {self.n_blocks} blocks ({left} left out, others in each "
               "reshuffled pass)") if left else ""
        return f"train.epochs={epochs:g}: {steps} steps, {self.steps_per_epoch} an epoch{out}"
