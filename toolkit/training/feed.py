"""The training data of a run as the loop takes it, step by step: packed blocks in the order of a schedule (one
corpus, or several mixed by weight), or blocks packed from a stream as the steps take them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import datasets
import numpy as np
import torch

from toolkit.data.batching import BatchSchedule
from toolkit.data.mixture import MixtureSchedule
from toolkit.data.packing import block_targets, column
from toolkit.data.preference import with_reference
from toolkit.data.streaming import MixedStreams, StreamingBlocks


class Feed:
    """`val` is the held-out blocks (None: no evaluation), by source name for a mixture."""

    def __init__(self, collate: Callable, val: datasets.Dataset | dict[str, datasets.Dataset] | None,
                 global_batch: int, micro_batch: int, blocks: datasets.Dataset | None = None,
                 target_counts: Callable | None = None, schedule: BatchSchedule | MixtureSchedule | None = None,
                 stream: StreamingBlocks | MixedStreams | None = None):
        self.collate, self.schedule, self.stream = collate, schedule, stream
        self.val = None if isinstance(val, dict) and not val else val  # a mixture's: none of its sources held out
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self._streamed: list[int] = []  # a mixed stream's tokens by source in the last step, all ranks
        if blocks is not None:
            self.blocks = blocks.with_format("numpy")
            self.targets = target_counts(self.blocks)
            self.tokens = column(self.blocks, "num_tokens").astype("int64")

    def add_reference(self, train: np.ndarray, val: np.ndarray | dict[str, np.ndarray] | None) -> None:
        """The reference model's log-probabilities as the `ref_logps` column of the blocks (DPO); a mixture's
        held-out ones by source."""
        self.blocks = with_reference(self.blocks, train).with_format("numpy")
        if isinstance(val, dict):
            self.val = {name: with_reference(self.val[name], v) for name, v in val.items()}
        elif val is not None:
            self.val = with_reference(self.val, val)

    @property
    def sources(self) -> list[str]:
        """The names of a mixture's sources (none for one corpus)."""
        if isinstance(self.stream, MixedStreams):
            return [s.name for s in self.stream.streams]
        return self.schedule.names if isinstance(self.schedule, MixtureSchedule) else []

    @property
    def mixture(self) -> dict:
        """What a checkpoint records of a mixture ({} for one corpus): TrainerState.mixture."""
        if not self.sources:
            return {}
        mixed = self.stream if self.stream is not None else self.schedule
        return {"sources": self.sources, "plan": [[start, list(weights)] for start, weights in mixed.plan]}

    def step_data(self, step: int, data_ranks: int, copies: int, reduce: Callable) -> tuple[Iterator[dict], int, int]:
        """This rank's micro-batches (block columns) of `step`, and the global batch's target and token counts.
        A stream's counts are summed over the ranks (`reduce`), of which `copies` hold each block."""
        if self.stream is None:
            global_idx = self.schedule.global_indices(step)
            micro = (self.blocks[m] for m in self.schedule.micro_batches(step))
            return micro, int(self.targets[global_idx].sum()), int(self.tokens[global_idx].sum())
        blocks = self.stream.take(self.global_batch // data_ranks, step)
        by_source = getattr(self.stream, "source_tokens", [])
        mine = torch.tensor([float(block_targets(blocks).sum()), float(blocks["num_tokens"].sum()), *by_source],
                            dtype=torch.float64)
        targets, tokens, *self._streamed = (int(x) // copies for x in reduce(mine).tolist())
        micro = ({k: v[i : i + self.micro_batch] for k, v in blocks.items()}
                 for i in range(0, len(blocks["num_tokens"]), self.micro_batch))
        return micro, targets, tokens

    def source_tokens(self, step: int) -> dict[str, int]:
        """The tokens each source of a mixture gives global batch `step`."""
        if not self.sources:
            return {}
        if self.stream is not None:  # summed over the ranks by step_data
            return dict(zip(self.sources, self._streamed, strict=True))
        global_idx = self.schedule.global_indices(step)
        counts = np.bincount(self.schedule.source_of(global_idx), weights=self.tokens[global_idx],
                             minlength=len(self.sources))
        return {name: int(n) for name, n in zip(self.sources, counts, strict=True)}

    def epoch(self, step: int) -> float:
        return self.schedule.epoch(step) if self.stream is None else self.stream.epoch
