"""Every folder a run or an export writes or deletes, against every overlap (toolkit.run.paths.overlaps).

Each row is built on disk: a refused one is one line naming the setting, with nothing written or
deleted; a safe one is checked and then made to delete what it deletes (overwrite's removal, the
packed cache, the GGUF cache, an export put in place), and the other's files are all still there.
The completeness tests fail on a text setting, an export flag or a run entry that is not classified.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import datasets
import pytest

from toolkit.config.errors import UserError
from toolkit.config.load import load_config
from toolkit.export import destination
from toolkit.run import paths
from toolkit.run.folder import RunDir
from toolkit.run.paths import CACHE, COMMAND_OPTIONS, EVALUATE_OUTPUT, EXPORT_OUTPUT, OUTPUT, READ, REFUSED
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig
from toolkit.training.recipe_keys import OVERLAPS, PATH_SETTINGS

CONFIGS = (FinetuneConfig, PretrainConfig)


def _text_fields(cls, prefix: str = "") -> set[str]:
    """The dotted names of every field holding text (str, str | None, list[str], dict[str, ...])."""
    found = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        inner = [a for a in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(a)]
        if inner:
            found |= _text_fields(inner[0], f"{prefix}{f.name}{'[]' if typing.get_origin(kind) is list else ''}.")
        elif "str" in str(kind):
            found.add(prefix + f.name)
    return found


def test_every_text_setting_is_classified():
    fields = set().union(*(_text_fields(cls) for cls in CONFIGS))
    assert fields - set(PATH_SETTINGS) == set(), "say on each field whether it is a path: path=READ, ... or None"
    assert set(PATH_SETTINGS) - fields == set(), "no such setting any more"
    assert set(PATH_SETTINGS.values()) <= {OUTPUT, CACHE, READ, paths.RESUME, None}


def test_every_command_and_each_of_its_options_is_classified():
    """A new command of llm-toolkit, or a new option of one, fails here until COMMAND_OPTIONS says what it is."""
    from recipe_runner import recipe_module

    from toolkit.launch.cli import RECIPES

    assert set(RECIPES) == set(paths.CONFIG_COMMANDS) | set(COMMAND_OPTIONS), "classify the command in COMMAND_OPTIONS"
    for command in COMMAND_OPTIONS:
        dests = {a.dest for a in recipe_module(command).parser()._actions if a.dest != "help"}
        assert dests == set(COMMAND_OPTIONS[command]), f"classify {command}'s options in COMMAND_OPTIONS"
    assert set().union(*(options.values() for options in COMMAND_OPTIONS.values())) <= {OUTPUT, READ, None}


def _writers() -> set[str]:
    """Every folder or file a command writes: the recipes' output settings and caches, the others' output options."""
    writers = {key for key, role in PATH_SETTINGS.items() if role in (OUTPUT, CACHE)}
    return writers | {f"{command} --{dest}" for command, options in COMMAND_OPTIONS.items()
                      for dest, role in options.items() if role == OUTPUT}


def test_every_writing_folder_meets_every_overlap():
    writers = _writers()
    assert {folder for folder, _, _ in OVERLAPS} == writers and {EXPORT_OUTPUT, EVALUATE_OUTPUT} <= writers
    others = {"output_dir": {"another run", "user files"} | {k for k, r in PATH_SETTINGS.items() if r in (CACHE, READ)}}
    for folder in writers:
        default = {"another run", "user files"} | ({"--from"} if folder.startswith(tuple(COMMAND_OPTIONS)) else set())
        for other in others.get(folder, default):
            for relation in paths.RELATIONS:
                assert (folder, other, relation) in OVERLAPS, (folder, other, relation)


def test_every_entry_a_run_writes_is_one_overwrite_may_delete():
    """RunDir's paths are its writers' one source: each is an entry that overwrite=true deletes and the
    overlap check protects (profile/ was missing: a profiled run could not be started over)."""
    run = RunDir(Path("r"))
    paths = [getattr(run, name) for name, v in vars(RunDir).items() if isinstance(v, property)]
    assert {p.name for p in paths if p.parent == run.root} <= set(RunDir.ENTRIES)


# ------------------------------------------------------------------ building each row on disk
def _make(kind: str, at: Path, relation: str) -> Path:
    """The other folder, with a file that must survive; returns that file. A cache that output_dir
    would be or hold is new and empty, as the risky case is (nothing in it for RunDir.check to see)."""
    at.mkdir(parents=True)
    if PATH_SETTINGS.get(kind) == CACHE and relation != "inside":
        return at.parent.parent / "elsewhere.txt"
    if kind == "another run":
        (at / "metrics.jsonl").write_text("{}\n")
        (at / "checkpoints" / "step-1").mkdir(parents=True)
        keep = at / "checkpoints" / "step-1" / "trainer_state.json"
    elif kind == "user files":
        keep = at / "thesis.tex"
    elif PATH_SETTINGS.get(kind) == CACHE:
        (at / "packed-0123").mkdir()
        keep = at / "packed-0123" / "blocks.arrow"
    else:  # a folder the run or export reads: a model (and a chat template, data.chat_template's file)
        (at / "config.json").write_text("{}")
        (at / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        keep = at / "model.safetensors"
    keep.write_text("keep")
    return keep


def _place(relation: str, other: Path, kind: str, tmp: Path) -> Path:
    if relation == "same":
        return other
    if relation == "inside":
        return other / ("checkpoints" if kind == "another run" else "") / "x"
    if relation == "contains":
        return other.parent
    link = tmp / "link"
    link.symlink_to(other, target_is_directory=True)
    return link


def _config(tmp: Path, **settings: str):
    """A real recipe config with these settings, of the recipe that has them all."""
    values = {"output_dir": str(tmp / "run"), "data.cache_dir": str(tmp / "dcache"), "model.cache_dir": str(tmp / "mcache"),
              **settings}
    if "data.chat_template" in values:
        values["data.format"] = "chat"
    if "data.sources[].path" in values:
        values["data.sources"] = json.dumps([{"name": "a", "path": values.pop("data.sources[].path"), "weight": 1.0}])
    for cls in CONFIGS:
        known = _text_fields(cls) | {"data.sources", "data.format"}
        if all(k in known for k in values):
            return load_config(cls, None, [f"{k}={v}" for k, v in values.items()])
    return load_config(PretrainConfig, None, [f"{k}={v}" for k, v in values.items() if k in _text_fields(PretrainConfig)])


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check(folder_key: str, folder: Path, other: str, other_path: Path, tmp: Path) -> None:
    reads = {"--from": other_path if other == "--from" else tmp / "src"}
    if folder_key == EXPORT_OUTPUT:
        destination.check_output(folder, "hf", True, reads)
        return
    if folder_key == EVALUATE_OUTPUT:  # recipes/evaluate.py's checks of its --output, in its order
        from recipe_runner import recipe_module

        evaluate = recipe_module("evaluate")
        args = evaluate.parser().parse_args(["--from", str(reads["--from"]), "--tasks", "t", "--output", str(folder)])
        evaluate.output_path(args, None)
        return
    settings = {folder_key: str(folder)}
    if folder_key == "output_dir" and other not in ("another run", "user files"):
        settings[other] = str(other_path / "chat.jinja" if other == "data.chat_template" else other_path)
    cfg = _config(tmp, **settings)
    paths.check_run_paths(cfg)
    if folder_key == "output_dir":  # overwrite=true, the most it may delete; but of a run there, asked for
        RunDir(folder).check(None, other != "another run")


def _delete_as_it_does(folder_key: str, folder: Path, tmp: Path, tokenizer, model) -> None:
    """What the folder's owner deletes, done for real."""
    if folder_key == "output_dir":
        run = RunDir(folder)
        (run.checkpoints / "step-2").mkdir(parents=True)
        run.metrics.write_text("{}\n")
        run.final.mkdir()
        run.remove_own()  # overwrite=true
    elif folder_key == "data.cache_dir":
        from toolkit.data.packing import Ranks, packed_dataset

        docs = datasets.Dataset.from_dict({"text": ["one document of text " * 20] * 4})
        packed_dataset(docs, tokenizer, 16, folder, "rows", ranks=Ranks())
    elif folder_key == "model.cache_dir":
        from toolkit.models.gguf_base import _write_cache

        folder.mkdir(parents=True, exist_ok=True)
        _write_cache(model(tokenizer=tokenizer), tokenizer, tmp / "base.gguf", folder / "gguf-base-0123")
    elif folder_key == EVALUATE_OUTPUT:
        from recipe_runner import recipe_module

        recipe_module("evaluate").write_results(folder, {"llm_toolkit_evaluation": {}})
    else:
        with destination.staging(folder) as (staged, _):
            staged.mkdir()
            (staged / "config.json").write_text("{}")
            destination.mark(staged, "hf")
            destination.put_in_place(staged, folder, "hf", True, {"--from": tmp / "src"})


