"""`--from RUN --base`: the run's base found where the run recorded it, or one line saying why not."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from toolkit.config.errors import UserError
from toolkit.export.run_base import RUN_BASE, add_base_option, run_base, take_run_base


def a_run(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    return root


def recorded(folder: Path, loads_from: str | None, path: str | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "base_model.json").write_text(json.dumps({"path": path, "gguf_file": None, "loads_from": loads_from}))


def test_the_runs_own_copy_of_its_base_comes_first(tmp_path):
    run = a_run(tmp_path / "run")
    (run / "base").mkdir()
    (run / "base" / "config.json").write_text("{}")
    recorded(run / "adapter", "/elsewhere")
    assert run_base(run) == str(run / "base")


@pytest.mark.parametrize("where", ["adapter", "checkpoints/step-4/model_files"])
def test_a_base_folder_the_run_recorded(tmp_path, where):
    run, base = a_run(tmp_path / "run"), tmp_path / "my-base"
    base.mkdir()
    recorded(run / where, str(base))
    if where.startswith("checkpoints"):
        (run / "checkpoints" / "step-4" / "trainer_state.json").write_text(json.dumps({"step": 4}))
    assert run_base(run) == str(base)


def test_a_hub_base_says_how_to_get_a_folder(tmp_path):
    run = a_run(tmp_path / "run")
    recorded(run / "adapter", "HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(UserError, match=r"its base is the hub id HuggingFaceTB/SmolLM2-135M, not a folder here: "
                                        r"download it .* and give --from DIR"):
        run_base(run)


def test_what_has_no_base(tmp_path):
    with pytest.raises(UserError, match="is not a run folder"):
        run_base(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        run_base(tmp_path / "nope")
    with pytest.raises(UserError, match="the run records no base"):
        run_base(a_run(tmp_path / "pretrained"))


def test_the_option_alone_names_the_runs_base_and_with_a_folder_keeps_its_meaning(tmp_path):
    run = a_run(tmp_path / "run")
    (run / "base").mkdir()
    (run / "base" / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    parser.add_argument("--from", dest="source")
    parser.add_argument("--checkpoint")
    add_base_option(parser)
    alone = parser.parse_args(["--from", str(run), "--base"])
    assert alone.base == RUN_BASE
    take_run_base(alone)
    assert (alone.source, alone.base) == (str(run / "base"), None)
    folder = parser.parse_args(["--from", str(run / "adapter"), "--base", "/some/base"])
    take_run_base(folder)
    assert (folder.source, folder.base) == (str(run / "adapter"), "/some/base")
    with pytest.raises(UserError, match="leave out --checkpoint"):
        take_run_base(parser.parse_args(["--from", str(run), "--checkpoint", "latest", "--base"]))


@pytest.mark.parametrize("inside", ["adapter", "final", "checkpoints/step-2"])
def test_a_folder_inside_a_run_is_told_the_run(tmp_path, inside):
    """--from runs/ft/adapter --base: the run's base is what was meant; the line names the run to give."""
    run = a_run(tmp_path / "run")
    (run / inside).mkdir(parents=True)
    with pytest.raises(UserError, match=rf"is not a run folder; --base alone names a fine-tune's base, give --from "
                                        rf"{re.escape(str(run))}$"):
        run_base(run / inside)


def test_a_gguf_base_whose_float_copy_the_run_did_not_keep_is_made_into_the_cache(tmp_path, monkeypatch):
    """model.gguf_cache=false: the run holds no base/ and records no loads_from. Was: 'give --from the GGUF', which
    export and evaluate refuse (a file) and which names no file; now the GGUF's float copy, made in the cache once."""
    from toolkit.models import gguf_base

    run, gguf, cache = a_run(tmp_path / "run"), tmp_path / "SmolLM2.gguf", tmp_path / "cache" / "gguf-SmolLM2-0123"
    gguf.write_bytes(b"GGUF")
    recorded(run / "adapter", None)  # path and gguf_file null: the default SmolLM2
    made = []

    def dequantise(cfg, path):
        assert cfg.gguf_cache and path == gguf
        made.append(path)
        cache.mkdir(parents=True)
        (cache / "config.json").write_text("{}")
        return None, None, []

    monkeypatch.setattr(gguf_base, "resolve_gguf", lambda cfg: gguf)
    monkeypatch.setattr(gguf_base, "cache_folder", lambda cfg, path: cache)
    monkeypatch.setattr(gguf_base, "dequantise", dequantise)
    assert run_base(run) == str(cache) and made == [gguf]
    assert run_base(run) == str(cache) and made == [gguf]  # once: the cache's copy is read the second time
