"""DDP (toolkit.strategy.ddp.family): its checkpoint names the optimizer's parameters, and its files fit any world."""

from __future__ import annotations

import torch

from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.ddp.family import FAMILY as ddp
from toolkit.strategy.fsdp.family import FAMILY as fsdp


def test_ddp_names_the_optimizers_parameters_where_fsdp_leaves_it_to_its_files(single):
    model = torch.nn.Linear(2, 2)
    single.prepare(model, torch.optim.AdamW(model.parameters()))
    assert ddp.optimizer_names(single) == [["weight", "bias"]]  # in the order optimizer.bin numbers them
    assert fsdp.optimizer_names(single) is None
    assert all(ddp.resumes_natively(ParallelLayout("ddp", world), ParallelLayout("ddp", 3)) for world in (1, 2, 8))
