"""Fixtures of the checkpoint tests: a real one-process Strategy in this process, and a real checkpoint it wrote."""

from __future__ import annotations

import pytest
from accelerate.state import AcceleratorState, GradientState
from one_process_checkpoints import saved_checkpoint

from toolkit.strategy.distributed import Strategy


@pytest.fixture
def strategy(tmp_path):
    AcceleratorState._reset_state(True)
    yield Strategy.launch(mixed_precision="no", global_batch=2, micro_batch=2, max_grad_norm=1.0,
                          project_dir=str(tmp_path), trackers=[], timeout_s=60)
    AcceleratorState._reset_state(True)


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
