"""save_checkpoint / load_checkpoint with a real single-process strategy: what a checkpoint holds,
when it counts as complete, and how many are kept."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from accelerate.state import AcceleratorState

from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.manager import CheckpointConfig, _load_schedule, load_checkpoint, save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import MODEL_FILES, STATE_FILE, RunDir, converted_state
from toolkit.run.manifest import MANIFEST, crc32
from toolkit.strategy.ddp.files import OPTIMIZER_NAMES
from toolkit.strategy.distributed import Strategy


def test_config_validation():
    assert CheckpointConfig().validate() == []
    assert CheckpointConfig(every=-1, keep_last=0).validate() == ["every=-1 must be >= 0", "keep_last=0 must be at least 1"]


def test_a_checkpoint_round_trips_weights_and_state_and_keeps_the_last_k(tmp_path, strategy):
    model = torch.nn.Linear(4, 3)
    model, optimizer = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    run = RunDir(tmp_path / "run")
    written = []
    for step in (1, 2, 3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        folder = save_checkpoint(strategy, run, TrainerState(step=step, tokens_seen=10 * step), keep_last=2,
                                 model_files=lambda d: (d.mkdir(parents=True), written.append(d)))
        assert folder == run.checkpoint(step) and (folder / STATE_FILE).is_file()
    assert [p.name for p in run.complete_checkpoints()] == ["step-2", "step-3"]
    assert written[-1] == run.checkpoint(3) / MODEL_FILES
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint(strategy, checkpoint := Checkpoint.read(run.checkpoint(3)))
    state = checkpoint.state
    assert state.manifest_crc32 == crc32(run.checkpoint(3) / MANIFEST)  # bound to the files beside it
    assert state == TrainerState(step=3, tokens_seen=30, manifest_crc32=state.manifest_crc32,
                                 layout=ParallelLayout("single", 1))  # what wrote the files
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    # optimizer.bin numbers the parameters; the checkpoint says which is which (a conversion needs it)
    assert json.loads((run.checkpoint(3) / OPTIMIZER_NAMES).read_text()) == {"groups": [["weight", "bias"]]}


def test_a_stale_incomplete_save_of_the_same_step_is_replaced(tmp_path, strategy):
    model = strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    stale = run.checkpoint(5)
    stale.mkdir(parents=True)
    (stale / "leftover.bin").write_bytes(b"half written")
    save_checkpoint(strategy, run, TrainerState(step=5), keep_last=1)
    assert not (stale / "leftover.bin").exists() and TrainerState.read(stale).step == 5
    del model


def test_a_checkpoints_conversion_goes_with_it(tmp_path, strategy):
    """step-N.converted (its state by parameter name, made by a resume under another strategy) is pruned
    with step-N, and a new save of step N drops the conversion of the old one."""
    strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    for step in (1, 2):
        save_checkpoint(strategy, run, TrainerState(step=step), keep_last=1)
        converted_state(run.checkpoint(step)).mkdir()
        (converted_state(run.checkpoint(step)) / "optimizer.json").write_text("{}")
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-2", "step-2.converted"]
    assert [p.name for p in run.complete_checkpoints()] == ["step-2"]
    save_checkpoint(strategy, run, TrainerState(step=2, tokens_seen=5), keep_last=1)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-2"]


def test_a_resume_counts_the_micro_batches_of_this_run(tmp_path):
    """Accelerate closes an optimizer step on every `accumulation`-th micro-batch, counting from the
    count the checkpoint restores: the count is that of this run's accumulation, whatever the saving
    run's (another world size), so that the first step after the resume closes where it should."""
    AcceleratorState._reset_state(True)
    saving = Strategy.launch(mixed_precision="no", global_batch=6, micro_batch=2, max_grad_norm=1.0,
                             project_dir=str(tmp_path), trackers=[], timeout_s=60)
    saving.prepare(torch.nn.Linear(2, 2))
    saving.accelerator.step = 9  # 3 steps of 3 micro-batches
    folder = save_checkpoint(saving, RunDir(tmp_path / "run"), TrainerState(step=3), keep_last=1)
    AcceleratorState._reset_state(True)
    resuming = Strategy.launch(mixed_precision="no", global_batch=6, micro_batch=1, max_grad_norm=1.0,
                               project_dir=str(tmp_path), trackers=[], timeout_s=60)
    resuming.prepare(torch.nn.Linear(2, 2))
    load_checkpoint(resuming, Checkpoint.read(folder))
    assert resuming.accumulation == 6 and resuming.accelerator.step == 18