@pytest.mark.parametrize("row", sorted(OVERLAPS), ids=lambda row: "-".join(row))
def test_each_overlap_is_refused_or_safe(row, tmp_path, tiny_tokenizer, tiny_model):
    folder_key, other, relation = row
    base = tmp_path / "top"
    # a setting the run reads (model.path=runs/ft/final), under output_dir: in its final/, which the run replaces
    name = "final" if folder_key == "output_dir" and PATH_SETTINGS.get(other) == READ else "o"
    keep = _make(other, base / name, relation)
    keep.write_text("keep")
    if relation == "contains" and name == "final":
        (base / "metrics.jsonl").write_text("{}\n")  # output_dir is that run's folder
    folder = _place(relation, base / name, other, tmp_path)
    before = _tree(tmp_path)
    if OVERLAPS[row] == REFUSED:
        with pytest.raises(UserError) as refused:
            _check(folder_key, folder, other, base / name, tmp_path)
        message = str(refused.value)
        assert "\n" not in message and folder_key.split()[-1] in message, message
        assert _tree(tmp_path) == before, "a refusal wrote or deleted something"
    else:
        _check(folder_key, folder, other, base / name, tmp_path)
        _delete_as_it_does(folder_key, folder, tmp_path, tiny_tokenizer, tiny_model)
    assert keep.read_text() == "keep"


