"""Whether a checkpoint's weights are a live model (toolkit.checkpoint.alive): no weight NaN or inf, ZeRO-3's padding
no weight; a dead model needs both a uniform loss and no gradient. (A resume refusing either, and rotation keeping the
last checkpoint that passed, through the trainer: tests/toolkit/training/test_nonfinite.py.)"""

from __future__ import annotations

import math

import torch

from toolkit.checkpoint.alive import dead_model


def test_zero3_padding_is_not_a_weight(tiny_model):
    """DeepSpeed pads the last partition of a parameter the world does not divide with torch.empty memory: a
    ZeRO-3 resume on 3 ranks was refused when that memory read as NaN. Rank 1 of 2 holds the last 3 of 5 values
    of a parameter here, padded to 3 of 6 with NaN, as DeepSpeed lays it out."""
    from toolkit.checkpoint.alive import nonfinite_weight
    from toolkit.strategy.family import held_values

    model = tiny_model("llama")
    weight = model.model.norm.weight
    values = torch.arange(5.0)
    weight.ds_numel, weight.ds_zero_partition_rank = 5, 1
    weight.ds_tensor = torch.tensor([3.0, 4.0, math.nan])
    assert torch.equal(held_values(weight), values[3:])
    assert nonfinite_weight(None, model) is None
    weight.ds_tensor[1] = math.inf  # a real value that is not finite still is
    assert nonfinite_weight(None, model) == "model.norm.weight"
    weight.ds_zero_partition_rank = 2  # a rank past the end holds padding only
    assert held_values(weight).numel() == 0 and nonfinite_weight(None, model) is None


def test_dead_model_needs_both_uniform_loss_and_no_gradient():
    uniform = math.log(300)
    assert dead_model(uniform * (1 + 5e-4), 0.0, 300)
    assert not dead_model(uniform * (1 + 5e-3), 0.0, 300)  # learning something
    assert not dead_model(uniform, 1e-12, 300)  # a gradient: it can still train
    assert not dead_model(uniform, None, 300)
