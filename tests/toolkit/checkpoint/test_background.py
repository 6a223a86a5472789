"""Checkpoints written in the background (checkpoint.async_save, toolkit.checkpoint.background). The run that writes
them (the same files as a blocking save, while training goes on) and their failures: tests/toolkit/training/
test_trainer.py; their kills and resumes under DDP and FSDP2: tests/recipes/test_strategies.py's hard kills."""

from __future__ import annotations

import torch

from toolkit.checkpoint.background import snapshot


def test_a_snapshot_is_a_copy_that_keeps_which_tensors_share_storage():
    weight = torch.arange(6.0).reshape(2, 3)
    state = {"embed": weight, "head": weight, "row": weight[1], "step": 3, "groups": [{"lr": 0.1}]}
    copy = snapshot(state)
    weight.add_(100)  # training goes on
    state["groups"][0]["lr"] = 0.2
    assert copy["embed"].tolist() == [[0, 1, 2], [3, 4, 5]] and copy["row"].tolist() == [3, 4, 5]
    assert copy["embed"].untyped_storage().data_ptr() == copy["head"].untyped_storage().data_ptr()
    assert copy["row"].untyped_storage().data_ptr() == copy["embed"].untyped_storage().data_ptr()
    assert copy["groups"] == [{"lr": 0.1}] and copy["step"] == 3