@pytest.mark.parametrize("entry", RunDir.ENTRIES)
def test_an_entry_of_the_run_that_links_to_the_users_folder_is_refused(entry, tmp_path):
    """output_dir/final -> ~/thesis: the run would write, replace or delete through the link."""
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "thesis.tex").write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / entry).symlink_to(user, target_is_directory=True)
    with pytest.raises(UserError, match=rf"^output_dir=.*its {entry} is a symbolic link"):
        paths.check_run_paths(_config(tmp_path, output_dir=str(run)))
    assert (user / "thesis.tex").read_text() == "keep"


def test_an_export_through_a_link_into_a_runs_checkpoints_is_refused(tmp_path):
    keep = _make("another run", tmp_path / "run", "same")
    keep.write_text("keep")
    (tmp_path / "ckpts").symlink_to(tmp_path / "run" / "checkpoints", target_is_directory=True)
    with pytest.raises(UserError, match=r"^--output .* is inside the toolkit run .*run \(its checkpoints/\)"):
        destination.check_output(tmp_path / "ckpts" / "export", "hf", False, {"--from": tmp_path / "src"})


def test_a_runs_own_scoring_writes_its_scores_in_its_harness_folder_and_nothing_else_may(tmp_path):
    """eval.harness_tasks: the run scores harness/step-N into harness/step-N.json; scores in a checkpoint's folder
    would go at the next rotation (issue 63)."""
    run = tmp_path / "run"
    _make("another run", run, "same")
    (run / "harness" / "step-3").mkdir(parents=True)
    paths.check_scores_output(run / "harness" / "step-3.json", {"--from": run / "harness" / "step-3"})
    paths.check_scores_output(run / "harness" / "step-6.json", {"--from": run / "final"})  # the run's final/, scored
    for output, source in ((run / "checkpoints" / "step-1" / "scores.json", run),
                           (run / "harness" / "mine.json", run / "harness" / "step-3"),
                           (run / "harness" / "step-3.json", tmp_path / "elsewhere")):
        with pytest.raises(UserError, match=rf"^--output {output} is inside the toolkit run {run} \(its "):
            paths.check_scores_output(output, {"--from": source})
