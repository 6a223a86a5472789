"""What a checkpoint holds is stated once (toolkit.checkpoint.contents.PARTS): a checkpoint of every format, saved by
this commit (one process) or by an earlier one (tests/fixtures/checkpoints: DDP on 3 processes, FSDP2, ZeRO-2 and
ZeRO-3 on 2, a pipeline of 2 stages), holds exactly the parts the table names for its format."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from one_process_checkpoints import launch, trained

from toolkit.checkpoint.contents import PARTS, against_parts
from toolkit.checkpoint.formats import FORMATS, saved_by
from toolkit.checkpoint.manager import save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.export.hf_folder import write_model_files
from toolkit.run.folder import RunDir

FIXTURES = sorted((Path(__file__).parents[2] / "fixtures" / "checkpoints").glob("*/step-*"))


def test_every_format_has_its_parts_and_every_part_a_format():
    assert {f for part in PARTS for f in part.formats} == set(FORMATS)
    assert {folder.parent.name.split("@")[0] for folder in FIXTURES} >= {"ddp", "fsdp", "zero2", "zero3", "pipeline"}


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda f: f.parent.name)
def test_a_checkpoint_of_each_format_holds_the_parts_the_table_names(folder, tmp_path):
    assert against_parts(folder) == []
    copy = shutil.copytree(folder, tmp_path / "step-3")
    (copy / "notes.txt").write_text("mine")  # a file no part names
    (copy / "custom_checkpoint_0.pkl").unlink()  # a part every checkpoint holds
    assert against_parts(copy) == [f"notes.txt: a file no part of a {saved_by(folder)} checkpoint names",
                                   "schedule (custom_checkpoint_0.pkl): missing"]


def test_a_checkpoint_this_commit_saves_holds_the_parts_the_table_names(tmp_path, tiny_model, tiny_tokenizer,
                                                                        fresh_accelerate):
    strategy = launch(tmp_path)
    model, _ = trained(strategy, tiny_model, steps=1)
    folder = save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=1), keep_last=1,
                             model_files=lambda into: write_model_files(model, tiny_tokenizer, into))
    assert against_parts(folder) == []
