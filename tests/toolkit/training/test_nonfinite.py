"""NaN and inf in the shared loop, driven in one process: a skipped step changes nothing and the
data moves on, skips in a row or on_nonfinite=abort stop the run, a resume refuses non-finite or
dead weights, and rotation keeps the last checkpoint that passed its checks."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate.state import AcceleratorState
from one_process_trainer import packed_blocks, start_trainer
from safetensors.torch import load_file, save_file

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.run.faults import NONFINITE_ENV as ENV
from toolkit.run.folder import STATE_FILE
from toolkit.run.manifest import crc32, write_manifest
from toolkit.training.metrics import read_metrics
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.step import Diverged
from toolkit.training.trainer import Trainer

OFF = ["eval.every=0", "checkpoint.every=0"]  # what these tests leave out unless they say


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory):
    return packed_blocks(tiny_texts, tiny_tokenizer, tmp_path_factory.mktemp("packed"), held_out=False)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def start(out, blocks, tokenizer, tiny_model, *overrides) -> Trainer:
    return start_trainer(out, blocks, tokenizer, tiny_model, *OFF, *overrides)


def train_to(trainer: Trainer, step: int) -> None:
    trainer.cfg.train.max_steps = step
    trainer.fit()


def snapshot(trainer: Trainer) -> dict:
    return {
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": {k: {n: v.clone() for n, v in s.items()} for k, s in trainer.optimizer.optimizer.state.items()},
        "scheduler": dict(trainer.scheduler.state_dict()),
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for name, value in a["weights"].items():
        assert torch.equal(value, b["weights"][name]), name
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for key, state in a["optimizer"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"][key][name]), name
    assert a["scheduler"] == b["scheduler"] and a["lr"] == b["lr"]


def rows(trainer: Trainer, key: str) -> list[dict]:
    return [r for r in read_metrics(trainer.run.metrics) if key in r]


def test_a_skipped_step_changes_nothing_and_the_next_batch_trains(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                                   monkeypatch, capsys):
    monkeypatch.setenv(ENV, "batch@2")
    trainer = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=3")
    train_to(trainer, 1)
    before = snapshot(trainer)
    assert before["optimizer"]  # Adam has moments and a step count to keep
    train_to(trainer, 2)
    assert trainer.step == 2
    assert_same(snapshot(trainer), before)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "step 2: non-finite loss (NaN or inf); batch skipped" in capsys.readouterr().out

    # the next step trains on its own batch (step 3's), not step 2's again, from the weights before the skip
    with torch.no_grad():
        micro = [collate(trainer.feed.blocks[m], "sdpa") for m in trainer.feed.schedule.micro_batches(2)]
        expected = sum(forward_loss_sum(trainer.model, b).double().item() for b in micro)
        expected /= int(trainer.feed.targets[trainer.feed.schedule.global_indices(2)].sum())
    train_to(trainer, 3)
    trainer.close()
    assert rows(trainer, "nonfinite") == [{"kind": "nonfinite", "step": 2, "nonfinite": "loss", "action": "skip", "in_a_row": 1}]
    losses = {r["step"]: r for r in rows(trainer, "loss")}
    assert sorted(losses) == [1, 3]
    assert losses[3]["loss"] == pytest.approx(expected, rel=1e-6)
    assert losses[3]["lr"] == before["lr"]  # the rate step 2 would have trained with: the schedule did not move
    step3 = int(trainer.feed.tokens[trainer.feed.schedule.global_indices(2)].sum())
    assert losses[3]["tokens"] == losses[1]["tokens"] + step3  # the skipped batch was not trained on
    assert not any(not torch.isfinite(p).all() for p in trainer.model.parameters())


def test_skips_in_a_row_stop_the_run(tmp_path, blocks, tiny_tokenizer, tiny_model, monkeypatch):
    """A skip, a good step (the count starts again), then 2 in a row with max_nonfinite_skips=2."""
    monkeypatch.setenv(ENV, "grad@2,grad@4,grad@5")
    trainer = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=6",
                    "train.max_nonfinite_skips=2", "checkpoint.every=3")
    with pytest.raises(Diverged) as stop:
        trainer.fit()
    trainer.close()
    assert str(stop.value) == (
        "non-finite gradients (NaN or inf) at step 5 (2 steps in a row, train.max_nonfinite_skips=2); the run "
        "diverged and that step was not applied: lower optim.lr or check the data of step 5, then resume from the "
        f"last good checkpoint with resume={trainer.run.checkpoint(3)}"
    )
    assert rows(trainer, "nonfinite") == [
        {"kind": "nonfinite", "step": 2, "nonfinite": "grad", "action": "skip", "in_a_row": 1},
        {"kind": "nonfinite", "step": 4, "nonfinite": "grad", "action": "skip", "in_a_row": 1},
        {"kind": "nonfinite", "step": 5, "nonfinite": "grad", "action": "abort", "in_a_row": 2},
    ]
    assert [r["step"] for r in rows(trainer, "loss")] == [1, 3]


def test_on_nonfinite_abort_stops_at_the_first_before_the_update(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                                monkeypatch):
    monkeypatch.setenv(ENV, "loss@2")
    trainer = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=3",
                    "train.on_nonfinite=abort")
    train_to(trainer, 1)
    before = snapshot(trainer)
    with pytest.raises(Diverged, match=r"^non-finite loss \(NaN or inf\) at step 2 \(train.on_nonfinite=abort\); .* "
                                       r"then start over$"):
        train_to(trainer, 3)
    trainer.close()
    assert_same(snapshot(trainer), before)
    assert rows(trainer, "nonfinite") == [{"kind": "nonfinite", "step": 2, "nonfinite": "loss", "action": "abort", "in_a_row": 1}]


ON_DEVICE = ["optim.fused=true", "logging.every=100"]  # torch's fused AdamW; only the last step needs its values


def run_to_the_end(trainer: Trainer) -> dict:
    trainer.fit()
    trainer.close()
    return snapshot(trainer)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_skip_left_on_the_device_is_read_a_step_later_to_the_same_run(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                                        monkeypatch, schedule):
    """train.step_sync=none: the fused optimizer skips step 2 on the device, and the host reads it while step 3
    runs. Weights, Adam state, schedule, token count and the skip's row are the host's; under a decaying
    schedule step 3 alone trains at step 4's rate (the schedule had stepped for step 2, then steps back)."""
    monkeypatch.setenv(ENV, "grad@2")
    said = {}
    ran = {}
    for sync in ("host", "none"):
        trainer = start(tmp_path / sync, blocks, tiny_tokenizer, tiny_model, *ON_DEVICE, "train.max_steps=4",
                        f"optim.schedule={schedule}", f"train.step_sync={sync}")
        assert trainer.skip_on_device == (sync == "none")
        skip = trainer.skip_or_abort
        monkeypatch.setattr(trainer, "skip_or_abort", lambda found, bar, step, t=trainer, skip=skip, sync=sync: (
            said.setdefault(sync, (step, t.step)), skip(found, bar, step)))
        ran[sync] = (run_to_the_end(trainer), rows(trainer, "nonfinite"), rows(trainer, "loss"))
    assert said == {"host": (2, 2), "none": (2, 3)}  # step 2's skip, said at step 2 or at step 3
    (host, host_skips, host_losses), (late, late_skips, late_losses) = ran["host"], ran["none"]
    assert late_skips == host_skips == [{"kind": "nonfinite", "step": 2, "nonfinite": "grad", "action": "skip", "in_a_row": 1}]
    assert [r["tokens"] for r in late_losses] == [r["tokens"] for r in host_losses]  # step 4's row: 3 steps' tokens
    assert late["scheduler"] == host["scheduler"] and late["lr"] == host["lr"]
    if schedule == "constant":  # two models: their Adam states compared in parameter order
        assert_same({**late, "optimizer": dict(enumerate(late["optimizer"].values()))},
                    {**host, "optimizer": dict(enumerate(host["optimizer"].values()))})
    else:
        assert late["lr"] < host_losses[0]["lr"]  # the rate decays: step 3 trained at another one


