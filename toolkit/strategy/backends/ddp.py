"""DDP: a whole model and optimizer on every rank, gradients averaged by Accelerate's DistributedDataParallel."""

from __future__ import annotations

from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.backends.base import DataParallel, Strategy, named_groups


class Ddp(DataParallel):
    name = format = "ddp"

    def optimizer_names(self, strategy: Strategy) -> list[list[str]] | None:
        """optimizer.bin numbers the parameters; the checkpoint says which is which (a conversion needs it)."""
        return named_groups(strategy)

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """The whole model, and an optimizer keyed by parameter order: the same files for any world size (measured
        on CPU)."""
        return saved.files == layout.files


BACKEND = Ddp()
