"""A checkpoint as its state by parameter name (toolkit.checkpoint.conversion), from real one-process
checkpoints written by save_checkpoint: the conversion equals what the optimizer held, is cached
beside the checkpoint and made again when the checkpoint changes, and what cannot be converted is
refused in one line. Each format's reader on checkpoints of every strategy: test_ddp.py, test_fsdp.py,
test_deepspeed.py, test_pipeline.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from one_process_checkpoints import launch, trained
from unprivileged import error_as_nobody

from toolkit.checkpoint.conversion import cached_conversion, convert
from toolkit.checkpoint.formats import Checkpoint, saved_layout
from toolkit.checkpoint.manager import save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError
from toolkit.models.parameters import parameter_names
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import RunDir, converted_state
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState
from toolkit.strategy.ddp.files import OPTIMIZER_NAMES

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def test_the_conversion_holds_the_weights_and_adam_state_by_name(one_process_checkpoint, tmp_path):
    folder, model, optimizer = one_process_checkpoint
    made, cached = cached_conversion(Checkpoint.read(folder))
    assert made == converted_state(folder) == folder.with_name("step-2.converted") and not cached
    state = ConsolidatedState(made)
    assert state.source == ParallelLayout("single", 1) and state.source.describe() == "one process"
    older = shutil.copytree(made, tmp_path / "older")  # converted before the layout was recorded
    meta = json.loads((older / "optimizer.json").read_text())
    meta["source"] = {"folder": str(folder), "strategy": "DeepSpeed ZeRO-2", "world_size": 2, "state_crc32": "0"}
    (older / "optimizer.json").write_text(json.dumps(meta))
    assert ConsolidatedState(older).source == ParallelLayout("deepspeed", 2, zero_stage=2)
    names = parameter_names(model)
    assert ["model.embed_tokens.weight", "lm_head.weight"] in names.values()  # tied: one parameter, two names
    for param, held in optimizer.optimizer.state.items():
        name = names[id(param)][0]
        assert torch.equal(state.weight(names[id(param)]), param.detach())
        for key in MOMENTS:
            assert torch.equal(state.moments(name)[key], held[key]), (name, key)
        assert state.step(name) == 2.0
    assert state.trained == len(list(model.parameters()))
    assert json.loads((folder / OPTIMIZER_NAMES).read_text())["groups"][1] == [
        n for n, p in model.named_parameters() if p.ndim < 2
    ]


def test_the_conversion_is_reused_and_made_again_for_a_new_save_of_the_step(tmp_path, one_process_checkpoint, tiny_model):
    folder, _, _ = one_process_checkpoint
    made, _ = cached_conversion(Checkpoint.read(folder))
    stamp = (made / "optimizer.json").stat().st_mtime_ns
    assert cached_conversion(Checkpoint.read(folder)) == (made, True)
    assert (made / "optimizer.json").stat().st_mtime_ns == stamp
    # the same step saved again (another run in the folder): its state file differs, the conversion is redone
    strategy = launch(tmp_path)
    trained(strategy, tiny_model, steps=3)
    shutil.rmtree(folder)
    save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=2, tokens_seen=1), keep_last=1)
    assert not made.exists(), "a new save of step-2 leaves the conversion of the old one behind"
    again, cached = cached_conversion(Checkpoint.read(folder))
    assert again == made and not cached
    # a conversion interrupted before its rename is not taken for one
    shutil.rmtree(made)
    made.with_name(made.name + ".tmp").mkdir()
    assert cached_conversion(Checkpoint.read(folder)) == (made, False) and not made.with_name(made.name + ".tmp").exists()


def test_a_ddp_checkpoint_without_its_parameter_names_is_refused(one_process_checkpoint, tmp_path):
    folder, _, _ = one_process_checkpoint
    (folder / OPTIMIZER_NAMES).unlink()
    with pytest.raises(UserError) as info:
        convert(Checkpoint.read(folder), tmp_path / "out")
    assert str(info.value) == (
        f"checkpoint {folder} was saved before the toolkit recorded which parameter each of optimizer.bin's entries "
        "belongs to, so its Adam state cannot be moved to another strategy; resume it under DDP or one process (any "
        "number of processes)"
    )


def test_names_that_do_not_fit_optimizer_bin_are_refused(one_process_checkpoint, tmp_path):
    folder, _, _ = one_process_checkpoint
    names = json.loads((folder / OPTIMIZER_NAMES).read_text())
    names["groups"][1].pop()
    (folder / OPTIMIZER_NAMES).write_text(json.dumps(names))
    with pytest.raises(UserError, match=r"optimizer.bin and its parameter names disagree \(another save's files\)$"):
        convert(Checkpoint.read(folder), tmp_path / "out")


def test_a_checkpoint_without_the_recipes_schedule_is_refused(one_process_checkpoint, tmp_path):
    folder, _, _ = one_process_checkpoint
    (folder / "custom_checkpoint_0.pkl").unlink()
    with pytest.raises(UserError) as info:
        convert(Checkpoint.read(folder), tmp_path / "out")
    assert str(info.value) == (
        f"checkpoint {folder} (one process) holds no LR schedule of the recipe's (custom_checkpoint_0.pkl), so it "
        "cannot be converted for another strategy or world size; resume it under one process"
    )


class _Payload:
    def __reduce__(self):
        return (print, ("code ran while unpickling",))


def test_a_file_that_pickles_code_is_refused(one_process_checkpoint, tmp_path, capsys):
    folder, _, _ = one_process_checkpoint
    torch.save({"state": _Payload(), "param_groups": []}, folder / "optimizer.bin")
    with pytest.raises(UserError) as info:
        convert(Checkpoint.read(folder), tmp_path / "out")
    assert str(info.value) == (
        f"checkpoint {folder} holds pickled objects beyond tensors and numbers (print); the toolkit never "
        "unpickles those (they can run code): resume from a checkpoint the toolkit wrote"
    )
    assert "code ran" not in capsys.readouterr().out


def _deepspeed_folder(tmp_path, ds_config: dict) -> Path:
    """A DeepSpeed save's files as far as the converter looks before reading partitions."""
    folder = tmp_path / "step-1"
    (folder / "pytorch_model").mkdir(parents=True)
    (folder / "latest").write_text("pytorch_model")
    torch.save({"ds_config": ds_config, "param_shapes": [], "module": {}},
               folder / "pytorch_model" / "mp_rank_00_model_states.pt")
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        (folder / ("pytorch_model" if "optim" in name else "") / name).write_bytes(b"x")
    return folder


