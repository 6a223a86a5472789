"""DeepSpeed (toolkit.strategy.deepspeed.family): the offload the layout records decides the optimizer class."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.deepspeed import family as deepspeed


def test_the_cpu_adamw_only_where_the_layout_offloads_the_optimizer_to_a_gpu_machines_cpu(monkeypatch):
    offloading = SimpleNamespace(layout=ParallelLayout("deepspeed", 2, zero_stage=3, offload=("optimizer",)))
    plain = SimpleNamespace(layout=ParallelLayout("deepspeed", 2, zero_stage=3, offload=("param",)))
    assert not deepspeed.FAMILY.offloads_optimizer(offloading)  # this machine has no GPU: nothing to offload
    monkeypatch.setattr(deepspeed, "has_gpu", lambda: True)
    assert deepspeed.FAMILY.offloads_optimizer(offloading) and not deepspeed.FAMILY.offloads_optimizer(plain)
    assert deepspeed.FAMILY.adamw(plain) is torch.optim.AdamW
    assert deepspeed.FAMILY.adamw(offloading) is not torch.optim.AdamW  # DeepSpeedCPUAdam, built on call
