"""DeepSpeed's files (toolkit.strategy.deepspeed.files: flat ZeRO partitions per rank), read back with
zero_to_fp32 and ds_to_universal from checkpoints an earlier commit saved under ZeRO-3 and ZeRO-2 on 2
processes (tests/fixtures/checkpoints): every trained parameter's fp32 master, Adam moments and step as
the saving run's optimizer held them. Loading into a run: test_resume_elsewhere.py."""

from __future__ import annotations

from saved_checkpoints import FIXTURES
from saved_formats import assert_as_saved

from toolkit.strategy.deepspeed import files as deepspeed


def test_a_zero3_checkpoint_is_read_back_as_its_optimizer_held_it(tmp_path):
    assert_as_saved("deepspeed", "zero3@2", tmp_path)


def test_a_zero2_checkpoint_is_read_back_as_its_optimizer_held_it(tmp_path):
    assert_as_saved("deepspeed", "zero2@2", tmp_path)


def test_the_deepspeed_config_a_checkpoint_was_trained_with_is_read_from_its_files():
    assert deepspeed.config(FIXTURES / "zero3@2" / "step-3")["zero_optimization"]["stage"] == 3
    assert deepspeed.tag_folder(FIXTURES / "zero2@2" / "step-3").name == "pytorch_model"
