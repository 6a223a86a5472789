"""Which strategy saved a checkpoint, and the file layout it writes (toolkit.checkpoint.origin)."""

from __future__ import annotations

import pytest

from toolkit.checkpoint.origin import SavedLayout, layout_of


@pytest.mark.parametrize(("strategy", "layout"), [
    ("single process", "ddp"), ("DDP", "ddp"), ("FSDP2", "fsdp2"), ("FSDP1", "fsdp1"), ("DeepSpeed ZeRO-1", "zero1"),
    ("DeepSpeed ZeRO-3 (offload optimizer+param)", "zero3"),
])
def test_the_file_layout_of_each_strategy(strategy, layout):
    """DDP and one process write the same files; offload changes nothing in DeepSpeed's."""
    assert layout_of(strategy) == layout


def test_a_saved_layout_says_who_saved_it():
    assert SavedLayout("DeepSpeed ZeRO-2", 2).describe() == "DeepSpeed ZeRO-2 on 2 processes"
    assert SavedLayout("single process", 1).describe() == "one process"
    assert SavedLayout("FSDP2", 0).describe() == "FSDP2" and SavedLayout("pipeline of 2 stages", 2).layout == "pipeline"
