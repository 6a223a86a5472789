"""Benchmarks from EleutherAI's lm-evaluation-harness on a Hugging Face model folder: tasks checked by name before any
work, scored by the harness itself (`simple_evaluate` with its `hf` model, as its CLI `lm_eval --model hf` does, so the
numbers are the CLI's to the last digit), and its table.

The harness is an extra (`pip install -e '.[eval]'`): the core install does not carry it.
"""

from __future__ import annotations

import difflib
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config import UserError

INSTALL = "pip install -e '.[eval]' (or pip install lm-eval)"


@dataclass
class HarnessConfig:
    """What the harness is asked: task names, a folder of the user's own task YAMLs, and its own knobs."""

    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None  # None: each task's own
    limit: float | None = None  # documents per task (a fraction below 1, as the harness takes it)
    batch_size: int = 8

    def validate(self) -> list[str]:
        problems = []
        if not self.tasks or any(not name.strip() for name in self.tasks):
            problems.append(f"--tasks {','.join(self.tasks)!r} names no task; name at least one, comma-separated (a,b)")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            problems.append(f"--include-path {self.include_path} is not a folder of task YAML files")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            problems.append(f"--num-fewshot {self.num_fewshot} must be >= 0")
        if self.limit is not None and not self.limit > 0:  # nan too
            problems.append(f"--limit {self.limit:g} must be > 0 (documents per task, or a fraction of them below 1)")
        if self.batch_size < 1:
            problems.append(f"--batch-size {self.batch_size} must be >= 1")
        return problems


def harness():
    """The lm_eval package, quiet: its INFO lines and the notices of `git describe` outside a repository."""
    try:
        import lm_eval
        import lm_eval.evaluator
    except ImportError:
        raise UserError(f"evaluation needs EleutherAI's lm-evaluation-harness, which is not installed: {INSTALL}") from None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    import datasets

    datasets.disable_progress_bars()  # a task's split generated from its files; the harness's own bars stay
    # the results record the commit of the folder it runs in; outside a repository git says "fatal: ..." on stderr
    lm_eval.evaluator.get_git_commit_hash = _git_commit
    return lm_eval


def _git_commit() -> str | None:
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL, text=True).strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None


def task_manager(cfg: HarnessConfig):
    return _indexed(str(Path(cfg.include_path).absolute()) if cfg.include_path else None)


@functools.lru_cache(maxsize=4)
def _indexed(include_path: str | None):
    """The harness's index of its ~15,000 tasks and the user's: 7 s to build on a CPU core, made once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def check_tasks(cfg: HarnessConfig, manager) -> None:
    """Every name is a task or group the harness knows (its own, or a YAML under --include-path), and its data can be
    read here: one line for the first that is not, before any model loads."""
    known = manager.all_tasks
    for name in cfg.tasks:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" or in --include-path {cfg.include_path}" if cfg.include_path else ""
        raise UserError(f"--tasks {name}: unknown task, not among the harness's {len(known):,} tasks{where}{hint} "
                        "(list them with: lm-eval ls tasks)")
    for name in cfg.tasks:
        try:
            manager.load([name])  # builds the task: reads (or downloads) its documents
        except Exception as exc:  # the datasets and hub errors of a task whose data is not here
            raise UserError(_unreadable(name, manager, exc)) from None


def _unreadable(name: str, manager, exc: Exception) -> str:
    config = _task_config(name, manager)
    dataset = config.get("dataset_path", "?")
    kind = type(exc).__name__
    offline = any(word in f"{kind} {exc}" for word in ("Offline", "offline", "Connection", "resolve", "LocalEntryNotFound",
                                                        "DatasetNotFound", "couldn't be found", "Couldn't reach"))
    if offline:
        return (f"task {name} reads its documents from the Hugging Face Hub ({dataset}), which cannot be reached from "
                f"here ({kind}); run it where the Hub is reachable, or give a task of your own files with --include-path")
    return f"task {name}'s documents ({dataset}) could not be read: {kind}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _task_config(name: str, manager) -> dict[str, Any]:
    entry = manager.task_index.get(name)
    return dict(entry.cfg or {}) if entry is not None else {}


def score(folder: Path, cfg: HarnessConfig, manager) -> dict | None:
    """The harness's results for the model in `folder` (None on every process but the first of a data-parallel run)."""
    lm_eval = harness()
    return lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folder)}, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot,
        limit=cfg.limit, batch_size=cfg.batch_size, task_manager=manager, log_samples=False,
        device="cuda:0",  # the CLI's default: the harness takes the CPU where there is no GPU, and a launch's own GPU
    )


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def scores(results: dict) -> dict[str, float]:
    """Each task's metrics as `harness/<task>/<metric>` (the filter dropped where it is the harness's default, none):
    the rows a fine-tune's before/after table and metrics.jsonl take."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")
            if metric in ("alias", "sample_len") or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if filtered in ("none", "") else f"{metric}[{filtered}]"
            out[f"harness/{task}/{name}"] = float(value)
    return out
