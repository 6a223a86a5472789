"""The parallel layout of a run (toolkit.parallel_layout): its names in messages, its file layout, its record in a
checkpoint, and the strategy names older checkpoints recorded instead."""

from __future__ import annotations

import json

import pytest

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.parallel_layout import ParallelLayout

ZERO3_OFFLOAD = ParallelLayout("deepspeed", 2, zero_stage=3, offload=("optimizer", "param"))


@pytest.mark.parametrize(("layout", "name", "files"), [
    (ParallelLayout("single", 1), "single process", "ddp"),
    (ParallelLayout("ddp", 2), "DDP", "ddp"),
    (ParallelLayout("fsdp", 2), "FSDP2", "fsdp2"),
    (ParallelLayout("fsdp", 2, fsdp_version=1), "FSDP1", "fsdp1"),
    (ParallelLayout("deepspeed", 2, zero_stage=1), "DeepSpeed ZeRO-1", "zero1"),
    (ZERO3_OFFLOAD, "DeepSpeed ZeRO-3 (offload optimizer+param)", "zero3"),
    (ParallelLayout("ddp", 4, pp=2), "pipeline of 2 stages", "pipeline"),
])
def test_each_layout_names_its_strategy_and_files_and_older_checkpoints_name_it_back(layout, name, files):
    """DDP and one process write the same files; offload changes nothing in DeepSpeed's. A checkpoint saved
    before the layout was recorded names its strategy: read back, it is the same layout."""
    assert (layout.name, layout.files) == (name, files)
    assert ParallelLayout.from_name(name, layout.world) == layout


def test_a_layout_says_who_saved_a_checkpoint():
    assert ParallelLayout("deepspeed", 2, zero_stage=2).describe() == "DeepSpeed ZeRO-2 on 2 processes"
    assert ParallelLayout("single", 1).describe() == "one process"
    assert ParallelLayout("fsdp", 1).describe() == "FSDP2 on 1 process"
    assert ParallelLayout("fsdp", 0).describe() == "FSDP2"
    assert ParallelLayout("ddp", 4, pp=2).describe() == "pipeline of 2 stages on 4 processes"


def test_the_degrees_multiply_to_the_world():
    """dp_replicate x dp_shard x tp x cp x sp x pp = world: FSDP and ZeRO shard their data-parallel ranks,
    DDP and the replicas of a pipeline replicate."""
    for layout in (ParallelLayout("fsdp", 8, tp=2), ParallelLayout("deepspeed", 8, sp=4, zero_stage=3),
                   ParallelLayout("ddp", 8, pp=2), ParallelLayout("fsdp", 6, cp=3)):
        assert layout.dp_replicate * layout.dp_shard * layout.model_parallel == layout.world
    assert (ParallelLayout("fsdp", 8, tp=2).dp_shard, ParallelLayout("ddp", 8, pp=2).dp_replicate) == (4, 4)


def test_a_checkpoint_records_its_layout_as_fields(tmp_path):
    TrainerState(step=3, layout=ZERO3_OFFLOAD).write(tmp_path)
    record = json.loads((tmp_path / "trainer_state.json").read_text())
    assert record["layout"]["zero_stage"] == 3 and record["layout"]["offload"] == ["optimizer", "param"]
    assert "strategy" not in record
    assert TrainerState.read(tmp_path).layout == ZERO3_OFFLOAD


def test_an_older_checkpoints_strategy_name_is_read_as_its_layout(tmp_path):
    record = json.loads(json.dumps({"step": 3, "strategy": "DeepSpeed ZeRO-2", "world_size": 2}))
    (tmp_path / "trainer_state.json").write_text(json.dumps(record))
    assert TrainerState.read(tmp_path).layout == ParallelLayout("deepspeed", 2, zero_stage=2)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 3}))
    assert TrainerState.read(tmp_path).layout is None
