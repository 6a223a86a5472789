"""A recipe's command line: usage, one-line errors with exit code 2, deprecation lines, exit code 3 on a stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.config import UserError
from toolkit.training.entry import run
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.trainer import Stopped

TINY = str(Path(__file__).resolve().parents[3] / "recipes" / "configs" / "pretrain_tiny.yaml")


class _Recipe:
    """Stands in for a recipe class; the entry point only calls setup, train and cleanup in order."""

    calls: list[str] = []
    fail_in: str | None = None
    error: type[Exception] = UserError

    def __init__(self, cfg):
        self.cfg = cfg

    def _call(self, name):
        type(self).calls.append(name)
        if name == type(self).fail_in:
            raise type(self).error(f"{name} failed; do something else")

    def setup(self):
        self._call("setup")

    def train(self):
        self._call("train")

    def cleanup(self):
        self._call("cleanup")


@pytest.fixture
def recipe():
    _Recipe.calls, _Recipe.fail_in, _Recipe.error = [], None, UserError
    return _Recipe


def test_usage_without_a_config(capsys, recipe):
    assert run("pretrain", PretrainConfig, recipe, []) == 2
    assert "usage: recipes/pretrain.py --config" in capsys.readouterr().err
    assert recipe.calls == []


def test_success_runs_the_three_phases(recipe):
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY]) == 0
    assert recipe.calls == ["setup", "train", "cleanup"]


def test_a_user_error_is_one_line_and_exit_code_2(capsys, recipe, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    recipe.fail_in = "train"
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY]) == 2
    assert capsys.readouterr().err == "error: train failed; do something else\n"
    assert recipe.calls == ["setup", "train"]


def test_a_bad_key_never_reaches_the_recipe(capsys, recipe):
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY, "train.max_stepz=3"]) == 2
    assert "unknown key train.max_stepz; did you mean train.max_steps?" in capsys.readouterr().err
    assert recipe.calls == []


def test_deprecated_keys_are_reported_once_on_rank_0_only(capsys, recipe, monkeypatch):
    argv = ["--config", TINY, "logging.eval_every=5"]
    monkeypatch.setenv("RANK", "0")
    assert run("pretrain", PretrainConfig, recipe, argv) == 0
    assert capsys.readouterr().err.count("[pretrain] deprecated: the config key logging.eval_every is now eval.every") == 1
    monkeypatch.setenv("RANK", "1")
    assert run("pretrain", PretrainConfig, recipe, argv) == 0
    assert "deprecated" not in capsys.readouterr().err


def test_a_stop_exits_with_code_3_after_flushing(capsys, recipe, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    flushed = []

    class Trainer:
        class accelerator:  # noqa: N801 - the attribute the entry point flushes through
            end_training = staticmethod(lambda: flushed.append(True))

    def stop(self):
        self.trainer = Trainer
        raise Stopped("stopped by a signal at step 2; checkpoint saved in x; continue with resume=auto")

    monkeypatch.setattr(recipe, "train", stop)
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY]) == 3
    assert flushed == [True]
    assert capsys.readouterr().err == "[pretrain] stopped by a signal at step 2; checkpoint saved in x; continue with resume=auto\n"
