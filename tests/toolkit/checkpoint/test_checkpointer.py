"""The run's checkpoints through one object, on a real single-process strategy: a save blocks or goes on in the
background until polled or waited for, one at a time, and a failed one stops the run or is said, as configured.
(The trainer's runs of it, under every strategy and on a full disk: tests/toolkit/training/test_trainer.py.)"""

from __future__ import annotations

import math
import time

import pytest
import torch

from toolkit.checkpoint.checkpointer import Checkpointer, SaveStopped
from toolkit.checkpoint.manager import CheckpointConfig
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.run.folder import STATE_FILE, RunDir


def checkpointer(strategy, tmp_path, **settings):
    said, logged = [], []
    keeper = Checkpointer(strategy, RunDir(tmp_path / "run"), CheckpointConfig(**settings), said.append,
                          lambda kind, row: logged.append((kind, row)))
    model = torch.nn.Linear(4, 3)
    strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    keeper.attach(model, lambda d: d.mkdir(parents=True, exist_ok=True))
    return keeper, said, logged


def test_a_background_save_is_complete_once_polled_past_its_writes_or_waited_for(tmp_path, strategy):
    keeper, said, _ = checkpointer(strategy, tmp_path, keep_last=2)
    assert keeper.save(TrainerState(step=1), background=True) is None
    folder = keeper.run.checkpoint(1)
    assert keeper.step == 1 and not (folder / STATE_FILE).exists()  # not complete: a resume never takes it
    while keeper.writing():  # the files, written by this rank's thread
        time.sleep(0.01)
    keeper.poll(1, 1, [0.0] * 3)  # seen at the step the save began: not yet
    keeper.poll(2, 2, [0.0] * 3)  # no rank writes any more: the manifest and state file, in the background
    assert keeper.wait(2) == folder and (folder / STATE_FILE).is_file() and keeper.saving is None
    assert said[-1] == f"checkpoint saved: {folder}" and keeper.wait(3) is None  # nothing left to wait for
    assert keeper.save(TrainerState(step=3)) == keeper.run.checkpoint(3)


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_failed_save_stops_the_run_or_is_said_and_leaves_no_checkpoint_of_its_step(tmp_path, strategy, monkeypatch,
                                                                                    policy):
    monkeypatch.setenv("LLM_TOOLKIT_FAIL", "save.rank_files@2/0=ENOSPC")
    monkeypatch.setenv("LLM_TOOLKIT_KILL_LOG", str(tmp_path / "faults.log"))
    keeper, said, logged = checkpointer(strategy, tmp_path, on_save_error=policy)
    keeper.save(TrainerState(step=1))
    if policy == "stop":
        with pytest.raises(SaveStopped, match=r"checkpoint step-2 could not be written: .*; free space, then continue "
                                              r"with resume=auto$"):
            keeper.save(TrainerState(step=2))
    else:
        assert keeper.save(TrainerState(step=2)) is None
        assert said[-1].startswith("warning: checkpoint step-2 could not be written")
    assert keeper.step == -1 and [kind for kind, _ in logged] == ["checkpoint_error"] and logged[0][1]["step"] == 2
    assert [p.name for p in keeper.run.complete_checkpoints()] == ["step-1"]


def test_a_first_save_that_failed_before_writing_says_what_a_checkpoint_needs_and_names_none(tmp_path, strategy,
                                                                                            monkeypatch):
    """In the background the writes never started (nothing on disk to measure): the need is the weights and AdamW's
    moments, 15 x (4 + 8) bytes, and with no checkpoint there is none to continue from."""
    monkeypatch.setenv("LLM_TOOLKIT_FAIL", "save.rank_files@1/0=ENOSPC")
    monkeypatch.setenv("LLM_TOOLKIT_KILL_LOG", str(tmp_path / "faults.log"))
    keeper, _, _ = checkpointer(strategy, tmp_path)
    assert keeper.save(TrainerState(step=1), background=True) is None
    with pytest.raises(SaveStopped) as info:
        keeper.wait(1)
    said = str(info.value)
    assert "; a checkpoint needs at least 180 bytes, " in said and "; no earlier checkpoint exists; " in said, said
    assert said.endswith("; free space, then run the same command again: there is no checkpoint to continue from")


def test_a_save_of_weights_that_are_not_numbers_is_marked_suspect_and_so_is_one_right_after_skips(tmp_path, strategy):
    keeper, _, _ = checkpointer(strategy, tmp_path, keep_last=3)
    state = TrainerState(step=1)
    keeper.save(state, skipped=2)
    assert state.suspect == "saved right after 2 skipped non-finite step(s)"
    with torch.no_grad():
        keeper.model.bias[1] = float("nan")
    keeper.save(state := TrainerState(step=2))
    assert state.suspect == "non-finite weights (bias)" and not TrainerState.passed(keeper.run.checkpoint(2))


def test_a_load_goes_on_from_the_checkpoint_and_its_first_step_is_checked_once(tmp_path, strategy):
    from toolkit.config.errors import UserError

    keeper, said, _ = checkpointer(strategy, tmp_path)
    keeper.save(TrainerState(step=1, seed=3))
    loaded = Checkpointer(strategy, keeper.run, CheckpointConfig(), said.append, lambda kind, row: None)
    loaded.attach(keeper.model, keeper.model_files)
    state = loaded.load(keeper.run.checkpoint(1), TrainerState(seed=3), auto=False, streaming=False, max_steps=5,
                        peak_lr=0.1, on_resume={})
    assert state.step == loaded.step == 1 and loaded.loaded == keeper.run.checkpoint(1) and loaded.unproven
    assert said[-1] == f"resumed from {keeper.run.checkpoint(1)} at step 1"
    with pytest.raises(UserError, match="holds a dead model: the first step after resuming gave a loss of 1.0986"):
        loaded.check_loaded(math.log(3), 0.0, vocab_size=3, preference=False)
    loaded.check_loaded(math.log(3), 0.0, vocab_size=3, preference=False)  # checked once: the first step alone
