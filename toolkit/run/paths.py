"""Every folder a run or a command (export, evaluate) writes or deletes, against everything it could overlap.

Each deletes only what it wrote. Every text setting of the recipe configs says on its field which of
OUTPUT, CACHE, READ, RESUME it is, or None; `overlaps` is each writing folder against each kind of overlap,
and the outcome: refused (one line, before anything is written or deleted) or safe, and why.
tests/toolkit/run/test_paths.py builds every row.
What each writer deletes: docs/internals.md, toolkit/run/paths.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from toolkit.config.declarations import declared
from toolkit.config.errors import UserError
from toolkit.config.user_paths import cache_dir
from toolkit.run.folder import RunDir

# What a text setting of the recipe configs is, declared on its field (path=; None: text, not a path).
OUTPUT, CACHE, READ, RESUME = "output", "cache", "read", "resume"  # writes and deletes / its own names only / reads
# RESUME: a checkpoint, in this run's checkpoints/ or another's: read once, at the start

# The kinds of overlap: the folder is the other, lies inside it, holds it, or is a symbolic link to it.
RELATIONS = ("same", "inside", "contains", "symlink")
REFUSED = "refused"

# Every command of llm-toolkit (toolkit.launch.cli.RECIPES) and what each of its options (argparse's dest) is: OUTPUT
# is written, READ is read and never written into, None is not a path. pretrain and finetune write what their
# config says (each text field declares path=); the others' options are here. tests/toolkit/run/test_paths.py walks
# every command's parser against this, and every OUTPUT option against each overlap below.
CONFIG_COMMANDS = ("pretrain", "finetune")
COMMAND_OPTIONS: dict[str, dict[str, str | None]] = {
    "export": {
        "output": OUTPUT, "source": READ, "base": READ, "eval_text": READ,
        "checkpoint": None,  # a step-N name inside --from's run, checked there
        "format": None, "quant": None, "dtype": None, "merge_lora": None, "max_shard_size": None, "overwrite": None,
    },
    "evaluate": {
        "output": OUTPUT, "source": READ, "base": READ, "include_path": READ,
        "checkpoint": None, "tasks": None, "num_fewshot": None, "limit": None, "batch_size": None, "overwrite": None,
    },
    "chat": {  # prints, writes nothing
        "source": READ, "base": READ, "chat_template": READ,
        "checkpoint": None, "system": None, "prompt": None, "max_new_tokens": None, "temperature": None,
        "show_prompt": None,
    },
    "plan": {  # prints, writes nothing
        "config": READ, "gpus": None, "gpu_memory": None, "headroom": None, "micro_batch": None, "cpu": None,
        "json": None, "all": None, "overrides": None,
    },
}
EXPORT_OUTPUT, EVALUATE_OUTPUT = "export --output", "evaluate --output"  # their rows below

# (folder, what it could overlap, relation) -> REFUSED, or "safe: why". "another run" is a run folder
# on disk (inside: in its checkpoints/); "user files" a folder of the user's (thesis.tex); a setting
# names that setting's folder (contains: output_dir holds it in its final/). Every cache and every
# read setting gets its rows from its role, so a new one is in the table the moment its field says it.
_CACHE_SAFE = "safe: a cache deletes only the names it makes (packed-KEY, its .tmp, .gguf-…tmp)"
_OWN_ONLY = "safe: the run deletes only its own entries inside output_dir"
_AGAINST_OUTPUT_DIR = {  # output_dir against a cache, and against a folder the run reads
    CACHE: {"same": REFUSED, "inside": _CACHE_SAFE, "contains": REFUSED, "symlink": REFUSED},
    READ: {"same": REFUSED, "inside": _OWN_ONLY, "contains": REFUSED, "symlink": REFUSED},
}
_FIXED: dict[tuple[str, str, str], str] = {
    ("output_dir", "another run", "same"): REFUSED,  # RunDir.check: holds a run (its lock while it trains)
    ("output_dir", "another run", "inside"): REFUSED,  # its rotation or overwrite deletes it
    ("output_dir", "another run", "contains"): REFUSED,  # RunDir.check: files that are not a run
    ("output_dir", "another run", "symlink"): REFUSED,  # the link's folder holds a run
    ("output_dir", "user files", "same"): REFUSED,  # RunDir.check: files that are not a run
    ("output_dir", "user files", "inside"): _OWN_ONLY,
    ("output_dir", "user files", "contains"): REFUSED,
    ("output_dir", "user files", "symlink"): REFUSED,
    (EXPORT_OUTPUT, "another run", "same"): REFUSED,  # destination.check_output: a run, never replaced
    (EXPORT_OUTPUT, "another run", "inside"): REFUSED,  # inside a run's own entry
    (EXPORT_OUTPUT, "another run", "contains"): REFUSED,  # exists and holds a run
    (EXPORT_OUTPUT, "another run", "symlink"): REFUSED,
    (EXPORT_OUTPUT, "user files", "same"): REFUSED,  # files no export wrote
    (EXPORT_OUTPUT, "user files", "inside"): "safe: the export writes its output and a staging folder it deletes",
    (EXPORT_OUTPUT, "user files", "contains"): REFUSED,
    (EXPORT_OUTPUT, "user files", "symlink"): REFUSED,
    (EXPORT_OUTPUT, "--from", "same"): REFUSED,  # never writes into what it reads
    (EXPORT_OUTPUT, "--from", "inside"): REFUSED,
    (EXPORT_OUTPUT, "--from", "contains"): REFUSED,
    (EXPORT_OUTPUT, "--from", "symlink"): REFUSED,
    # a JSON file: a folder in its place is refused (same, contains, a link to one)
    (EVALUATE_OUTPUT, "another run", "same"): REFUSED,
    (EVALUATE_OUTPUT, "another run", "inside"): REFUSED,  # check_scores_output: its rotation would delete the scores
    (EVALUATE_OUTPUT, "another run", "contains"): REFUSED,
    (EVALUATE_OUTPUT, "another run", "symlink"): REFUSED,
    (EVALUATE_OUTPUT, "user files", "same"): REFUSED,
    (EVALUATE_OUTPUT, "user files", "inside"): "safe: the evaluation writes its JSON (a hidden .tmp renamed into "
                                               "place) and a temporary model folder it deletes",
    (EVALUATE_OUTPUT, "user files", "contains"): REFUSED,
    (EVALUATE_OUTPUT, "user files", "symlink"): REFUSED,
    (EVALUATE_OUTPUT, "--from", "same"): REFUSED,  # never writes into what it reads
    (EVALUATE_OUTPUT, "--from", "inside"): REFUSED,
    (EVALUATE_OUTPUT, "--from", "contains"): REFUSED,
    (EVALUATE_OUTPUT, "--from", "symlink"): REFUSED,
}


def overlaps(path_settings: dict[str, str | None]) -> dict[tuple[str, str, str], str]:
    """Every row: the fixed ones, and those each cache and read setting of `path_settings` ({key: role}) gets from
    its role."""
    return {
        **_FIXED,
        **{("output_dir", key, relation): outcome
           for key, role in path_settings.items() if role in _AGAINST_OUTPUT_DIR
           for relation, outcome in _AGAINST_OUTPUT_DIR[role].items()},
        **{(key, other, relation): outcome
           for key, role in path_settings.items() if role == CACHE
           for other, relation, outcome in (
               ("another run", "same", REFUSED), ("another run", "inside", REFUSED),
               ("another run", "contains", _CACHE_SAFE), ("another run", "symlink", REFUSED),
               *(("user files", relation, _CACHE_SAFE) for relation in RELATIONS))},
    }


def setting(cfg: Any, key: str) -> list[str]:
    """The values of a dotted setting (`data.sources[].path`: one per source) that are set."""
    values = [cfg]
    for part in key.split("."):
        listed = part.endswith("[]")
        values = [getattr(v, part.removesuffix("[]"), None) for v in values]
        if listed:
            values = [item for v in values for item in (v or [])]
    return [v for v in values if isinstance(v, str) and v]


def run_around(path: Path) -> tuple[Path, str] | None:
    """(the run folder, its entry) when `path` is or lies in a toolkit run's own entry (final/,
    checkpoints/, ...) -- where that run's rotation, overwrite or replace deletes -- as written and
    with its symbolic links followed."""
    for where in dict.fromkeys((path.absolute(), path.resolve())):
        for entry in (where, *where.parents):
            if entry.name in RunDir.ENTRIES and entry != entry.parent and is_run(entry.parent):
                return entry.parent, entry.name
    return None


def is_run(folder: Path) -> bool:
    """A toolkit run's folder: it has the files only a run writes."""
    run = RunDir(folder)
    return run.metrics.is_file() or run.checkpoints.is_dir()


