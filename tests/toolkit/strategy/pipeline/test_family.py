"""A pipeline of stages (toolkit.strategy.pipeline.family): the schedule sums its micro-batches' gradients as they
are, and a stage is not wrapped: its optimizer is kept to save with it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from toolkit.strategy.pipeline.family import FAMILY as stages


def test_a_stage_keeps_its_optimizer_and_scales_by_the_targets_alone():
    strategy = SimpleNamespace(pipeline=SimpleNamespace(optimizer=None), accumulation=4, gradient_ranks=2)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert stages.prepare(strategy, model, optimizer) == (model, optimizer)  # as they are
    assert strategy.pipeline.optimizer is optimizer
    assert stages.backward_scale(strategy, 8) == 1 / 8
