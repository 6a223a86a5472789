"""The table of strategy families (toolkit.strategy.families): a family for every layout a launch can be, each
answering as its files and ranks are; and the specs every family meets alike, one parametrized test each: its
checkpoint, saved by an earlier commit, read back by parameter name (toolkit.strategy.ddp.files,
toolkit.strategy.fsdp.files, toolkit.strategy.deepspeed.files; a pipeline's, with its stages: pipeline/test_files.py)."""

from __future__ import annotations

import pytest
from saved_formats import assert_as_saved

from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.families import FAMILIES

LAYOUTS = {
    "single": ParallelLayout("single", 1), "ddp": ParallelLayout("ddp", 4), "fsdp": ParallelLayout("fsdp", 4),
    "deepspeed": ParallelLayout("deepspeed", 4, zero_stage=3), "pipeline": ParallelLayout("ddp", 4, pp=2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_replicated_families_are_those_whose_ranks_hold_the_whole_model(name):
    layout = LAYOUTS[name]
    assert FAMILIES[name].replicated(layout) == (name in ("single", "ddp"))
    assert FAMILIES["deepspeed"].replicated(ParallelLayout("deepspeed", 4, zero_stage=2))  # ZeRO-1/2: whole params


def test_a_checkpoint_resumes_natively_only_where_its_files_fit():
    fits = {
        ("ddp", ParallelLayout("ddp", 2)): True,  # DDP's files: any world size
        ("ddp", ParallelLayout("fsdp", 4)): False,
        ("fsdp", ParallelLayout("fsdp", 2)): True,  # DCP reshards
        ("fsdp", ParallelLayout("fsdp", 2, fsdp_version=1)): False,
        ("deepspeed", ParallelLayout("deepspeed", 2, zero_stage=3)): False,  # ZeRO: the same world only
        ("deepspeed", ParallelLayout("deepspeed", 4, zero_stage=3)): True,
        ("deepspeed", ParallelLayout("deepspeed", 4, zero_stage=2)): False,
        ("pipeline", ParallelLayout("ddp", 2, pp=2)): True,  # the same cut, any replicas
        ("pipeline", ParallelLayout("ddp", 4, pp=4)): False,
    }
    for (name, saved), expected in fits.items():
        assert FAMILIES[name].resumes_natively(LAYOUTS[name], saved) == expected, (name, saved)


# a checkpoint an earlier commit saved (tests/fixtures/checkpoints) -> the family whose files it holds
SAVED = {"ddp@3": "ddp", "fsdp@2": "fsdp", "zero2@2": "deepspeed", "zero3@2": "deepspeed"}


@pytest.mark.parametrize("fixture", SAVED)
def test_each_familys_checkpoint_is_read_back_as_its_optimizer_held_it(fixture, tmp_path):
    """Every trained parameter's fp32 master, Adam moments and step as the saving run's optimizer held them (DDP's
    optimizer.bin by the names beside it, FSDP2's DCP shards, ZeRO's partitions through zero_to_fp32 and
    ds_to_universal). Loading into a run: test_by_name.py and test_resume_elsewhere.py."""
    assert_as_saved(SAVED[fixture], fixture, tmp_path)
