"""Benchmarks from EleutherAI's lm-evaluation-harness on a Hugging Face model folder: tasks checked by name before any
work, scored by the harness itself (`simple_evaluate` with its `hf` model, as its CLI `lm_eval --model hf` does, so the
numbers are the CLI's to the last digit), and its table.

The harness is an extra (`pip install -e '.[eval]'`): the core install does not carry it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import math
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config import UserError

INSTALL = "pip install -e '.[eval]' (or pip install lm-eval)"


# how each setting is named where it was given: recipes/evaluate.py's options, or a training config's eval.harness_*
OPTIONS = {"tasks": "--tasks ", "include_path": "--include-path ", "num_fewshot": "--num-fewshot ", "limit": "--limit ",
           "batch_size": "--batch-size "}
KEYS = {name: f"eval.harness_{name}=" for name in OPTIONS}


@dataclass
class HarnessConfig:
    """What the harness is asked: task names, a folder of the user's own task YAMLs, and its own knobs."""

    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None  # None: each task's own
    limit: float | None = None  # documents per task (a fraction below 1, as the harness takes it)
    batch_size: int = 8
    named: dict[str, str] = field(default_factory=lambda: OPTIONS)

    @classmethod
    def of_training(cls, eval_cfg) -> HarnessConfig:
        """A training config's eval.harness_* keys (toolkit.training.evaluation.EvalConfig)."""
        return cls(list(eval_cfg.harness_tasks), eval_cfg.harness_include_path, eval_cfg.harness_num_fewshot,
                   eval_cfg.harness_limit, named=KEYS)

    def validate(self) -> list[str]:
        problems, n = [], self.named
        if not self.tasks or any(not isinstance(name, str) or not name.strip() for name in self.tasks):
            problems.append(f"{n['tasks']}{','.join(self.tasks)!r} names no task; name at least one, comma-separated (a,b)"
                            if n is OPTIONS else f"{n['tasks']}{self.tasks} holds an empty name; list task names, "
                            "for example [arc_easy, hellaswag]")
        if self.include_path is not None and not _is_dir(self.include_path):
            problems.append(f"{n['include_path']}{self.include_path} is not a folder of task YAML files")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            problems.append(f"{n['num_fewshot']}{self.num_fewshot} must be >= 0")
        if self.limit is not None and not 0 < self.limit < math.inf:  # nan too; the harness takes int(limit)
            problems.append(f"{n['limit']}{self.limit:g} must be > 0 and finite (documents per task, or a fraction of them below 1)")
        if self.batch_size < 1:
            problems.append(f"{n['batch_size']}{self.batch_size} must be >= 1")
        return problems


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # a name too long, a NUL
        return False


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
    """The user's own tasks alone where every name is one of them, as tasks (a group of them may name the harness's);
    else the harness's ~15,000 with them."""
    include = str(Path(cfg.include_path).absolute()) if cfg.include_path else None
    if include is not None:
        own = _indexed(include, False)
        entries = [own.task_index.get(name) for name in cfg.tasks]
        if all(entry is not None and entry.kind.name == "TASK" for entry in entries):
            return own
    return _indexed(include, True)


@functools.lru_cache(maxsize=4)
def _indexed(include_path: str | None, harness_tasks: bool):
    """The harness's index of tasks: 7 s to build with its own on a CPU core, made once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=harness_tasks)


def check_tasks(cfg: HarnessConfig, manager) -> None:
    """Every name is a task or group the harness knows (its own, or a YAML under --include-path), and its data can be
    read here: one line for the first that is not, before any model loads."""
    known = manager.all_tasks
    for name in cfg.tasks:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" or in {cfg.named['include_path']}{cfg.include_path}" if cfg.include_path else ""
        raise UserError(f"{cfg.named['tasks']}{name}: unknown task, not among the harness's {len(known):,} tasks{where}{hint} "
                        "(list them with: lm-eval ls tasks)")
    for name in cfg.tasks:
        try:
            built = manager.load([name])  # builds the task: reads (or downloads) its documents
        except Exception as exc:  # the datasets and hub errors of a task whose data is not here
            raise UserError(_unreadable(name, manager, exc, cfg.named["include_path"].strip(" ="))) from None
        if cfg.num_fewshot:  # the harness draws the shots from a task's examples, the document asked about aside
            for task, examples in _shot_pools(built.get("tasks", {})):
                if cfg.num_fewshot > examples:
                    raise UserError(f"{cfg.named['num_fewshot']}{cfg.num_fewshot}: task {task} has {examples} "
                                    f"examples to draw shots from; give at most {examples}")


def _shot_pools(tasks: dict) -> list[tuple[str, int]]:
    pools = []
    for task_name, task in tasks.items():
        if isinstance(task, dict):  # a group's tasks
            pools += _shot_pools(task)
        elif hasattr(task, "fewshot_docs"):
            docs = task.fewshot_docs()
            pools.append((task_name, max(0, len(docs) - 1) if docs is not None else 0))
    return pools


def _unreadable(name: str, manager, exc: Exception, include: str) -> str:
    config = _task_config(name, manager)
    dataset = config.get("dataset_path", "?")
    kind = type(exc).__name__
    offline = any(word in f"{kind} {exc}" for word in ("Offline", "offline", "Connection", "resolve", "LocalEntryNotFound",
                                                        "DatasetNotFound", "couldn't be found", "Couldn't reach"))
    if offline:
        return (f"task {name} reads its documents from the Hugging Face Hub ({dataset}), which cannot be reached from "
                f"here ({kind}); run it where the Hub is reachable, or give a task of your own files with {include}")
    return f"task {name}'s documents ({dataset}) could not be read: {kind}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _task_config(name: str, manager) -> dict[str, Any]:
    entry = manager.task_index.get(name)
    return dict(entry.cfg or {}) if entry is not None else {}


def score(model, cfg: HarnessConfig, manager, tokenizer=None) -> dict | None:
    """The harness's results for `model`: a folder (None on every process but the first of a data-parallel run), or a
    model in memory with its `tokenizer`, scored where it lies. The harness seeds Python's, NumPy's and torch's
    generators as its CLI does; a training process gets its own states back, so that its run goes on untouched."""
    lm_eval = harness()
    if isinstance(model, (str, Path)):
        model, model_args = "hf", {"pretrained": str(model)}
    else:
        from lm_eval.models.huggingface import HFLM

        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # "many other model arguments may be ignored": none given
        try:
            model, model_args = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size), None
        finally:
            logging.getLogger("lm_eval").setLevel(logging.WARNING)
    with untouched_randomness():
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
            batch_size=cfg.batch_size, task_manager=manager, log_samples=False,
            device="cuda:0",  # the CLI's default: the harness takes the CPU where there is no GPU, and a launch's own GPU
        )


@contextlib.contextmanager
def untouched_randomness():
    """Python's, NumPy's and torch's (CPU and CUDA) generators as they were before the block."""
    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


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
