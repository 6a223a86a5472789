"""Real one-process checkpoints for the tests of toolkit.strategy.by_name and loading:
a tiny LLaMA (tied embeddings) under AdamW with the recipe's two parameter groups and a schedule,
trained a few steps by a real single-process Strategy and saved by save_checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from toolkit.checkpoint.manager import save_checkpoint
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.run.folder import RunDir
from toolkit.strategy.distributed import Strategy


def launch(tmp_path: Path) -> Strategy:
    """A fresh one-process strategy in this process, as a new run has."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Strategy.launch(mixed_precision="no", global_batch=2, micro_batch=2, max_grad_norm=1.0,
                           project_dir=str(tmp_path), trackers=[], timeout_s=60)


def trained(strategy: Strategy, tiny_model, steps: int = 2):
    """(model, optimizer) prepared by `strategy`, `steps` optimizer steps in."""
    model = tiny_model("llama", tie_word_embeddings=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2)
    model, optimizer = strategy.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    strategy.accelerator.register_for_checkpointing(schedule)
    ids = torch.arange(16).reshape(2, 8)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return model, optimizer


def saved_checkpoint(tmp_path: Path, tiny_model, step: int = 2):
    """(checkpoint folder, the model and optimizer that wrote it) after `step` steps."""
    strategy = launch(tmp_path)
    model, optimizer = trained(strategy, tiny_model, steps=step)
    folder = save_checkpoint(strategy, RunDir(tmp_path / "run"), TrainerState(step=step), keep_last=1)
    return folder, model, optimizer


@pytest.fixture
def fresh_accelerate():
    """Accelerate's process-wide state dropped after the test, so the next one launches anew."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def one_process_checkpoint(tmp_path, tiny_model, fresh_accelerate):
    """(checkpoint folder, the model and optimizer that wrote it) after 2 steps, one process."""
    return saved_checkpoint(tmp_path, tiny_model)


@pytest.fixture
def strategy(tmp_path):
    """A real one-process Strategy in this process, for the test alone."""
    AcceleratorState._reset_state(True)
    yield Strategy.launch(mixed_precision="no", global_batch=2, micro_batch=2, max_grad_norm=1.0,
                          project_dir=str(tmp_path), trackers=[], timeout_s=60)
    AcceleratorState._reset_state(True)
