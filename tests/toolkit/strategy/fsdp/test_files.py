"""FSDP2's files (toolkit.strategy.fsdp.files: DCP shards of the model and of the optimizer), read back whole
in one process from a checkpoint an earlier commit saved on 2 processes (tests/fixtures/checkpoints/fsdp@2):
every trained parameter's fp32 master, Adam moments and step as the saving run's optimizer held them.
Loading into a run: test_resume_elsewhere.py."""

from __future__ import annotations

from saved_formats import assert_as_saved


def test_a_fsdp_checkpoint_is_read_back_as_its_optimizer_held_it(tmp_path):
    assert_as_saved("fsdp", "fsdp@2", tmp_path)
