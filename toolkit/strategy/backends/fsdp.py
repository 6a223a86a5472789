"""FSDP2: each rank holds a shard of every parameter and of its Adam state (torch's fully_shard through Accelerate)."""

from __future__ import annotations

import torch

from toolkit.config import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.backends.base import DataParallel, Strategy


class Fsdp(DataParallel):
    name = format = "fsdp"

    def replicated(self, layout: ParallelLayout) -> bool:
        return False

    def check_layers(self, strategy: Strategy, model) -> None:
        """An FSDP config naming a layer class the model does not have would fail deep inside prepare. `model`
        may be a function building it (the pretraining recipe builds a memory-free meta copy)."""
        if not isinstance(model, torch.nn.Module):
            model = model()
        named = strategy.accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap or []
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in named if n not in present]
        if missing:
            layers = getattr(model, "_no_split_modules", None) or sorted(present)
            raise UserError(
                f"the FSDP config wraps {', '.join(missing)}, which this {type(model).__name__} does not have; "
                f"its decoder layer class is {', '.join(layers)} (or leave fsdp_transformer_layer_cls_to_wrap out)"
            )

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """torch.distributed.checkpoint reshards FSDP2's DCP files to any number of processes on load (FSDP1's
        only to the world that wrote them)."""
        return saved.files == layout.files and (layout.files == "fsdp2" or saved.world in (0, layout.world))


BACKEND = Fsdp()
