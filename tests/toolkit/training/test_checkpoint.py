"""save_checkpoint / load_checkpoint with a real single-process strategy: what a checkpoint holds,
when it counts as complete, and how many are kept."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from accelerate.state import AcceleratorState

from toolkit.config import UserError
from toolkit.manifest import MANIFEST, crc32, write_manifest
from toolkit.run_dir import MODEL_FILES, STATE_FILE, RunDir, TrainerState, converted_state
from toolkit.strategy.distributed import Strategy
from toolkit.strategy.saved import OPTIMIZER_NAMES
from toolkit.training.checkpoint import (
    CheckpointConfig,
    _load_schedule,
    check_same_data_order,
    check_state_file,
    load_checkpoint,
    save_checkpoint,
)


@pytest.fixture
def strategy(tmp_path):
    AcceleratorState._reset_state(True)
    yield Strategy.launch(mixed_precision="no", global_batch=2, micro_batch=2, max_grad_norm=1.0,
                          project_dir=str(tmp_path), trackers=[], timeout_s=60)
    AcceleratorState._reset_state(True)


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
    state = load_checkpoint(strategy, run.checkpoint(3))
    assert state.manifest_crc32 == crc32(run.checkpoint(3) / MANIFEST)  # bound to the files beside it
    assert state == TrainerState(step=3, tokens_seen=30, manifest_crc32=state.manifest_crc32,
                                 strategy="single process", world_size=1)  # what wrote the files
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
    load_checkpoint(resuming, folder)
    assert resuming.accumulation == 6 and resuming.accelerator.step == 18


def test_a_conversion_into_a_deepspeed_json_that_owns_the_optimizer_is_refused(tmp_path, strategy):
    """A checkpoint of another strategy resumed where the DeepSpeed JSON defines its own optimizer or
    scheduler: their state is DeepSpeed's, which a conversion cannot fill."""
    strategy.prepare(torch.nn.Linear(2, 2))
    folder = save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=1), keep_last=1)
    state = TrainerState.read(folder)
    state.strategy, state.world_size = "FSDP2", 2  # as an FSDP2 run on 2 processes records it
    state.write(folder)
    owning = dataclasses.replace(strategy, ds_owned=("optimizer", "scheduler"))
    with pytest.raises(UserError) as info:
        load_checkpoint(owning, folder)
    assert str(info.value) == (
        f"checkpoint {folder} was saved under FSDP2 on 2 processes; resuming it under one process needs a conversion, "
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


def relaunch(tmp_path) -> Strategy:
    """A fresh strategy in the same process, as a resumed run has."""
    AcceleratorState._reset_state(True)
    return Strategy.launch(mixed_precision="no", global_batch=2, micro_batch=2, max_grad_norm=1.0,
                           project_dir=str(tmp_path), trackers=[], timeout_s=60)


def test_resuming_with_another_model_shape_is_one_line_before_loading(tmp_path, strategy, tiny_model):
    """The checkpoint's model_files/config.json against the live model's config: strategy-independent,
    and the first differing parameter named with both shapes."""
    run = RunDir(tmp_path / "run")
    model = strategy.prepare(tiny_model("llama", hidden_size=64))
    folder = save_checkpoint(strategy, run, TrainerState(step=3), keep_last=1,
                             model_files=lambda d: model.config.save_pretrained(d))
    for sizes, first in (
        ({"hidden_size": 128}, "model.embed_tokens.weight is [300, 64] there and [300, 128] in this run"),
        ({"num_hidden_layers": 3}, "model.layers.2.self_attn.q_proj.weight is absent there and [64, 64] in this run"),
    ):
        other = relaunch(tmp_path)
        other.prepare(tiny_model("llama", **{"hidden_size": 64, **sizes}))
        with pytest.raises(UserError) as info:
            load_checkpoint(other, folder)
        assert str(info.value) == (
            f"checkpoint {folder} holds a different model: {first}; resume with the model settings it was saved "
            "with, or start a new output_dir"
        )
    same = relaunch(tmp_path)
    same.prepare(tiny_model("llama", hidden_size=64))
    assert load_checkpoint(same, folder).step == 3


def test_a_size_mismatch_the_configs_cannot_see_is_translated_too(tmp_path, strategy):
    """Without model_files/config.json (or a model without a config) the loader's own error is
    turned into the same line."""
    run = RunDir(tmp_path / "run")
    strategy.prepare(torch.nn.Linear(4, 3))
    folder = save_checkpoint(strategy, run, TrainerState(step=1), keep_last=1)
    other = relaunch(tmp_path)
    other.prepare(torch.nn.Linear(4, 5))
    with pytest.raises(UserError) as info:
        load_checkpoint(other, folder)
    assert str(info.value) == (
        f"checkpoint {folder} holds a different model: weight is [3, 4] there and [5, 4] in this run; resume with "
        "the model settings it was saved with, or start a new output_dir"
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


class _Payload:
    """What a tampered pickle carries: unpickling it would run code."""

    def __reduce__(self):
        return (print, ("code ran while unpickling",))


def test_a_checkpoint_never_unpickles_more_than_numbers(tmp_path, strategy, capsys):
    """Accelerate loads registered objects (the LR schedule) with weights_only=False; the toolkit
    loads them itself, as numbers, and refuses a file that names code."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule_object = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model, optimizer = strategy.prepare(model, optimizer)
    strategy.accelerator.register_for_checkpointing(schedule_object)
    folder = save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=1), keep_last=1)
    schedule = folder / "custom_checkpoint_0.pkl"
    assert schedule.is_file()
    load_checkpoint(strategy, folder)  # the real one: plain numbers
    torch.save({"last_epoch": _Payload()}, schedule)
    with pytest.raises(UserError, match=r"custom_checkpoint_0.pkl holds pickled objects beyond tensors and numbers"):
        load_checkpoint(strategy, folder)
    assert "code ran" not in capsys.readouterr().out


def test_a_resume_with_another_seed_or_global_batch_is_refused_and_anything_else_is_not(tmp_path):
    """The batch order is a function of (seed, step, global batch): changing either would feed the
    resumed run other sequences. A checkpoint older than the global-batch field is not refused."""
    TrainerState(step=3, seed=7, global_batch_size=12).write(tmp_path)
    check_same_data_order(tmp_path, seed=7, global_batch_size=12)
    with pytest.raises(UserError, match=r"train.global_batch_size=12 and this run has train.global_batch_size=16: "
                                        r"the data position would not carry over; resume with train.global_batch_size=12"):
        check_same_data_order(tmp_path, seed=7, global_batch_size=16)
    with pytest.raises(UserError, match=r"seed=7 and this run has seed=8"):
        check_same_data_order(tmp_path, seed=8, global_batch_size=12)
    TrainerState(step=3, seed=7).write(tmp_path)  # written before the field existed: 0
    check_same_data_order(tmp_path, seed=7, global_batch_size=16)


def a_zero3_checkpoint(folder, missing: str | None = None):
    """The files a 2-process ZeRO-3 save leaves (empty: only their names are checked), less `missing`."""
    names = ["latest", "random_states_0.pkl", "random_states_1.pkl",
             *(f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim"))]
    for name in names:
        if name != missing:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("pytorch_model" if name == "latest" else "")
    TrainerState(step=4, strategy="DeepSpeed ZeRO-3", world_size=2).write(folder)
    return folder


@pytest.mark.parametrize("missing", ["pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "random_states_1.pkl",
                                     "manifest.json"])
def test_a_rank_file_missing_from_a_checkpoint_is_named_before_any_load(tmp_path, missing):
    """One rank's ZeRO-3 optimizer file deleted was DeepSpeed's ValueError traceback where no manifest
    lists it: a checkpoint older than manifests, or one whose manifest.json is gone (its state file
    names one, and the check was skipped)."""
    folder = a_zero3_checkpoint(tmp_path / "step-4", None if missing == "manifest.json" else missing)
    if missing == "manifest.json":
        write_manifest(folder)
        state = TrainerState.read(folder)
        state.manifest_crc32 = crc32(folder / MANIFEST)
        state.write(folder)
        assert check_state_file(folder) is None
        (folder / MANIFEST).unlink()
        expected = f"{folder / MANIFEST} is missing (its trainer_state.json names one), so its files cannot be checked"
    elif missing.endswith(".pt"):
        expected = (f"{folder}/pytorch_model/*zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (the optimizer "
                    "state of rank 1 of 2)")
    else:
        expected = f"{folder / missing} is missing (rank 1 of 2 writes it)"
    assert check_state_file(folder) == expected
    assert check_state_file(a_zero3_checkpoint(tmp_path / "whole")) is None