def _unfinished(folder):
    """A checkpoint without its state file, as far as the converter reads it."""
    return Checkpoint(folder, TrainerState(step=1), saved_layout(folder))


def test_deepspeed_checkpoints_the_converter_cannot_read_are_refused(tmp_path):
    owned = _deepspeed_folder(tmp_path / "a", {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}})
    with pytest.raises(UserError) as info:
        convert(_unfinished(owned), tmp_path / "out")
    assert str(info.value) == (
        f"checkpoint {owned} (DeepSpeed ZeRO-2 on 1 process) was trained with the optimizer its DeepSpeed JSON defines, "
        "whose state is DeepSpeed's own: it cannot be converted for another strategy or world size; resume it under "
        "DeepSpeed ZeRO-2 on 1 process with the same DeepSpeed JSON"
    )
    stage0 = _deepspeed_folder(tmp_path / "b", {"zero_optimization": {"stage": 0}})
    with pytest.raises(UserError) as info:
        convert(_unfinished(stage0), tmp_path / "out")
    assert str(info.value) == (
        f"checkpoint {stage0} (DeepSpeed ZeRO-0 on 1 process): DeepSpeed without ZeRO (stage 0) keeps no per-parameter "
        "state that DeepSpeed's converter reads; resume it under DeepSpeed ZeRO-0 on 1 process"
    )
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_beside_which_nothing_can_be_written_is_one_line(one_process_checkpoint, tmp_path):
    folder, _, _ = one_process_checkpoint
    # a folder that `nobody` may enter and read but not write (root owns it)
    shared = Path(tmp_path.root) / "tmp" / f"llm-toolkit-readonly-{os.getpid()}"
    shutil.rmtree(shared, ignore_errors=True)
    shutil.copytree(folder, shared / "step-2")
    try:
        for path in [shared, *shared.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if os.geteuid() != 0:
            shared.chmod(0o555)
        error = error_as_nobody(lambda: cached_conversion(Checkpoint.read(shared / "step-2")))
    finally:
        shared.chmod(0o755)
        shutil.rmtree(shared)
    assert error == (
        f"UserError: checkpoint {shared / 'step-2'} could not be converted into {shared / 'step-2.converted'} "
        f"(Permission denied: {shared / 'step-2.converted.tmp'}); copy the checkpoint into a writable folder with "
        "room for its weights and Adam state"
    )
