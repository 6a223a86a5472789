"""Which strategy, on how many processes, saved a checkpoint, and the file layout that strategy writes."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SavedLayout:
    """Which strategy's files a checkpoint holds, and for how many processes (0 = not known)."""

    strategy: str  # a Strategy.name: "single process", "DDP", "FSDP2", "DeepSpeed ZeRO-2", ...
    world_size: int

    @property
    def layout(self) -> str:
        return layout_of(self.strategy)

    def describe(self) -> str:
        if self.strategy == "single process":
            return "one process"
        processes = f" on {self.world_size} process{'es' if self.world_size != 1 else ''}" if self.world_size else ""
        return f"{self.strategy}{processes}"


def layout_of(strategy: str) -> str:
    """The file layout a strategy's save_state writes: ddp (DDP and one process alike), fsdp1,
    fsdp2, zero0..zero3 (offload changes nothing in the files), or pipeline."""
    zero = re.match(r"DeepSpeed ZeRO-(\d)", strategy)
    if zero:
        return f"zero{zero.group(1)}"
    if strategy.startswith("pipeline"):
        return "pipeline"  # each stage's weights and optimizer state (toolkit.checkpoint.pipeline.save_stage)
    if strategy.startswith("FSDP"):
        return "fsdp1" if strategy == "FSDP1" else "fsdp2"
    return "ddp"
