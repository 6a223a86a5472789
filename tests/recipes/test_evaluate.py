"""recipes/evaluate.py: lm-evaluation-harness tasks of a user's own (tests/support/harness_tasks.py: a multiple-choice
and a generation task from the CPython docs) scored on what runs made, as the harness's own CLI scores them; a model
trained on the tasks' sentences beats its base; every strategy's checkpoint scores as its final/; bad input is one
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import wrong_arguments
from harness_tasks import (
    OFFLINE_VARIABLES,
    datasets_lines,
    unreachable_hub,
    write_cached_hub_task,
    write_tasks,
)
from recipe_runner import ROOT, recipe_module, run_recipe

from toolkit.training.metrics import read_metrics

TASKS = "pydoc_continuation,pydoc_last_word"
TINY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
        "tokenizer.vocab_size=512", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=8",
        "optim.warmup_steps=4", "eval.every=0", "data.val_fraction=0", "logging.trackers=[]",
        "samples.max_new_tokens=0", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def evaluate():
    return recipe_module("evaluate").main


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("harness") / "tasks"
    return folder, write_tasks(folder)


@pytest.fixture(scope="module")
def domain(tasks, tmp_path_factory, data_cache) -> tuple[Path, Path]:
    """(a run that trained 150 steps on the tasks' sentences, its base: the same model at its random start)."""
    work = tmp_path_factory.mktemp("domain")
    text = work / "domain.txt"
    text.write_text("\n\n".join(tasks[1]) + "\n")
    run = work / "run"
    # eval.harness_tasks: step 75's model scored beside training, and final/ at the end; the same run without it
    # attention dropout: the runs draw random numbers every step, so that one drawn by the scoring would show
    common = [*TINY, f"data.path={text}", "train.max_steps=150", "eval.every=75", "logging.every=5",
              "model.config.attention_dropout=0.1"]
    run_recipe("pretrain", [*common, f"output_dir={run}", f"eval.harness_tasks=[{TASKS}]",
                            f"eval.harness_include_path={tasks[0]}"], nproc=1, cache=data_cache)
    run_recipe("pretrain", [*common, f"output_dir={work / 'plain'}"], nproc=1, cache=data_cache)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = work / "base"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run / "final")).save_pretrained(base)
    AutoTokenizer.from_pretrained(run / "final").save_pretrained(base)
    return run, base


def scored(evaluate, source: Path, tasks: Path, out: Path, *more: str) -> dict:
    assert evaluate(["--from", str(source), "--tasks", TASKS, "--include-path", str(tasks), "--output", str(out),
                     *more]) == 0
    return json.loads(out.read_text())