def _relation(a: Path, b: Path) -> str | None:
    """How folder `a` lies to `b` (links followed): the same, inside it, holding it, or apart (None)."""
    a, b = a.resolve(), b.resolve()
    return "is" if a == b else "is inside" if a.is_relative_to(b) else "holds" if b.is_relative_to(a) else None


def check_run_paths(cfg: Any) -> None:
    """Refuse a run whose folders overlap what it or another run deletes; every rank, before any work.

    (RunDir.check refuses an output_dir holding another run or files that are not a run.)"""
    run = RunDir(cfg.output_dir)
    around = run_around(run.root)
    if around is not None:
        raise UserError(
            f"output_dir={cfg.output_dir} is inside the toolkit run {around[0]} (its {around[1]}/), which that run "
            "deletes or replaces (rotation, overwrite=true); choose an output_dir outside it"
        )
    for name in RunDir.ENTRIES:
        entry = run.root / name
        if entry.is_symlink():
            raise UserError(
                f"output_dir={cfg.output_dir}: its {name} is a symbolic link (to {entry.readlink()}); the run writes, "
                "deletes and replaces its own entries and does none of it through a link; remove the link (to keep "
                "the run on another disk, point output_dir there)"
            )
    owned = [run.root / name for name in RunDir.ENTRIES]
    for key, role in declared(type(cfg), "path").items():
        section, _, name = key.rpartition(".")
        if role == CACHE and hasattr(getattr(cfg, section, None), name):  # a recipe without it has no such cache
            folder = cache_dir(setting(cfg, key)[0] if setting(cfg, key) else None)
            _check_cache(key, folder, run)
        elif role == READ:
            for value in setting(cfg, key):
                path = Path(value).expanduser()
                if not _exists(path):
                    continue  # a hub id or a template's text
                for entry in owned:
                    if entry.exists() and _relation(path, entry) in ("is", "is inside"):
                        raise UserError(
                            f"{key}={value} is in output_dir={cfg.output_dir}'s {entry.name}, which this run deletes "
                            "or replaces (overwrite=true, rotation, the new final/); copy it out of the run folder "
                            "or choose another output_dir"
                        )