def test_a_conversion_into_a_deepspeed_json_that_owns_the_optimizer_is_refused(tmp_path, strategy):
    """A checkpoint of another strategy resumed where the DeepSpeed JSON defines its own optimizer or
    scheduler: their state is DeepSpeed's, which a conversion cannot fill."""
    strategy.prepare(torch.nn.Linear(2, 2))
    folder = save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=1), keep_last=1)
    state = TrainerState.read(folder)
    state.layout = ParallelLayout("fsdp", 2)  # as an FSDP2 run on 2 processes records it
    state.write(folder)
    # the launch's layout as DeepSpeed's backend sees it (its refusal is the backend's): ZeRO-3 on one process
    owning = dataclasses.replace(strategy, ds_owned=("optimizer", "scheduler"),
                                 layout=ParallelLayout("deepspeed", 1, zero_stage=3))
    with pytest.raises(UserError) as info:
        load_checkpoint(owning, Checkpoint.read(folder))
    said = owning.layout.describe()
    assert str(info.value) == (
        f"checkpoint {folder} was saved under FSDP2 on 2 processes; resuming it under {said} needs a conversion, "
        "and this launch's DeepSpeed JSON defines its own optimizer and scheduler, whose state the conversion cannot "
        "fill: remove them from the JSON, or resume under FSDP2 on 2 processes"
    )
    assert not converted_state(folder).exists()


def test_a_converted_resume_fits_the_schedule_to_this_runs_parameter_groups(tmp_path):
    """DeepSpeed drops an empty parameter group that torch keeps (LoRA's no-decay group): one saved rate
    goes to every group; rates that differ between groups cannot be matched and are refused."""
    def schedule(groups: int, last: list[float]):
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
        optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: 0.5] * groups)
        state = sched.state_dict()
        state["_last_lr"], state["base_lrs"] = last, [1.0] * len(last)
        return sched, state

    two_groups, _ = schedule(2, [0.5, 0.5])
    _, saved_by_one = schedule(1, [0.25])
    _load_schedule(two_groups, saved_by_one, tmp_path)
    assert [g["lr"] for g in two_groups.optimizer.param_groups] == [0.25, 0.25]
    one_group, _ = schedule(1, [0.5])
    _, saved_by_two = schedule(2, [0.25, 0.125])
    with pytest.raises(UserError) as info:
        _load_schedule(one_group, saved_by_two, tmp_path)
    assert str(info.value) == (
        f"checkpoint {tmp_path} has a learning rate for each of 2 parameter groups and this run has 1, with different "
        "rates: they cannot be matched; resume it under the strategy it was saved with"
    )


def test_rotation_never_prunes_the_newest_checkpoint_that_passed(tmp_path, strategy):
    """keep_last=1: suspect checkpoints (saved after a skipped non-finite step, or with non-finite
    weights) are kept beside the last good one, until a newer good one replaces it."""
    strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    kept = []
    for step, suspect in ((1, ""), (2, "saved right after 1 skipped non-finite step(s)"), (3, "non-finite weights (w)"),
                          (4, "")):
        save_checkpoint(strategy, run, TrainerState(step=step, suspect=suspect), keep_last=1)
        kept.append([p.name for p in run.complete_checkpoints()])
    assert kept == [["step-1"], ["step-1", "step-2"], ["step-1", "step-3"], ["step-4"]]


def test_rotation_takes_a_checkpoint_whose_state_is_damaged_for_one_that_did_not_pass(tmp_path, strategy):
    """Its trainer_state.json garbled after it was written: rotation deletes it as it would a suspect one (it was a
    DamagedState traceback mid-save), and keeps the last that passed."""
    strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    for step in (1, 2):
        save_checkpoint(strategy, run, TrainerState(step=step), keep_last=1)
    (run.checkpoint(2) / STATE_FILE).write_text('{"step": "two"}')
    save_checkpoint(strategy, run, TrainerState(step=3), keep_last=1)
    assert [p.name for p in run.complete_checkpoints()] == ["step-3"]


def test_rotation_deletes_only_the_checkpoints_it_wrote(tmp_path, strategy):
    """What else sits in checkpoints/ stays: a user's file and folder (even one named like a leftover of
    an interrupted prune), and a step-N that is a link to the user's folder (neither the link nor its files)."""
    strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / STATE_FILE).write_text(json.dumps({"step": 1}))  # looks complete through the link
    run.checkpoints.mkdir(parents=True)
    run.checkpoint(1).symlink_to(mine, target_is_directory=True)
    (run.checkpoints / "notes.txt").write_text("keep")
    (run.checkpoints / "step-notes.deleting").mkdir()
    for step in (2, 3):
        save_checkpoint(strategy, run, TrainerState(step=step), keep_last=1)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["notes.txt", "step-1", "step-3", "step-notes.deleting"]
    assert (mine / STATE_FILE).is_file() and run.checkpoint(1).is_symlink()