def files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.distributed  # a pretraining run and the harness's CLI, each a process of its own
def test_the_recipe_scores_as_the_harness_cli_and_training_on_the_domain_beats_the_base(evaluate, tasks, domain,
                                                                                         tmp_path, capsys):
    run, base = domain
    before = files(run)
    trained = scored(evaluate, run, tasks[0], tmp_path / "run.json")
    out = capsys.readouterr().out
    assert f"[evaluate] Hugging Face model folder {run / 'final'}: tasks pydoc_continuation, pydoc_last_word" in out
    assert "|pydoc_continuation|" in out and "|pydoc_last_word   |" in out and f"wrote {tmp_path / 'run.json'}" in out
    assert files(run) == before, "evaluation wrote into the run"
    untrained = scored(evaluate, base, tasks[0], tmp_path / "base.json")
    mine = trained["llm_toolkit_evaluation"]["scores"]
    assert set(mine) == {"harness/pydoc_continuation/acc", "harness/pydoc_last_word/exact_match[first_word]"}
    theirs = untrained["llm_toolkit_evaluation"]["scores"]
    # the run's own scores, logged in metrics.jsonl: step 75's while it trained on, and final/'s as this recipe's
    logged = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "harness"]
    assert [(r["step"], r["phase"]) for r in logged] == [(75, "train"), (150, "after")]
    assert {k: v for k, v in logged[1].items() if k.startswith("harness/")} == mine
    assert sorted(p.name for p in (run / "harness").iterdir()) == ["harness.log", "step-150.json", "step-75.json"]
    # and evaluation changed nothing the run computed: every logged loss and gradient norm, and final/'s weights
    plain = run.parent / "plain"
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] \
        == [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(plain / "metrics.jsonl") if r["kind"] == "train"]
    assert (run / "final" / "model.safetensors").read_bytes() == (plain / "final" / "model.safetensors").read_bytes()
    # measured: acc 0.75 against the base's 0.3 (chance: 0.25), exact match 0.6 against 0.0
    assert mine["harness/pydoc_continuation/acc"] >= theirs["harness/pydoc_continuation/acc"] + 0.25, (mine, theirs)
    assert mine["harness/pydoc_last_word/exact_match[first_word]"] >= 0.3 > theirs[
        "harness/pydoc_last_word/exact_match[first_word]"], (mine, theirs)

    # the harness's own command line on the same folder, with the recipe's batch size
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                          f"pretrained={run / 'final'}", "--tasks", TASKS, "--include_path", str(tasks[0]),
                          "--batch_size", "8", "--output_path", str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    assert trained["results"] == theirs["results"]  # every metric and stderr, to the last digit
    assert trained["configs"].keys() == theirs["configs"].keys()


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_checkpoint_of_any_strategy_scores_as_its_final_folder(strategy, strategy_runs, evaluate, tasks, tmp_path):
    """The matrix's run saved step-6 and final/ from the same weights: consolidated from the strategy's own files
    into a folder beside the output (gone after), they score the same, to the last digit."""
    run, _ = strategy_runs(strategy)
    final = scored(evaluate, run, tasks[0], tmp_path / "final.json", "--limit", "8")
    checkpoint = scored(evaluate, run, tasks[0], tmp_path / "step.json", "--limit", "8", "--checkpoint", "step-6")
    assert checkpoint["results"] == final["results"]
    assert "checkpoint" in checkpoint["llm_toolkit_evaluation"]["source"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.json", "step.json"]  # the consolidated folder gone


def test_on_cpu_a_launch_of_two_evaluates_on_its_first_process_alone(evaluate, tasks, model_folder, tmp_path,
                                                                     monkeypatch, capsys):
    run = model_folder
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert evaluate(["--from", str(run), "--tasks", TASKS, "--include-path", str(tasks[0]), "--output",
                     str(tmp_path / "out.json")]) == 0
    assert capsys.readouterr().out == "" and not (tmp_path / "out.json").exists()
    monkeypatch.setenv("RANK", "0")
    scored(evaluate, run, tasks[0], tmp_path / "out.json", "--limit", "4")
    said = capsys.readouterr().out
    assert said.startswith("[evaluate] 2 processes were launched, and the harness splits its work over GPUs only: "
                           "the first process evaluates alone on the CPU\n")


def bad_inputs(run: Path, tasks: Path, tmp_path: Path) -> list[tuple[list[str], str]]:
    writing = tmp_path / "writing" / "checkpoints" / "step-4"  # a save still writing: no trainer_state.json yet
    writing.mkdir(parents=True)
    (writing / "model.safetensors").write_bytes(b"")
    (tmp_path / "theirs.json").write_text("{}")
    (tmp_path / "earlier.json").write_text('{"llm_toolkit_evaluation": {}}')
    here = ["--include-path", str(tasks)]
    return [
        (["--from", str(run), "--tasks", "pydoc_continuatoin", *here],
         "error: --tasks pydoc_continuatoin: unknown task, not among the harness's"),
        (["--from", str(run), "--tasks", "arc_easy", *here],
         "error: task arc_easy (allenai/ai2_arc) reads its documents from the Hugging Face Hub, which is not read "
         "while HF_HUB_OFFLINE=1 is set"),
        (["--from", str(tasks), "--tasks", "pydoc_continuation", *here],
         f"error: --from {tasks} is not a model, run, checkpoint or adapter folder"),
        (["--from", str(writing), "--tasks", "pydoc_continuation", *here],
         f"error: {writing} is an incomplete checkpoint (no trainer_state.json: its save was interrupted); evaluate "
         "an earlier one"),
        (["--from", str(run), "--tasks", "pydoc_continuation", *here, "--output", str(tmp_path / "earlier.json")],
         f"error: {tmp_path / 'earlier.json'} exists; give another --output, or --overwrite to replace it"),
        (["--from", str(run), "--tasks", "pydoc_continuation", *here, "--output", str(tmp_path / "theirs.json"),
          "--overwrite"], f"error: {tmp_path / 'theirs.json'} was not written by recipes/evaluate.py"),
        (["--from", str(run), "--tasks", "pydoc_continuation", "--include-path", str(tmp_path / "none")],
         "error: --include-path"),
        (["--from", str(run), "--tasks", ",", *here], "error: --tasks ',' names no task"),
        (["--from", str(run), "--tasks", "pydoc_continuation", *here, "--limit", "0"], "error: --limit 0 must be > 0"),
    ]


def test_bad_input_is_one_line(evaluate, tasks, model_folder, tmp_path, monkeypatch, capsys):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what this machine's network answers
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")  # whatever this machine's
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for argv, said in bad_inputs(model_folder, tasks[0], tmp_path):
        assert evaluate([*argv, *([] if "--output" in argv else ["--output", str(tmp_path / "x.json")])]) == 2, argv
        captured = capsys.readouterr()
        assert captured.err.startswith(said) and captured.err.count("\n") == 1, (argv, captured.err)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert evaluate(["--from", str(model_folder), "--tasks", "t", "--output", str(tmp_path / "x.json")]) == 2
    assert "pip install -e '.[eval]'" in capsys.readouterr().err


def test_offline_a_hub_task_is_one_line_within_seconds_as_a_user_reads_it(model_folder, tmp_path):
    """`llm-toolkit evaluate --from runs/ft --tasks arc_easy,hellaswag` without a network took 36 s and printed 6 lines
    of the hub client's retries before its line. A new Python, as a user starts it (its imports' notices included),
    the Hub unreachable whatever this machine's network (HF_ENDPOINT: a port nothing listens on)."""
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARIABLES}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "recipes/evaluate.py", "--from", str(model_folder), "--tasks",
                           "arc_easy,hellaswag", "--output", str(tmp_path / "scores.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    assert done.stderr.startswith(
        "error: tasks arc_easy (allenai/ai2_arc) and hellaswag (Rowan/hellaswag) read their documents from the Hugging "
        "Face Hub, which cannot be reached from here (127.0.0.1: Connection refused), and the datasets cache ("
        f"{tmp_path / 'datasets-cache'}) does not hold them: connect to the network, "), done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]  # no retry, warning or notice besides it
    # ~3 s on 2 idle cores, of which 2 are the imports every recipe makes; the retries alone took 23
    assert took < 15, f"{took:.1f} s"
    assert not (tmp_path / "scores.json").exists()


