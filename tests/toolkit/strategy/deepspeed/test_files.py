"""DeepSpeed's files (toolkit.strategy.deepspeed.files: flat ZeRO partitions per rank): what only they hold, the
DeepSpeed config a checkpoint was trained with. Read back by name: test_families.py, with every family's."""

from __future__ import annotations

from saved_checkpoints import FIXTURES

from toolkit.strategy.deepspeed import files as deepspeed


def test_the_deepspeed_config_a_checkpoint_was_trained_with_is_read_from_its_files():
    assert deepspeed.config(FIXTURES / "zero3@2" / "step-3")["zero_optimization"]["stage"] == 3
    assert deepspeed.tag_folder(FIXTURES / "zero2@2" / "step-3").name == "pytorch_model"
