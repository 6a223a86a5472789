"""The harness tasks asked for that read their documents from the Hugging Face Hub where it cannot be reached: one
line naming them all, before any model loads, and for a task or a group of tasks before the harness's index of its
~14,000 task files is built (7 s): their YAML files are found by name and read alone.

Reachable, nothing changes. Unreachable (or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set), a task whose dataset is in the
datasets cache still runs, read from the cache at once; one whose dataset is not is refused. Without that, the hub
client retried each dataset for ~30 s, printing each retry, before the harness failed (docs/evaluation.md).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from toolkit.config.errors import UserError

DOCS = "docs/evaluation.md#offline-and-your-own-tasks"


class AnyTag(yaml.SafeLoader):
    """A task YAML as the harness writes them (`!function utils.process_docs`), read without running any of it."""


AnyTag.add_multi_constructor("!", lambda loader, tag, node: None)

# what a name stands for: ("task", its config), ("group", its members and what it gives them), ("tag", its tasks), or
# None where it cannot be told here (a Python task, a name no file gives)
Found = tuple[str, Any] | None
Lookup = Callable[[str], Found]


def check_hub(cfg, lookup: Lookup | None = None) -> None:
    """Refuse, in one line, the tasks of `cfg` (a HarnessConfig) whose Hub datasets cannot be read: the Hub cannot be
    reached and the datasets cache does not hold them. Where it cannot be reached, datasets and the hub client are set
    offline for the rest of the process, as HF_HUB_OFFLINE=1 sets them: a cached dataset then loads at once.
    `lookup` tells what a name stands for (default: the task files, found by name: task_files(cfg))."""
    lookup = lookup or task_files(cfg)
    needed = {name: ids for name in cfg.tasks if (ids := sorted(hub_ids(name, lookup)))}
    if not needed:  # local tasks alone: the Hub is not asked
        return
    why = unreachable()
    if why is None:
        return
    go_offline()
    missing = {name: [i for i in ids if not cached(i)] for name, ids in needed.items()}
    if missing := {name: ids for name, ids in missing.items() if ids}:
        raise UserError(refusal(missing, why, cfg.named["include_path"].strip(" =")))


def unreachable() -> str | None:
    from toolkit.data.hub import datasets_offline, hub_unreachable

    return datasets_offline() or hub_unreachable()


def go_offline() -> None:
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    # the cache is what offline reads: datasets' notices of it, each time it reads it, dropped
    for logger in ("datasets.load", "datasets.packaged_modules.cache.cache"):
        logging.getLogger(logger).addFilter(_not_the_cache_notice)


def _not_the_cache_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("Using the latest cached version of the dataset",
                                           "Found the latest cached dataset configuration"))


def refusal(missing: dict[str, list[str]], why: str, include: str) -> str:
    """The line: which tasks need the Hub, why it cannot be reached, what to do."""
    import datasets.config

    many = len(missing) > 1 or any(len(ids) > 1 for ids in missing.values())
    named = [f"{name} ({', '.join(ids)})" if ids else name for name, ids in missing.items()]
    tasks = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
    if why.endswith("=1"):  # the variable that keeps this process off the Hub
        reason, fix = f"which is not read while {why} is set", f"unset {why.removesuffix('=1')}"
    else:
        reason, fix = f"which cannot be reached from here ({why})", "connect to the network"
    return (f"{'tasks' if len(missing) > 1 else 'task'} {tasks} {'read their' if len(missing) > 1 else 'reads its'} "
            f"documents from the Hugging Face Hub, {reason}, and the datasets cache ({datasets.config.HF_DATASETS_CACHE})"
            f" does not hold {'them' if many else 'it'}: {fix}, or fill that cache where the Hub is reachable (one run "
            f"of the {'tasks' if len(missing) > 1 else 'task'} does) and copy it here, or give tasks of your own files "
            f"with {include} ({DOCS})")


def cached(dataset: str) -> bool:
    """The datasets cache holds `dataset` (a hub id): what datasets itself reads offline (its notice of it dropped:
    go_offline)."""
    from datasets.load import CachedDatasetModuleFactory

    try:
        CachedDatasetModuleFactory(dataset).get_module()
    except Exception:  # FileNotFoundError: not cached; anything else: not readable as cached either
        return False
    return True


# -------------------------------------------------------------- what a name reads
def hub_ids(spec: str | dict, lookup: Lookup, given: dict | None = None, seen: frozenset = frozenset()) -> set[str]:
    """The Hub datasets a task, group or tag (a name, or a group's inline member) reads, as far as `lookup` tells;
    `given`: the dataset keys a group gives its members."""
    given = given or {}
    if isinstance(spec, dict):
        name = spec.get("group", spec.get("task"))
        if isinstance(name, str) and lookup(name) is not None:
            return hub_ids(name, lookup, {**given, **_dataset_keys(spec)}, seen)
        if "group" in spec:  # a group defined where it is listed
            return _members(spec.get("task"), lookup, {**given, **_dataset_keys(spec)}, seen)
        return _task_ids({**given, **spec})
    if spec in seen:
        return set()
    found, seen = lookup(spec), seen | {spec}
    if found is None:
        return set()
    kind, value = found
    if kind == "task":
        return _task_ids({**value, **given})
    if kind == "group":
        return _members(value.get("task"), lookup, {**given, **_dataset_keys(value)}, seen)
    return _members(value, lookup, given, seen)  # a tag's tasks


def _members(members, lookup: Lookup, given: dict, seen: frozenset) -> set[str]:
    if not isinstance(members, list):
        return set()
    return set().union(*(hub_ids(m, lookup, given, seen) for m in members if isinstance(m, (str, dict))))


def _dataset_keys(cfg: dict) -> dict:
    return {key: cfg[key] for key in ("dataset_path", "dataset_kwargs") if key in cfg}


def _task_ids(cfg: dict) -> set[str]:
    path = cfg.get("dataset_path")
    return {path.removeprefix("hf://datasets/")} if isinstance(path, str) and is_hub_id(path) else set()


def is_hub_id(path: str) -> bool:
    """`path` is what datasets.load_dataset reads from the Hub: neither one of its own builders (json, csv, ...: files
    named in data_files) nor a local path."""
    if path.startswith("hf://datasets/"):
        return True
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or Path(path).expanduser().exists():
        return False
    if "/" not in path:  # json, csv, parquet, text, ...: a builder's name has no "/"
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        return path not in _PACKAGED_DATASETS_MODULES
    return True


# -------------------------------------------------------------- names, found by their files
def task_files(cfg) -> Lookup:
    """What a name stands for, read from the one task file that names it: --include-path's first (its tasks replace
    the harness's of the same name, as in the harness's index), then the harness's own, found without importing it."""
    own = _named(str(Path(cfg.include_path).absolute())) if cfg.include_path else {}

    def lookup(name: str) -> Found:
        path = own.get(name) or _harness_named().get(name)
        return _entry(name, Path(path)) if path is not None else None

    return lookup


