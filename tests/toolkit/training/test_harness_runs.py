"""eval.harness_tasks during pretraining (toolkit.training.harness_runs): an evaluation step's model scored by
recipes/evaluate.py in a process of its own while training goes on, and the run's numbers untouched by it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from harness_tasks import unreachable_hub, write_tasks
from one_process_trainer import packed_blocks, start_trainer
from recipe_runner import ROOT

from toolkit.config.errors import UserError
from toolkit.training.harness_runs import LOG, HarnessRuns


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory):
    return packed_blocks(tiny_texts, tiny_tokenizer, tmp_path_factory.mktemp("packed"), held_out=True)


def finished(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code])
    process.wait()
    return process


def test_a_scoring_that_ends_is_logged_at_its_step_and_one_that_fails_is_a_warning(tmp_path):
    """What the main process does with a scoring once it ends (the scoring itself, recipes/evaluate.py in a process
    beside a real run: test_evaluate.py's domain run, which also shows that run bit-equal to one without)."""
    said, logged = [], []
    runs = object.__new__(HarnessRuns)  # its tasks unchecked: the harness's index is not the point
    runs.root, runs.main, runs.say, runs.now = tmp_path, True, said.append, lambda: 9  # training is at step 9
    runs.log = lambda kind, row, at: logged.append((kind, row, at))
    results = {"results": {}, "llm_toolkit_evaluation": {"scores": {"harness/t/acc": 0.5}}}
    (tmp_path / "step-4.json").write_text(json.dumps(results))
    (tmp_path / "step-4").mkdir()
    runs.running = (4, "train", finished("pass"), tmp_path / "step-4", False)
    runs.poll()
    assert logged == [("harness", {"step": 4, "phase": "train", "harness/t/acc": 0.5}, 9)]  # trackers: at step 9
    assert said == ["step 4 (train): harness t/acc 0.5000"] and not (tmp_path / "step-4").exists()
    assert runs.running is None

    said.clear()
    (tmp_path / "final").mkdir()
    runs.running = (6, "after", finished("raise SystemExit(3)"), tmp_path / "final", True)
    runs.wait()
    assert said == [f"warning: the harness could not score step 6 (exit code 3); its output is in {tmp_path / LOG}; "
                    "training goes on"]
    assert len(logged) == 1 and (tmp_path / "final").is_dir()  # final/ is kept


def test_training_does_not_wait_for_a_scoring_and_a_run_that_ends_ends_it(tmp_path):
    """A step due while the last scoring still runs is not scored, said once; a run that stops or fails kills its
    scoring and removes the model it was given (abandon, from toolkit.training.entry)."""
    said = []
    runs = object.__new__(HarnessRuns)
    runs.root, runs.main, runs.say, runs.skipped = tmp_path, True, said.append, 0
    (tmp_path / "step-2").mkdir()
    started = tmp_path / "started"  # the pid of a process the scoring started, once it has
    slow = subprocess.Popen([sys.executable, "-c", "import pathlib, subprocess, sys, time; child = subprocess.Popen("
                             "[sys.executable, '-c', 'import time; time.sleep(60)']); "
                             f"pathlib.Path({str(started)!r}).write_text(str(child.pid)); time.sleep(60)"],
                            start_new_session=True)
    for _ in range(300):
        if started.exists() and started.read_text():
            break
        time.sleep(0.05)
    runs.running = (2, "train", slow, tmp_path / "step-2", False)
    for step in (4, 6):
        runs.at_step(types.SimpleNamespace(step=step), due=True)  # no model is written: nothing of it is read
    assert runs.skipped == 2 and runs.running[0] == 2 and slow.poll() is None
    assert said == ["step 4 is not scored: step 2's scoring still runs, and training does not wait for it (raise "
                    "eval.every or lower eval.harness_limit to score every one; said once)"]
    runs.abandon()
    assert slow.poll() is not None and not (tmp_path / "step-2").exists() and runs.running is None
    status = Path(f"/proc/{started.read_text()}/status")  # what the scoring started went with it: gone, or a zombie
    for _ in range(40):
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.05)
    assert not status.exists() or "\nState:\tZ" in status.read_text()


def test_the_first_scoring_may_be_final_s_with_no_harness_folder_yet(tmp_path, monkeypatch):
    """eval.every=0: the run's one scoring is final/'s, at the end, and harness/ is made for its log and JSON (the
    scoring program replaced by one that ends at once: the command is `llm-toolkit evaluate`'s, recipes/evaluate.py)."""
    from toolkit.training import harness_runs
    from toolkit.training.harness import HarnessConfig

    popen, started = subprocess.Popen, []

    def quick(command, **kwargs):
        started.append(command)
        return popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(harness_runs.subprocess, "Popen", quick)
    said = []
    runs = object.__new__(HarnessRuns)
    runs.cfg, runs.root, runs.say, runs.running = HarnessConfig(["t"], limit=4), tmp_path / "run" / "harness", \
        said.append, None
    (tmp_path / "run" / "final").mkdir(parents=True)
    runs.start(7, "after", tmp_path / "run" / "final", keep=True)
    runs.running[2].wait()
    assert (runs.root / LOG).is_file() and said == []
    assert started[0][1:] == [str(ROOT / "recipes" / "evaluate.py"), "--from", str(tmp_path / "run" / "final"),
                              "--tasks", "t", "--batch-size", "8", "--output", str(runs.root / "step-7.json"),
                              "--overwrite", "--limit", "4"]


def test_offline_a_hub_task_is_refused_before_the_harness_index_data_or_model(tmp_path, blocks, tiny_tokenizer,
                                                                              tiny_model, monkeypatch):
    """eval.harness_tasks=[arc_easy] without a network: the run's one line at once, not 7 s of the harness's index and
    ~30 s of the hub client's retries first."""
    import toolkit.training.harness

    monkeypatch.setattr(toolkit.training.harness, "_indexed", lambda *a: pytest.fail("the harness's index was built"))
    with unreachable_hub(monkeypatch, tmp_path / "datasets-cache"):
        start = time.monotonic()
        with pytest.raises(UserError, match=r"^task arc_easy \(allenai/ai2_arc\) reads its documents from the Hugging "
                                            r"Face Hub, which cannot be reached from here .* or give tasks of your own "
                                            r"files with eval.harness_include_path \(docs/evaluation.md"):
            start_trainer(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "eval.harness_tasks=[arc_easy]")
        assert time.monotonic() - start < 5


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
