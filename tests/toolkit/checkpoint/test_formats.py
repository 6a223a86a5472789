"""Which strategy wrote a checkpoint folder (toolkit.checkpoint.formats.saved_by), from folders laid out
as each strategy's `save_state` leaves them, and gathering full weights from the DDP and FSDP
layouts into files that load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file, save_file

from toolkit.checkpoint.formats import gather_full_weights, saved_by, saved_layout
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.ddp.files import OPTIMIZER_NAMES, read_optimizer_names

# what Accelerate's save_state writes besides the model, whatever the strategy
ACCELERATE_EXTRAS = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl")


def _touch(folder: Path, *names: str) -> Path:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    return folder


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(6, 4, generator=g), "norm.weight": torch.randn(4, generator=g)}


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield  # merge_fsdp_weights and save_state create Accelerate's process-wide state
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ------------------------------------------------------------------ saved_by


def test_a_ddp_or_single_process_save_is_ddp(tmp_path):
    assert saved_by(_touch(tmp_path, "model.safetensors", *ACCELERATE_EXTRAS)) == "ddp"


def test_sharded_safetensors_and_torch_bin_saves_are_ddp(tmp_path):
    sharded = _touch(tmp_path / "a", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json")
    assert saved_by(sharded) == "ddp"
    assert saved_by(_touch(tmp_path / "b", "pytorch_model.bin", *ACCELERATE_EXTRAS)) == "ddp"


def test_an_fsdp_save_is_fsdp(tmp_path):
    folder = _touch(tmp_path, "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata",
                    "optimizer_0/__0_0.distcp", "scheduler.bin", "random_states_0.pkl")
    assert saved_by(folder) == "fsdp"


def test_a_deepspeed_zero3_save_is_deepspeed(tmp_path):
    folder = _touch(tmp_path, "pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt",
                    "pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "random_states_0.pkl")
    (folder / "latest").write_text("pytorch_model")
    assert saved_by(folder) == "deepspeed"


def test_a_deepspeed_zero2_save_is_deepspeed(tmp_path):
    folder = _touch(tmp_path, "pytorch_model/mp_rank_00_model_states.pt",
                    "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (folder / "latest").write_text("pytorch_model")
    assert saved_by(folder) == "deepspeed"


@pytest.mark.parametrize(
    "names",
    [
        (),
        ACCELERATE_EXTRAS,  # a save whose model file is missing
        ("latest",),  # DeepSpeed's tag file alone
        ("config.json", "tokenizer.json", "weights.pt"),
        ("nested/model.safetensors",),  # weights one level down are not this folder's
    ],
    ids=["empty", "no-model", "latest-only", "other-files", "nested"],
)
def test_an_unknown_folder_is_none(tmp_path, names):
    assert saved_by(_touch(tmp_path, *names)) is None


# ------------------------------------------------------------------ gather_full_weights


def test_ddp_weights_are_linked_not_copied(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_weights(), str(folder / "model.safetensors"))
    _touch(folder, *ACCELERATE_EXTRAS)
    into = tmp_path / "full"
    into.mkdir()
    assert gather_full_weights("ddp", folder, into) == into
    assert sorted(p.name for p in into.iterdir()) == ["model.safetensors"]  # optimizer etc. stay behind
    link = into / "model.safetensors"
    assert link.is_symlink() and link.resolve() == (folder / "model.safetensors").resolve()
    torch.testing.assert_close(load_file(str(link)), _weights())


def test_ddp_shards_and_their_index_are_all_linked(tmp_path):
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    folder = _touch(tmp_path / "ckpt", *names, "optimizer.bin")
    into = tmp_path / "full"
    into.mkdir()
    gather_full_weights("ddp", folder, into)
    assert sorted(p.name for p in into.iterdir()) == sorted(names)
    assert all((into / n).resolve() == (folder / n).resolve() for n in names)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended
def test_fsdp_sharded_weights_are_merged_into_one_safetensors(tmp_path):
    import torch.distributed.checkpoint as dcp

    # as Accelerate's save_fsdp_model writes a SHARDED_STATE_DICT: {"model": state_dict} in DCP format
    folder = tmp_path / "ckpt"
    dcp.save({"model": _weights(1)}, storage_writer=dcp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")))
    _touch(folder, "scheduler.bin")
    assert saved_by(folder) == "fsdp"
    into = tmp_path / "full"
    into.mkdir()
    gather_full_weights("fsdp", folder, into)
    torch.testing.assert_close(load_file(str(into / "model.safetensors")), _weights(1))
    assert sorted(p.name for p in into.iterdir()) == ["model.safetensors"]  # torch's whole-state file is gone


def test_a_real_single_process_save_state_is_recognised_and_gathered(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)))
    folder = tmp_path / "checkpoint"
    accelerator.save_state(str(folder))
    assert saved_by(folder) == "ddp"
    into = tmp_path / "full"
    into.mkdir()
    gather_full_weights("ddp", folder, into)
    torch.testing.assert_close(load_file(str(into / "model.safetensors")), model.state_dict())


def test_an_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a family's checkpoint files: zero3"):
        gather_full_weights("zero3", tmp_path, tmp_path / "full")


# ------------------------------------------------------------------ saved_layout


def test_the_layout_a_checkpoint_records(tmp_path):
    TrainerState(step=3, layout=ParallelLayout("deepspeed", 2, zero_stage=2)).write(tmp_path)
    saved = saved_layout(tmp_path)
    assert saved == ParallelLayout("deepspeed", 2, zero_stage=2) and saved.files == "zero2"


def test_the_layout_of_an_older_checkpoint_is_read_from_its_files(tmp_path):
    """Before trainer_state.json recorded it: the kind from the files, the world size from the random
    states (one per rank), DeepSpeed's stage from the config in its model states."""
    ddp = _touch(tmp_path / "ddp", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl")
    TrainerState(step=3).write(ddp)
    assert saved_layout(ddp) == ParallelLayout("ddp", 2)
    one = _touch(tmp_path / "one", "model.safetensors", "optimizer.bin", "random_states_0.pkl")
    assert saved_layout(one) == ParallelLayout("single", 1)
    fsdp = _touch(tmp_path / "fsdp", "pytorch_model_fsdp_0/.metadata", *(f"random_states_{r}.pkl" for r in range(3)))
    assert saved_layout(fsdp) == ParallelLayout("fsdp", 3)
    zero = _touch(tmp_path / "zero", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", "random_states_0.pkl",
                  "random_states_1.pkl")
    (zero / "latest").write_text("pytorch_model")
    torch.save({"ds_config": {"zero_optimization": {"stage": 1}}, "module": {}},
               zero / "pytorch_model" / "mp_rank_00_model_states.pt")
    assert saved_layout(zero) == ParallelLayout("deepspeed", 2, zero_stage=1)
    stages = _touch(tmp_path / "stages", "pipeline_stage_0.safetensors", "pipeline_stage_1.safetensors", "random_states_0.pkl",
                    "random_states_1.pkl")
    assert saved_layout(stages) == ParallelLayout("ddp", 2, pp=2)
    assert saved_layout(_touch(tmp_path / "none", "notes.txt")) is None


def test_the_names_of_optimizer_bin_are_read_back(tmp_path):
    assert read_optimizer_names(tmp_path) is None  # a checkpoint older than the record
    (tmp_path / OPTIMIZER_NAMES).write_text('{"groups": [["a.weight"], ["a.bias"]]}')
    assert read_optimizer_names(tmp_path) == [["a.weight"], ["a.bias"]]
