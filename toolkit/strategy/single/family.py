"""One process: DDP's files and defaults, without the wrapper (Accelerate prepares the model as it is)."""

from __future__ import annotations

from toolkit.strategy.ddp.family import Ddp


class Single(Ddp):
    name = "single"  # DDP's files


FAMILY = Single()
