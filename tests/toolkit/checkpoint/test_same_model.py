"""A checkpoint of another model is refused in one line (toolkit.checkpoint.same_model), through a real
one-process save and resume."""

from __future__ import annotations

import pytest
import torch
from one_process_checkpoints import launch

from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.manager import load_checkpoint, save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir


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
        other = launch(tmp_path)
        other.prepare(tiny_model("llama", **{"hidden_size": 64, **sizes}))
        with pytest.raises(UserError) as info:
            load_checkpoint(other, Checkpoint.read(folder))
        assert str(info.value) == (
            f"checkpoint {folder} holds a different model: {first}; resume with the model settings it was saved "
            "with, or start a new output_dir"
        )
    same = launch(tmp_path)
    same.prepare(tiny_model("llama", hidden_size=64))
    load_checkpoint(same, Checkpoint.read(folder))
    assert same.accelerator.step == 3 * same.accumulation  # where the run was


def test_a_size_mismatch_the_configs_cannot_see_is_translated_too(tmp_path, strategy):
    """Without model_files/config.json (or a model without a config) the loader's own error is
    turned into the same line."""
    run = RunDir(tmp_path / "run")
    strategy.prepare(torch.nn.Linear(4, 3))
    folder = save_checkpoint(strategy, run, TrainerState(step=1), keep_last=1)
    other = launch(tmp_path)
    other.prepare(torch.nn.Linear(4, 5))
    with pytest.raises(UserError) as info:
        load_checkpoint(other, Checkpoint.read(folder))
    assert str(info.value) == (
        f"checkpoint {folder} holds a different model: weight is [3, 4] there and [5, 4] in this run; resume with "
        "the model settings it was saved with, or start a new output_dir"
    )