def test_skips_left_on_the_device_in_a_row_stop_the_run_at_the_same_step(tmp_path, blocks, tiny_tokenizer,
                                                                          tiny_model, monkeypatch):
    monkeypatch.setenv(ENV, "grad@2,grad@3")
    trainer = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, *ON_DEVICE, "train.max_steps=6",
                    "train.max_nonfinite_skips=2", "train.step_sync=none")
    with pytest.raises(Diverged, match=r"^non-finite gradients \(NaN or inf\) at step 3 \(2 steps in a row"):
        trainer.fit()
    trainer.close()
    assert rows(trainer, "nonfinite") == [{"kind": "nonfinite", "step": 2, "nonfinite": "grad", "action": "skip", "in_a_row": 1},
                                          {"kind": "nonfinite", "step": 3, "nonfinite": "grad", "action": "abort", "in_a_row": 2}]
    assert trainer.step == 4  # read while step 4 ran


def test_step_sync_none_is_refused_where_the_host_decides(tmp_path, blocks, tiny_tokenizer, tiny_model):
    with pytest.raises(UserError) as refused:
        start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.step_sync=none")  # optim.fused=auto: not on CPU
    assert str(refused.value) == (
        "train.step_sync=none cannot skip a non-finite step on the device here: it needs torch's fused AdamW "
        "(optim.fused=true; auto fuses on CUDA only); use train.step_sync=auto or host")
    assert not start(tmp_path / "auto", blocks, tiny_tokenizer, tiny_model).skip_on_device  # auto on CPU: host


