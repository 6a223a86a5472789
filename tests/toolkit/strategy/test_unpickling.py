"""The one rule for a checkpoint's pickled files (toolkit.strategy.unpickling): numbers only, whoever reads
them (Accelerate's load_state, DeepSpeed's engine), with DeepSpeed's own three classes allowed."""

from __future__ import annotations

import inspect

import pytest
import torch

from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.manager import load_checkpoint, save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir
from toolkit.strategy.unpickling import numbers_only_resume


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
    load_checkpoint(strategy, Checkpoint.read(folder))  # the real one: plain numbers
    torch.save({"last_epoch": _Payload()}, schedule)
    with pytest.raises(UserError, match=r"custom_checkpoint_0.pkl holds pickled objects beyond tensors and numbers"):
        load_checkpoint(strategy, Checkpoint.read(folder))
    assert "code ran" not in capsys.readouterr().out


def test_deepspeed_checkpoint_files_are_read_as_numbers_only(tmp_path, capsys):
    """DeepSpeed loads its files with weights_only=False; inside numbers_only_resume its own
    classes (as a ZeRO optimizer file holds them) still load, and a file naming code is refused."""
    import pickle

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    engine = TorchCheckpointEngine()
    real = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                                         "state": {0: torch.ones(3)}}}, real)
    tampered = tmp_path / "tampered.pt"
    torch.save({"optimizer_state_dict": _Payload()}, tampered)
    with numbers_only_resume():
        loaded = engine.load(str(real), map_location="cpu")
        assert loaded["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0
        with pytest.raises(pickle.UnpicklingError, match="GLOBAL print was not an allowed global"):
            engine.load(str(tampered), map_location="cpu")
    assert "code ran" not in capsys.readouterr().out
    assert TorchCheckpointEngine.load is not None and "weights_only=False" in inspect.getsource(TorchCheckpointEngine.load)
