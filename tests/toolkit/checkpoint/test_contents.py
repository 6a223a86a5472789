"""What a checkpoint holds is stated once (each family's PARTS and toolkit.checkpoint.contents.COMMON): a checkpoint of
every family, saved by this commit (one process) or by an earlier one (tests/fixtures/checkpoints: DDP on 3
processes, FSDP2, ZeRO-2 and ZeRO-3 on 2, a pipeline of 2 stages), holds exactly the parts named for its family, and
export reads the parts that hold the weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from one_process_checkpoints import launch, trained

from toolkit.checkpoint.contents import PARTS, against_parts, weight_files
from toolkit.checkpoint.formats import saved_by
from toolkit.checkpoint.manager import save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.export.hf_folder import write_model_files
from toolkit.run.folder import RunDir
from toolkit.strategy.families import FILES

FIXTURES = sorted((Path(__file__).parents[2] / "fixtures" / "checkpoints").glob("*/step-*"))


def test_every_family_that_writes_files_declares_its_own_parts_and_one_that_holds_the_weights():
    assert set(PARTS) == set(FILES) == {"ddp", "fsdp", "deepspeed", "pipeline"}  # one process writes DDP's files
    for name, module in FILES.items():
        assert module.PARTS and set(module.PARTS) < set(PARTS[name]), name
        assert any(part.weights for part in module.PARTS), name
        assert "model_files/*" in weight_files(name) and "optimizer.bin" not in weight_files(name)
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