def test_config_checks_the_nonfinite_keys(tmp_path):
    with pytest.raises(ConfigError) as bad:
        load_config(PretrainConfig, None, [f"output_dir={tmp_path}", "train.max_nonfinite_skips=0",
                                           "train.on_nonfinite=ignore"])
    assert bad.value.problems == [
        "train.on_nonfinite='ignore' is not one of skip, abort",
        "train.max_nonfinite_skips=0 must be at least 1",
    ]
    cfg = load_config(PretrainConfig, None, [f"output_dir={tmp_path}"])
    assert (cfg.train.on_nonfinite, cfg.train.max_nonfinite_skips) == ("skip", 3)


def rewrite_weights(folder, change) -> None:
    """Change a checkpoint's model.safetensors and re-write its manifest (and the state's record of
    it), so that only the weight checks can tell."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    state = TrainerState.read(folder)
    state.manifest_crc32 = crc32(write_manifest(folder, skip=(STATE_FILE,)))  # as a save writes it: state last
    state.write(folder)


def test_a_resume_refuses_non_finite_weights(tmp_path, blocks, tiny_tokenizer, tiny_model):
    first = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=2", "checkpoint.every=2")
    first.fit()
    first.close()
    folder = first.run.checkpoint(2)
    rewrite_weights(folder, lambda t: t["model.norm.weight"].__setitem__(5, math.inf))
    with pytest.raises(UserError) as refused:
        start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=4", "resume=auto")
    assert str(refused.value) == (
        f"checkpoint {folder} holds non-finite weights (model.norm.weight has NaN or inf); resume from an earlier "
        "checkpoint with resume=PATH, or start a new output_dir"
    )


def test_a_resume_stops_on_a_dead_model_after_its_first_step(tmp_path, blocks, tiny_tokenizer, tiny_model):
    """All-zero weights are finite, but predict uniformly (loss ln 300) and get no gradient at all."""
    first = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=2", "checkpoint.every=2")
    first.fit()
    first.close()
    folder = first.run.checkpoint(2)
    rewrite_weights(folder, lambda t: [v.zero_() for v in t.values()])
    resumed = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=4", "resume=auto")
    with pytest.raises(UserError) as stopped:
        resumed.fit()
    resumed.close()
    assert str(stopped.value) == (
        f"checkpoint {folder} holds a dead model: the first step after resuming gave a loss of {math.log(300):.4f}, "
        "ln(vocabulary 300) = uniform guessing, and a gradient norm of exactly 0 (its weights are garbage, e.g. a "
        "flipped exponent bit); resume from an earlier checkpoint with resume=PATH, or start a new output_dir"
    )
    assert resumed.step == 3 and [p.name for p in resumed.run.complete_checkpoints()] == ["step-2"]


def test_rotation_keeps_the_last_checkpoint_that_passed(tmp_path, blocks, tiny_tokenizer, tiny_model, monkeypatch):
    """keep_last=1: the checkpoint saved right after a skipped step does not push out the good one
    before it, nor does one with non-finite weights; the next good checkpoint does."""
    monkeypatch.setenv(ENV, "batch@3")
    trainer = start(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.max_steps=4",
                    "checkpoint.every=1", "checkpoint.keep_last=1")
    run = trainer.run
    train_to(trainer, 3)
    assert [p.name for p in run.complete_checkpoints()] == ["step-2", "step-3"]
    assert TrainerState.read(run.checkpoint(2)).suspect == ""
    assert TrainerState.read(run.checkpoint(3)).suspect == "saved right after 1 skipped non-finite step(s)"
    train_to(trainer, 4)
    assert [p.name for p in run.complete_checkpoints()] == ["step-4"]

    with torch.no_grad():
        trainer.accelerator.unwrap_model(trainer.model).model.norm.weight[0] = math.nan
    trainer.state.step = 5  # as if step 5 had put a NaN into the weights
    trainer.save_checkpoint()
    trainer.close()
    assert [p.name for p in run.complete_checkpoints()] == ["step-4", "step-5"]
    assert TrainerState.read(run.checkpoint(5)).suspect == "non-finite weights (model.norm.weight)"
