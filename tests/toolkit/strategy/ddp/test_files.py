"""DDP's files (toolkit.strategy.ddp.files: the whole model, and optimizer.bin with its ids named beside it), from
a checkpoint an earlier commit saved on 3 processes (tests/fixtures/checkpoints/ddp@3): every trained
parameter's fp32 master, Adam moments and step as the saving run's optimizer held them. Loading into a
run: test_by_name.py and test_resume_elsewhere.py."""

from __future__ import annotations

from saved_formats import assert_as_saved


def test_a_ddp_checkpoint_is_read_back_as_its_optimizer_held_it(tmp_path):
    assert_as_saved("ddp", "ddp@3", tmp_path)