def test_offline_a_hub_task_the_datasets_cache_holds_is_scored_from_it(evaluate, model_folder, tmp_path, monkeypatch,
                                                                      capfd):
    with unreachable_hub(monkeypatch, tmp_path / "datasets-cache") as cache:
        name = write_cached_hub_task(tmp_path / "tasks", cache)
        with datasets_lines() as heard:
            assert evaluate(["--from", str(model_folder), "--tasks", name, "--include-path", str(tmp_path / "tasks"),
                             "--limit", "4", "--output", str(tmp_path / "scores.json")]) == 0
    out, err = capfd.readouterr()
    assert f"|{name}" in out and "harness/pydoc_hub/acc" in (tmp_path / "scores.json").read_text()
    assert "Retrying" not in err and heard == [], (err[-3000:], heard)


def test_ctrl_c_is_one_line_and_exit_130(evaluate, tasks, model_folder, tmp_path, monkeypatch, capsys):
    """Issue 63: a Ctrl-C while the harness scored was a 33-frame KeyboardInterrupt traceback."""
    import toolkit.training.harness

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(toolkit.training.harness, "score", interrupted)
    out = tmp_path / "scores.json"
    try:
        code = evaluate(["--from", str(model_folder), "--tasks", "pydoc_continuation", "--include-path", str(tasks[0]),
                         "--output", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt went on: a traceback")
    assert code == 130
    err = capsys.readouterr().err
    assert err == "[evaluate] stopped by Ctrl-C (SIGINT) before its scores were written; nothing was written\n", err
    assert not out.exists()


# every option of evaluate.py by kind (tests/support/wrong_arguments.py lists each kind's wrong values)
KINDS = {"--from": "folder", "--checkpoint": "name", "--tasks": "names", "--include-path": "folder",
         "--num-fewshot": "count or zero", "--limit": "amount", "--batch-size": "count", "--base": "folder",
         "--output": "output", "--overwrite": "switch", "-h": "help"}


def test_every_option_of_evaluate_has_a_kind():
    """A new option fails here until KINDS says what it takes."""
    evaluate = recipe_module("evaluate")
    found = {action.option_strings[0] for action in evaluate.parser()._actions}
    assert found == set(KINDS)
    assert set(evaluate.PATH_OPTIONS) == {o for o, kind in KINDS.items() if kind in ("file", "folder", "output")}


@pytest.mark.parametrize("option, case", wrong_arguments.cases(KINDS))
def test_every_wrong_value_of_every_option_is_one_line(evaluate, capsys, tmp_path, tasks, model_folder, monkeypatch,
                                                       option, case):
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    (tmp_path / "file.txt").write_text("x")
    fill = {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt")}
    argv, value = wrong_arguments.argv_of(option, KINDS[option], case, fill)
    given = {"--from": str(model_folder), "--tasks": "pydoc_continuation", "--include-path": str(tasks[0]),
             "--output": str(tmp_path / "out.json")}
    base = [a for o, v in given.items() if o != option for a in (o, v)]
    code = evaluate([*base, *argv])
    out, err = capsys.readouterr()
    wrong_arguments.assert_one_line(code, out, err, option, value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing written
