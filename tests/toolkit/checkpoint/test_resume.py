"""A resume is one call (toolkit.checkpoint.resume): it reads the checkpoint's state once, checks it against this
run, loads it, and hands back the state to continue from, with this run's own settings for the next checkpoint."""

from __future__ import annotations

import pytest
import torch

from toolkit.checkpoint.manager import save_checkpoint
from toolkit.checkpoint.resume import resume
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.declarations import declared
from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir
from toolkit.training.recipe_config import PretrainConfig

ON_RESUME = declared(PretrainConfig, "resume")


def test_a_resume_reads_the_checkpoint_once_and_continues_from_it(tmp_path, strategy, monkeypatch):
    model = torch.nn.Linear(4, 3)
    model, optimizer = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    run = RunDir(tmp_path / "run")
    trained = {"optim.lr": 0.1, "optim.weight_decay": 0.0}
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        save_checkpoint(strategy, run, TrainerState(step=step, tokens_seen=8 * step, seed=3, global_batch_size=2,
                                                    settings=trained, last_eval={"eval_loss": 1.5}), keep_last=2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()

    reads = []
    read = TrainerState.read.__func__
    monkeypatch.setattr(TrainerState, "read", classmethod(lambda cls, folder: reads.append(folder) or read(cls, folder)))
    ranks, said = [], []
    fresh = TrainerState(seed=3, global_batch_size=2, settings={**trained, "train.max_steps": 9})
    folder, state = resume(strategy, run, run.checkpoint(2), fresh, auto=True, streaming=False, max_steps=9,
                           peak_lr=0.1, on_resume=ON_RESUME, rank_files=ranks.append, say=said.append)

    assert reads == [run.checkpoint(2)]  # the state file read once, for every check and the load
    assert folder == run.checkpoint(2) and ranks == [folder]
    assert (state.step, state.tokens_seen, state.last_eval) == (2, 16, {"eval_loss": 1.5})  # where the run was
    assert state.settings == fresh.settings  # this run's, recorded by its next checkpoint
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    assert strategy.accelerator.step == 2 * strategy.accumulation
    assert said == []

    # each check is asked of the one value it read: a changed seed is refused before anything loads
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(UserError, match="was trained with seed=3 and this run has seed=4"):
        resume(strategy, run, run.checkpoint(2), TrainerState(seed=4, global_batch_size=2), auto=False,
               streaming=False, max_steps=9, peak_lr=0.1, on_resume=ON_RESUME)
    assert not model.weight.any()
