"""DDP: a whole model and optimizer on every rank, gradients averaged by Accelerate's DistributedDataParallel."""

from __future__ import annotations

from toolkit.strategy.backends.base import DataParallel, Strategy, named_groups


class Ddp(DataParallel):
    """Its files (the whole model, an optimizer keyed by parameter order) are the same for any world size
    (measured on CPU): the default native resume, by files alone."""

    name = format = "ddp"

    def optimizer_names(self, strategy: Strategy) -> list[list[str]] | None:
        """optimizer.bin numbers the parameters; the checkpoint says which is which (a conversion needs it)."""
        return named_groups(strategy)


BACKEND = Ddp()
