"""toolkit.training.harness: its settings' wrong values, its unknown and unreachable tasks, its scores' names. The
harness scoring real tasks, through recipes/evaluate.py: tests/recipes/test_evaluate.py."""

from __future__ import annotations

import sys

import pytest

from toolkit.config import UserError
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


def test_an_unknown_task_names_the_closest_and_a_hub_task_offline_says_so(monkeypatch):
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
    with pytest.raises(UserError, match=r"task arc_easy reads its documents from the Hugging Face Hub "
                                        r"\(allenai/ai2_arc\), which cannot be reached from here"):
        check_tasks(HarnessConfig(["arc_easy"]), manager)


def test_without_the_harness_the_line_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match="lm-evaluation-harness, which is not installed") as info:
        harness()
    assert INSTALL in str(info.value)


def test_scores_name_each_task_and_metric_and_leave_out_the_errors():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1},
                           "g": {"exact_match,first_word": 0.25, "exact_match_stderr,first_word": "N/A"}}}
    assert scores(results) == {"harness/t/acc": 0.5, "harness/g/exact_match[first_word]": 0.25}
