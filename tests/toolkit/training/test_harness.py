"""toolkit.training.harness: its settings' wrong values, its unknown and unreachable tasks, its scores' names. The
harness scoring real tasks, through recipes/evaluate.py: tests/recipes/test_evaluate.py."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
from harness_tasks import write_tasks

from toolkit.config.errors import UserError
from toolkit.training.harness import INSTALL, HarnessConfig, check_tasks, harness, scores, task_manager

WRONG = [
    (HarnessConfig([]), "--tasks '' names no task"),
    (HarnessConfig(["a", " "]), "--tasks 'a, ' names no task"),
    (HarnessConfig(["a"], include_path="/nonexistent/tasks"), "is not a folder of task YAML files"),
    (HarnessConfig(["a"], num_fewshot=-1), "--num-fewshot -1 must be >= 0"),
    (HarnessConfig(["a"], limit=0), "--limit 0 must be > 0"),
    (HarnessConfig(["a"], batch_size=0), "--batch-size 0 must be >= 1"),
]


@pytest.mark.parametrize(("cfg", "said"), WRONG)
def test_each_wrong_value_is_one_problem(cfg, said):
    assert [said in p for p in cfg.validate()] == [True]


def test_an_unknown_task_names_the_closest_and_a_hub_task_offline_says_so(monkeypatch, tmp_path):
    harness()
    cfg = HarnessConfig(["arc_easyy"])
    manager = task_manager(cfg)
    with pytest.raises(UserError, match=r"--tasks arc_easyy: unknown task, .*did you mean arc_easy"):
        check_tasks(cfg, manager)
    import datasets.config
    import huggingface_hub.constants

    # as HF_HUB_OFFLINE=1 says it, read by the libraries when imported (here: earlier); without it, this machine's
    # missing network answers the same, after its timeouts
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)  # empty, whatever this machine's holds
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    # a task, and a tag of the harness's (its tasks' datasets, found in its index: no single file names a tag)
    for name in ("arc_easy", "ai2_arc"):
        with pytest.raises(UserError, match=rf"^task {name} \(allenai/ai2_arc\) reads its documents from the Hugging "
                                            r"Face Hub, which is not read while HF_HUB_OFFLINE=1 is set"):
            check_tasks(HarnessConfig([name]), manager)


def test_without_the_harness_the_line_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match="lm-evaluation-harness, which is not installed") as info:
        harness()
    assert INSTALL in str(info.value)


def test_scores_name_each_task_and_metric_and_leave_out_the_errors():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1},
                           "g": {"exact_match,first_word": 0.25, "exact_match_stderr,first_word": "N/A"}}}
    assert scores(results) == {"harness/t/acc": 0.5, "harness/g/exact_match[first_word]": 0.25}


def _rows(folder: Path, change) -> None:
    data = folder / "continuation.jsonl"
    data.write_text("".join(json.dumps(change(json.loads(line))) + "\n" for line in data.read_text().splitlines()))


def _yaml(folder: Path, old: str, new: str) -> None:
    path = folder / "continuation.yaml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


# every way a user's task folder (--include-path, eval.harness_include_path) can be malformed x the one line it gets,
# before any model loads; a new way found fails a probe until it has its row
MALFORMED = {
    "YAML that does not parse": (lambda d: (d / "continuation.yaml").write_text("task: [unclosed\n"),
                                 "unknown task; continuation.yaml in --include-path .* is not a task YAML it can read \\(ParserError"),
    "YAML not UTF-8": (lambda d: (d / "continuation.yaml").write_bytes(b"task: pydoc_continuation\n\xff\n"),
                       "unknown task; continuation.yaml in --include-path .* is not a task YAML it can read \\(UnicodeDecodeError"),
    "YAML without task:": (lambda d: _yaml(d, "task: pydoc_continuation\n", ""),
                           "unknown task; continuation.yaml in --include-path .* names no task \\(it has no `task:` key\\)"),
    "documents missing": (lambda d: (d / "continuation.jsonl").unlink(),
                          "could not be built from its YAML and documents \\(json\\): FileNotFoundError"),
    "documents not JSON": (lambda d: (d / "continuation.jsonl").write_text("not json\n"),
                           "could not be built .*: ArrowInvalid: JSON parse error"),
    "no documents": (lambda d: (d / "continuation.jsonl").write_text(""),
                     "task pydoc_continuation has no documents \\(json\\): give it at least one"),
    "a field the template reads missing": (lambda d: _rows(d, lambda r: {k: v for k, v in r.items() if k != "context"}),
                                           "could not be built .*: UndefinedError: 'context' is undefined"),
    "a label past the choices": (lambda d: _rows(d, lambda r: {**r, "label": 9}),
                                 "could not be built .*: IndexError"),
    "a template that does not parse": (lambda d: _yaml(d, '"{{context}}"', '"{{context"'),
                                       "could not be built .*: TemplateSyntaxError"),
    "an unknown output_type": (lambda d: _yaml(d, "output_type: multiple_choice", "output_type: bogus"),
                               "could not be built .*: ValueError: Got invalid output_type 'bogus'"),
    "an unknown metric": (lambda d: _yaml(d, "metric: acc", "metric: nosuchmetric"),
                          "task pydoc_continuation's metric nosuchmetric is not one the harness knows .*fix its metric_list"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_each_malformed_task_folder_is_one_line_before_any_model(case, tmp_path, capsys, monkeypatch, caplog):
    harness()
    import evaluate.config

    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)  # as HF_HUB_OFFLINE=1 says it: no hub lookups
    folder = tmp_path / "tasks"
    write_tasks(folder)
    damage, said = MALFORMED[case]
    damage(folder)
    cfg = HarnessConfig(["pydoc_continuation"], str(folder))
    with pytest.raises(UserError) as info:
        check_tasks(cfg, task_manager(cfg))
    line = str(info.value)
    assert "\n" not in line and len(line) < 400 and re.search(said, line), line
    assert capsys.readouterr().out == ""  # the harness's own prints kept off the terminal
    # and its log lines ("nosuchmetric not found in the evaluate library!" went to stderr before the toolkit's line)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("lm_eval") and r.levelno >= logging.WARNING] == []
