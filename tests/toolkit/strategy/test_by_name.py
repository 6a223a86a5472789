"""A converted checkpoint loaded into a fresh run (toolkit.strategy.by_name, and ddp.load_into), from real
one-process checkpoints: weights and Adam state as the run that saved them held them, and a run
that trains parameters the checkpoint has no state for, or lacks weights for, refused in one line.
The FSDP2 and DeepSpeed setters need a launch: tests/recipes/test_resume_elsewhere.py runs them."""

from __future__ import annotations

import pytest
import torch
from one_process_checkpoints import launch, trained

from toolkit.checkpoint.conversion import cached_conversion
from toolkit.checkpoint.formats import Checkpoint
from toolkit.config.errors import UserError
from toolkit.models.parameters import parameter_names
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState
from toolkit.strategy.ddp.files import load_into as load_into_ddp

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def test_the_converted_state_loads_into_a_fresh_run(tmp_path, one_process_checkpoint, tiny_model):
    folder, model, optimizer = one_process_checkpoint
    made, _ = cached_conversion(Checkpoint.read(folder))
    strategy = launch(tmp_path)
    fresh, fresh_optimizer = trained(strategy, tiny_model, steps=0)
    load_into_ddp(strategy, ConsolidatedState(made))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    names, fresh_names = parameter_names(model), parameter_names(fresh)
    loaded = {fresh_names[id(p)][0]: s for p, s in fresh_optimizer.optimizer.state.items()}
    for param, held in optimizer.optimizer.state.items():
        got = loaded[names[id(param)][0]]
        assert got["step"] == held["step"] == 2
        assert all(torch.equal(got[key], held[key]) for key in MOMENTS)


def test_a_run_that_trains_other_parameters_is_refused(tmp_path, one_process_checkpoint, tiny_model):
    """Every parameter this run trains must find its Adam state, or its moments would restart silently."""
    folder, _, _ = one_process_checkpoint
    made, _ = cached_conversion(Checkpoint.read(folder))
    strategy = launch(tmp_path)
    fresh, fresh_optimizer = trained(strategy, tiny_model, steps=0)
    state = ConsolidatedState(made)
    state.meta["steps"].pop("model.norm.weight")
    with pytest.raises(UserError) as info:
        load_into_ddp(strategy, state)
    assert str(info.value) == (
        f"the converted checkpoint {made} has no Adam state for model.norm.weight (and 0 more), which this run "
        "trains: it was saved with other trainable parameters (another adapter?)"
    )


def test_a_run_of_another_model_is_refused(tmp_path, one_process_checkpoint, tiny_model):
    """A parameter the converted checkpoint has no weight for (an older checkpoint without model_files/, whose
    shapes could not be compared first)."""
    folder, _, _ = one_process_checkpoint
    made, _ = cached_conversion(Checkpoint.read(folder))
    strategy = launch(tmp_path)
    fresh, fresh_optimizer = trained(strategy, tiny_model, steps=0)
    fresh.register_parameter("extra", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    with pytest.raises(UserError) as info:
        load_into_ddp(strategy, ConsolidatedState(made))
    assert str(info.value) == f"the converted checkpoint {made} has no weight for extra: it holds another model"
