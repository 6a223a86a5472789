"""eval.harness_tasks during pretraining (toolkit.training.harness_runs): an evaluation step's model scored by
recipes/evaluate.py in a process of its own while training goes on, and the run's numbers untouched by it."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from harness_tasks import write_tasks
from one_process_trainer import packed_blocks, start_trainer

from toolkit.config import UserError
from toolkit.training.metrics import read_metrics

SCORED = ["train.max_steps=4", "eval.every=2", "checkpoint.every=0"]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory):
    return packed_blocks(tiny_texts, tiny_tokenizer, tmp_path_factory.mktemp("packed"), held_out=True)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


@pytest.mark.distributed  # the scoring is a process of its own
def test_a_step_is_scored_beside_training_which_trains_bit_equal_to_a_run_without(tmp_path, blocks, tiny_tokenizer,
                                                                                   tiny_model):
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    plain = start_trainer(tmp_path / "plain", blocks, tiny_tokenizer, tiny_model, *SCORED)
    plain.fit()
    plain.close()
    expected = weights(plain)

    AcceleratorState._reset_state(True)
    scored = start_trainer(tmp_path / "scored", blocks, tiny_tokenizer, tiny_model, *SCORED,
                           "eval.harness_tasks=[pydoc_continuation]", f"eval.harness_include_path={tasks}",
                           "eval.harness_limit=4")
    scored.fit()
    scored.harness.wait()  # recipes/pretrain.py scores final/ here; the unit has none
    scored.close()
    rows = read_metrics(scored.run.metrics)
    train = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]
    assert train == [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(plain.run.metrics)
                     if r["kind"] == "train"]
    assert all(torch.equal(v, expected[k]) for k, v in weights(scored).items())
    harness = [r for r in rows if r["kind"] == "harness"]
    assert [(r["step"], r["phase"]) for r in harness] == [(2, "train")]  # step 4, the last: final/'s, by the recipe
    results = json.loads((scored.run.harness / "step-2.json").read_text())
    assert harness[0]["harness/pydoc_continuation/acc"] == results["results"]["pydoc_continuation"]["acc,none"]
    assert results["results"]["pydoc_continuation"]["sample_len"] == 4  # eval.harness_limit
    assert not (scored.run.harness / "step-2").exists()  # the model is removed once scored
    assert "[evaluate] Hugging Face model folder" in (scored.run.harness / "harness.log").read_text()


def test_tasks_are_checked_before_any_data_or_model(tmp_path, blocks, tiny_tokenizer, tiny_model, monkeypatch):
    """The shots a task cannot give, in the key's own name, when the Trainer starts (the unknown task's line is
    recipes/evaluate.py's, tested there)."""
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    with pytest.raises(UserError, match="^eval.harness_num_fewshot=40: task pydoc_continuation has 39 examples to "
                                        "draw shots from; give at most 39$"):
        start_trainer(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "eval.harness_tasks=[pydoc_continuation]",
                      f"eval.harness_include_path={tasks}", "eval.harness_num_fewshot=40")
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # the extra not installed
    with pytest.raises(UserError, match=r"^evaluation needs EleutherAI's lm-evaluation-harness, which is not "
                                        r"installed: pip install -e '\.\[eval\]'"):
        start_trainer(tmp_path / "run2", blocks, tiny_tokenizer, tiny_model, "eval.harness_tasks=[pydoc_continuation]")