def check_scores_output(output: Path, reads: dict[str, Path | None]) -> None:
    """recipes/evaluate.py's --output, a file: never inside what the evaluation reads, nor in a run's own entry, which
    that run deletes or replaces (a checkpoint's folder goes at the next rotation, the scores with it).

    A run's scoring of its own steps (eval.harness_tasks) writes harness/step-N.json: that entry is where the run
    keeps its scores, and it replaces that file only with its own scoring of step N."""
    around = run_around(output)
    if around is not None:
        run, entry = around
        source = reads.get("--from")
        if (entry == "harness" and output.parent.resolve() == (run / entry).resolve()
                and re.fullmatch(r"step-\d+\.json", output.name) is not None and source is not None
                and (source.resolve() == run.resolve() or (run_around(source) or (None,))[0] == run)):
            return  # the run's own scoring
        slash = "/" if (run / entry).is_dir() else ""
        raise UserError(
            f"--output {output} is inside the toolkit run {run} (its {entry}{slash}), which that run deletes or replaces "
            f"(rotation, overwrite=true) and the scores with it; write them outside the run's {entry}{slash}"
        )
    for flag, read in reads.items():
        if read is not None and _exists(read) and _relation(output, read) in ("is", "is inside"):
            raise UserError(f"--output {output} {_relation(output, read)} {flag} {read}, which this evaluation reads; "
                            "write the scores outside it")


def _check_cache(key: str, folder: Path, run: RunDir) -> None:
    relation = _relation(folder, run.root)
    if relation in ("is", "is inside"):
        raise UserError(
            f"{key}={folder} {relation} output_dir={run.root}; a cache there would be deleted with the run's entries or "
            f"make the folder hold files that are not the run's; choose a {key} outside output_dir"
        )
    if is_run(folder) or run_around(folder) is not None:
        owner = folder if is_run(folder) else run_around(folder)[0]
        raise UserError(
            f"{key}={folder} is in the toolkit run {owner}, which deletes and replaces its own entries; choose a "
            f"{key} outside any run folder"
        )


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long: not a folder
        return False
