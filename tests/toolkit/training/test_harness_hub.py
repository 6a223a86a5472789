"""toolkit.training.harness_hub: where the Hub cannot be reached, the harness tasks that read it are refused in one
line within seconds, before the harness's index (7 s) and any model; a task whose dataset the datasets cache holds,
and the user's own tasks, still run. The recipe's line as a user reads it: tests/recipes/test_evaluate.py."""

from __future__ import annotations

import socket
import time

import datasets.config
import huggingface_hub.constants
import pytest
from harness_tasks import datasets_lines, unreachable_hub, write_cached_hub_task, write_tasks

from toolkit.config.errors import UserError
from toolkit.data import hub
from toolkit.training.harness import KEYS, HarnessConfig, check_tasks, harness, task_manager
from toolkit.training.harness_hub import check_hub

FIX = ("or fill that cache where the Hub is reachable (one run of the {tasks} does) and copy it here, or give tasks of "
       "your own files with {option} (docs/evaluation.md#offline-and-your-own-tasks)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The Hub unreachable, no offline variable set, an empty datasets cache."""
    with unreachable_hub(monkeypatch, tmp_path / "datasets-cache") as folder:
        yield folder


def test_the_hub_tasks_are_refused_in_one_line_within_seconds(cache):
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        check_hub(HarnessConfig(["arc_easy", "hellaswag"]))
    took = time.monotonic() - start
    assert str(info.value) == (
        "tasks arc_easy (allenai/ai2_arc) and hellaswag (Rowan/hellaswag) read their documents from the Hugging Face "
        f"Hub, which cannot be reached from here (127.0.0.1: Connection refused), and the datasets cache ({cache}) "
        "does not hold them: connect to the network, " + FIX.format(tasks="tasks", option="--include-path"))
    assert took < 3, f"{took:.1f} s"  # the harness's index alone takes 7, the hub client's retries took 30
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE  # what runs next reads the cache


def test_an_offline_variable_is_named_and_nothing_is_tried(cache, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as datasets reads the variable at its import
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("the Hub was tried"))
    with pytest.raises(UserError) as info:  # a training config's eval.harness_* keys, named as such
        check_hub(HarnessConfig(["arc_challenge"], named=KEYS))
    assert str(info.value) == (
        "task arc_challenge (allenai/ai2_arc) reads its documents from the Hugging Face Hub, which is not read while "
        f"HF_DATASETS_OFFLINE=1 is set, and the datasets cache ({cache}) does not hold it: unset HF_DATASETS_OFFLINE, "
        + FIX.format(tasks="task", option="eval.harness_include_path"))


def test_own_tasks_ask_nothing_and_a_group_of_them_names_its_hub_task(cache, tmp_path, monkeypatch):
    """--include-path's tasks replace the harness's of the same name (as in its index); a group's tasks are its."""
    tried = []
    monkeypatch.setattr(hub, "_connect", lambda *a: tried.append(a) or "refused (the test)")
    mine = tmp_path / "tasks"
    write_tasks(mine)
    (mine / "hellaswag.yaml").write_text((mine / "continuation.yaml").read_text()
                                         .replace("task: pydoc_continuation", "task: hellaswag"))
    check_hub(HarnessConfig(["pydoc_continuation", "pydoc_last_word", "hellaswag"], include_path=str(mine)))
    assert tried == [] and not datasets.config.HF_HUB_OFFLINE  # local documents: the Hub is not asked
    (mine / "group.yaml").write_text("group: mine\ntask:\n  - pydoc_continuation\n  - task: arc_easy\n    num_fewshot: 1\n")
    with pytest.raises(UserError, match=r"^task mine \(allenai/ai2_arc\) reads its documents from the Hugging Face "
                                        r"Hub, which cannot be reached from here \(refused \(the test\)\)"):
        check_hub(HarnessConfig(["mine"], include_path=str(mine)))
    assert len(tried) == 1


def test_a_cached_hub_task_is_built_offline_from_the_cache_without_a_retry(cache, tmp_path, capfd):
    folder = tmp_path / "tasks"
    name = write_cached_hub_task(folder, cache)
    cfg = HarnessConfig([name], include_path=str(folder))
    check_hub(cfg)  # not refused: its dataset is cached
    assert datasets.config.HF_HUB_OFFLINE  # the Hub is not asked for it again: the cache read at once
    harness()
    start = time.monotonic()
    with datasets_lines() as heard:
        check_tasks(cfg, task_manager(cfg))  # builds it: its documents read
    assert time.monotonic() - start < 10
    assert "Retrying" not in capfd.readouterr().err and heard == []