def _harness_named() -> dict[str, str]:
    folder = harness_tasks_folder()
    return _named_once(folder) if folder else {}


@functools.cache
def _named_once(folder: str) -> dict[str, str]:  # the harness's files change only with its install
    return _named(folder)


def harness_tasks_folder() -> str | None:
    try:
        spec = importlib.util.find_spec("lm_eval")
    except (ImportError, ValueError):  # ValueError: marked absent (sys.modules["lm_eval"] = None)
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return str(Path(locations[0]) / "tasks") if locations else None


# a top-level `task: name` or `group: name` line: the name a file gives (a group's `task:` is a list, not matched)
_NAME = re.compile(rb"^(?:task|group)[ \t]*:[ \t]*['\"]?([^\s'\"#\[\]{},]+)", re.M)
_SKIPPED = {"__pycache__", ".ipynb_checkpoints"}  # as the harness's index skips them


def _named(folder: str) -> dict[str, str]:
    """Each name a YAML file under `folder` gives -> the first such file in the harness's order (sorted paths): its
    14,000 files are read in ~0.3 s, where parsing them takes 7."""
    paths = []
    for at, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in _SKIPPED]
        paths += [os.path.join(at, file) for file in files if file.endswith(".yaml")]
    named: dict[str, str] = {}
    for path in sorted(paths):
        try:
            with open(path, "rb") as file:
                text = file.read()
        except OSError:
            continue
        for match in _NAME.finditer(text):
            named.setdefault(match.group(1).decode(errors="replace"), path)
    return named


def _entry(name: str, path: Path) -> Found:
    try:
        cfg = read_task_file(path)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, yaml.YAMLError):  # said by the harness's own check
        return None
    if cfg.get("group") == name:
        return "group", cfg
    if cfg.get("task") == name and "class" not in cfg:
        return "task", cfg
    return None


def read_task_file(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A task file as the harness reads it: the files it includes (beside it), its own keys over theirs."""
    path = path.resolve()
    if path in seen:
        raise ValueError(f"include cycle at {path}")
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=AnyTag)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a mapping")
    includes = cfg.pop("include", [])
    merged: dict = {}
    for included in includes if isinstance(includes, list) else [includes]:
        merged.update({k: v for k, v in read_task_file(path.parent / included, (*seen, path)).items()
                       if k != "task_list"})
    return {**merged, **cfg}


def index_lookup(manager) -> Lookup:
    """What a name stands for in the harness's index (a TaskManager's)."""

    def lookup(name: str) -> Found:
        entry = manager.task_index.get(name)
        kind = getattr(getattr(entry, "kind", None), "name", None)
        if kind == "TASK":
            return "task", dict(entry.cfg or {})
        if kind == "GROUP":
            return "group", dict(entry.cfg or {})
        if kind == "TAG":
            return "tag", sorted(entry.tags)
        return None

    return lookup
