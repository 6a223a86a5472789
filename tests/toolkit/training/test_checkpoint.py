"""save_checkpoint / load_checkpoint with a real single-process strategy: what a checkpoint holds,
when it counts as complete, and how many are kept."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState

from toolkit.run_dir import MODEL_FILES, STATE_FILE, RunDir, TrainerState
from toolkit.strategy.distributed import Strategy
from toolkit.training.checkpoint import CheckpointConfig, load_checkpoint, save_checkpoint


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
    assert state == TrainerState(step=3, tokens_seen=30)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


def test_a_stale_incomplete_save_of_the_same_step_is_replaced(tmp_path, strategy):
    model = strategy.prepare(torch.nn.Linear(2, 2))
    run = RunDir(tmp_path / "run")
    stale = run.checkpoint(5)
    stale.mkdir(parents=True)
    (stale / "leftover.bin").write_bytes(b"half written")
    save_checkpoint(strategy, run, TrainerState(step=5), keep_last=1)
    assert not (stale / "leftover.bin").exists() and TrainerState.read(stale).step == 5
    del model
