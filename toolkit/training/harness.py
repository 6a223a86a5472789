"""Benchmarks from EleutherAI's lm-evaluation-harness on a Hugging Face model folder or a model in memory: tasks checked
before any work (by name, then built: their YAML, documents and metrics), scored by the harness itself
(`simple_evaluate` with its `hf` model, as its CLI `lm_eval --model hf` does, so a folder's numbers are the CLI's to
the last digit), and its table.

The harness is an extra (`pip install -e '.[eval]'`): the core install does not carry it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
import math
import random
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolkit.config.errors import UserError
from toolkit.training.harness_hub import AnyTag, check_hub, index_lookup, refusal, unreachable

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
        missing = next((name for name, entry in zip(cfg.tasks, entries, strict=True) if entry is None), None)
        broken = _unreadable_yamls(Path(include))
        if missing is not None and broken:  # the user's own task, more likely than the harness's: said before its index
            raise UserError(f"{cfg.named['tasks']}{missing}: unknown task; {broken[0]} in {cfg.named['include_path']}"
                            f"{cfg.include_path} {broken[1]}")
    return _indexed(include, True)


@functools.lru_cache(maxsize=4)
def _indexed(include_path: str | None, harness_tasks: bool):
    """The harness's index of tasks: 7 s to build with its own on a CPU core, made once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=harness_tasks)


def check_tasks(cfg: HarnessConfig, manager) -> None:
    """Every name is a task or group the harness knows (its own, or a YAML under --include-path), and it can be built
    here (its YAML, its documents, its metrics): one line for the first that is not, before any model loads."""
    known = manager.all_tasks
    for name in cfg.tasks:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" or in {cfg.named['include_path']}{cfg.include_path}" if cfg.include_path else ""
        raise UserError(f"{cfg.named['tasks']}{name}: unknown task, not among the harness's {len(known):,} tasks{where}{hint} "
                        "(list them with: lm-eval ls tasks)")
    check_hub(cfg, index_lookup(manager))  # a tag's tasks too, and a group's the files alone did not tell
    include = cfg.named["include_path"].strip(" =")
    for name in cfg.tasks:
        try:
            # its prints, and its registry's log of a metric it cannot find ("... not found in the evaluate library!"):
            # the line below says it
            with contextlib.redirect_stdout(io.StringIO()), _silent("lm_eval.api.registry"):
                built = manager.load([name])  # builds the task: reads (or downloads) its documents
        except Exception as exc:  # the datasets and hub errors of a task whose data is not here, its template's
            raise UserError(_unbuilt(name, manager, exc, include)) from None
        for task, examples, metrics in _built(built.get("tasks", {}), shots=bool(cfg.num_fewshot)):
            unknown = [metric for metric, function in metrics.items() if function is None]
            if unknown:  # the harness would leave the metric out of its results, silently
                raise UserError(f"task {task}'s metric {unknown[0]} is not one the harness knows (acc, acc_norm, "
                                "exact_match, bleu, f1, perplexity, ...: lm_eval.api.registry); fix its metric_list")
            if cfg.num_fewshot and cfg.num_fewshot > examples:  # shots come from the task's examples, the asked aside
                raise UserError(f"{cfg.named['num_fewshot']}{cfg.num_fewshot}: task {task} has {examples} "
                                f"examples to draw shots from; give at most {examples}")


@contextlib.contextmanager
def _silent(logger: str):
    log = logging.getLogger(logger)
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def _built(tasks: dict, shots: bool) -> list[tuple[str, int, dict]]:
    """(name, examples to draw shots from where `shots` are asked, metric -> function or None) of each task of a
    group, or the task."""
    found = []
    for task_name, task in tasks.items():
        if isinstance(task, dict):  # a group's tasks
            found += _built(task, shots)
        elif hasattr(task, "fewshot_docs"):
            docs = task.fewshot_docs() if shots else None
            found.append((task_name, max(0, len(docs) - 1) if docs is not None else 0,
                          dict(getattr(task, "_metric_fn_list", {}))))
    return found


def _unreadable_yamls(folder: Path) -> tuple[str, str] | tuple[()]:
    """The first YAML file under `folder` that the harness cannot have read as a task or group (its name there), and
    why; () where there is none."""
    for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
        try:
            content = yaml.load(path.read_text(encoding="utf-8"), Loader=AnyTag)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            first = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else ""
            return str(path.relative_to(folder)), f"is not a task YAML it can read ({type(exc).__name__}: {first})"
        if not isinstance(content, dict) or not {"task", "group", "tag", "include"} & set(content):
            return str(path.relative_to(folder)), "names no task (it has no `task:` key)"
    return ()


def _unbuilt(name: str, manager, exc: Exception, include: str) -> str:
    config = _task_config(name, manager)
    dataset = config.get("dataset_path", "?")
    while exc.__cause__ is not None or (exc.__context__ is not None and not str(exc).strip()):
        exc = exc.__cause__ or exc.__context__  # datasets' "An error occurred while generating the dataset"'s cause
    kind = type(exc).__name__
    offline = any(word in f"{kind} {exc}" for word in ("Offline", "offline", "Connection", "resolve", "LocalEntryNotFound",
                                                        "DatasetNotFound", "couldn't be found", "Couldn't reach"))
    if offline and (why := unreachable()) is not None:  # a dataset check_hub could not name (a Python task's, say)
        named = re.search(r"(?:dataset|reach) '([^']+)'", str(exc))  # a group's: the one of its tasks that failed
        return refusal({name: [named.group(1)] if named else [dataset] if dataset != "?" else []}, why, include)
    if isinstance(exc, StopIteration):
        return f"task {name} has no documents ({dataset}): give it at least one"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"task {name} could not be built from its YAML and documents ({dataset}): {kind}: {first}"


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
