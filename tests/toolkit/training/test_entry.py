"""A recipe's command line: usage, one-line errors with exit code 2, deprecation lines, exit code 3 on a stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import wrong_arguments

from toolkit.config.errors import UserError
from toolkit.training.entry import command_line, run
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


def dotted_keys(cls, prefix: str = "") -> list[str]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += dotted_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_help_lists_every_key_with_its_type_default_and_help(recipe, capsys):
    from toolkit.training.recipe_config import FinetuneConfig

    config = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}[recipe]
    _Recipe.calls = []
    assert run(recipe, config, _Recipe, ["--help"]) == 0
    assert _Recipe.calls == []  # nothing ran
    out = capsys.readouterr().out
    assert out.startswith(f"usage: recipes/{recipe}.py --config")
    keys = out.split("the last one wins):\n", 1)[1]
    listed = {line.split(" (")[0].strip() for line in keys.splitlines() if line.startswith("  ")}
    assert listed == set(dotted_keys(config))  # a key added to a section is listed, whatever the section
    assert "  train.step_sync (auto|host|none, default 'auto'): host = the step waits" in out
    assert "  optim.betas (list[float], default [0.9, 0.95]): AdamW betas" in out


SHIPPED = {"pretrain": "pretrain_tiny", "finetune": "finetune_smollm2_lora"}


def _help(recipe: str, args: list[str], capsys) -> tuple[int, str, str]:
    """`llm-toolkit RECIPE ARGS` as far as --help goes: the shipped config found by its name (toolkit.launch.cli),
    the recipe's arguments given to its entry in this process."""
    from toolkit.launch.cli import command
    from toolkit.training.recipe_config import FinetuneConfig

    config = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}[recipe]
    argv = command([recipe, *args])  # [python, .../recipes/RECIPE.py, *the recipe's arguments]
    script = next(i for i, arg in enumerate(argv) if arg.endswith(f"recipes/{recipe}.py"))
    code = run(recipe, config, _Recipe, argv[script + 1:])
    out, err = capsys.readouterr()
    return code, out, err


def _key_line(out: str, key: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(f"  {key} (")]
    return line


def _set_in(tree: dict, prefix: str = "") -> list[str]:
    return [k for name, value in tree.items() for k in (
        _set_in(value, f"{prefix}{name}.") if isinstance(value, dict) and name not in ("config", "columns")
        else [f"{prefix}{name}"])]


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_help_with_a_config_shows_the_values_it_and_the_overrides_set(recipe, capsys):
    """`finetune --config finetune_smollm2_lora --help` listed train.max_steps at its dataclass default, 200, where
    the YAML runs 60."""
    import yaml

    _Recipe.calls = []
    yaml_path = Path(TINY).parent / f"{SHIPPED[recipe]}.yaml"
    written = yaml.safe_load(yaml_path.read_text())
    steps = written["train"]["max_steps"]
    code, out, err = _help(recipe, ["--config", SHIPPED[recipe], "--help"], capsys)
    assert (code, err, _Recipe.calls) == (0, "", [])
    said = f"{steps} from the config" + (" (= default)" if steps == 200 else ", default 200")
    assert _key_line(out, "train.max_steps").startswith(f"  train.max_steps (int, {said}): optimizer steps to train")
    for key in _set_in(written):  # every key the YAML sets says so; the others are the plain --help's lines
        assert " from the config" in _key_line(out, key), key
    _, plain, _ = _help(recipe, ["--help"], capsys)
    assert _key_line(plain, "train.max_steps") == "  train.max_steps (int, default 200): optimizer steps to train"
    assert _key_line(out, "train.epochs") == _key_line(plain, "train.epochs")

    code, out, _ = _help(recipe, ["train.max_steps=7", "--help", "--config", SHIPPED[recipe], "seed=9"], capsys)
    assert code == 0
    assert _key_line(out, "train.max_steps").startswith("  train.max_steps (int, 7 from the command line, default 200)")
    assert _key_line(out, "seed").startswith("  seed (int, 9 from the command line, default 1234)")


def test_help_with_a_config_that_does_not_load_is_its_one_error_line(capsys):
    code, out, err = _help("finetune", ["--config", "finetune_smollm2_lorx", "--help"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("error: --config finetune_smollm2_lorx does not exist; did you mean ")
    assert err.endswith("/finetune_smollm2_lora.yaml?\n") and err.count("\n") == 1
    code, out, err = _help("finetune", ["--config", SHIPPED["finetune"], "train.max_steps=lots", "-h"], capsys)
    assert (code, out, err) == (2, "", "error: train.max_steps must be an integer, found 'lots'\n")


def test_print_config_shows_the_resolved_config_without_running_and_reads_back(tmp_path, capsys):
    import yaml

    _Recipe.calls = []
    from transformers.utils import logging as hf_logging

    assert run("pretrain", PretrainConfig, _Recipe, ["--config", TINY, "train.max_steps=7", "--print-config"]) == 0
    assert _Recipe.calls == []
    assert hf_logging.set_tqdm_hook(None) is not None  # a recipe's run quiets transformers' weight bars
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["train"]["max_steps"] == 7
    (tmp_path / "resolved.yaml").write_text(printed)
    assert run("pretrain", PretrainConfig, _Recipe, ["--config", str(tmp_path / "resolved.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed  # a config of its own, resolving to itself
    assert run("pretrain", PretrainConfig, _Recipe, ["--config", TINY, "train.max_stepz=7", "--print-config"]) == 2
    assert "did you mean train.max_steps?" in capsys.readouterr().err


# every option of a recipe by kind (tests/support/wrong_arguments.py lists each kind's wrong values); the rest are overrides
KINDS = {"--config": "file", "--print-config": "switch", "--preview": "count", "--help": "help",
         "overrides": "overrides"}


def test_every_option_of_a_recipe_has_a_kind():
    from toolkit.training.entry import OPTIONS

    assert {*OPTIONS, "overrides"} == set(KINDS)


@pytest.mark.parametrize("option, case", wrong_arguments.cases(KINDS))
def test_every_wrong_value_of_every_option_is_one_line(option, case, recipe, capsys, tmp_path, monkeypatch):
    """`--config` with no file, an empty one, a folder, one that is not there, an unset $VAR in it; a value glued to
    --print-config, an unknown option, an override that is not key=value or names no key: one line each, exit 2."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    (tmp_path / "file.txt").write_text("x")
    argv, value = wrong_arguments.argv_of(option, KINDS[option], case, {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt")})
    base = [] if option == "--config" else ["--config", TINY]
    code = run("pretrain", PretrainConfig, recipe, [*base, *argv])
    out, err = capsys.readouterr()
    wrong_arguments.assert_one_line(code, out, err, option, value)
    assert recipe.calls == []


def test_the_arguments_may_come_in_any_order_and_config_once(recipe, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert run("pretrain", PretrainConfig, recipe, ["train.max_steps=3", f"--config={TINY}", "--print-config"]) == 0
    assert "max_steps: 3" in capsys.readouterr().out and recipe.calls == []
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY, "--config", TINY]) == 2
    assert capsys.readouterr().err.startswith(f"error: --config is given twice ({TINY}, {TINY}); give one")
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY, "--preview", "2", "--preview=3"]) == 2
    assert capsys.readouterr().err == "error: --preview is given twice (2, 3); give it once\n"
    assert run("pretrain", PretrainConfig, recipe, ["--config", TINY, "--preview", "2", "--print-config"]) == 2
    assert capsys.readouterr().err == ("error: --print-config and --preview each stand in for the run; give one of "
                                       "them\n") and recipe.calls == []


def test_a_missing_config_is_named_as_it_works_from_where_the_command_runs(recipe, capsys, tmp_path, monkeypatch):
    """`--config recipes/configs/pretrain_tny.yaml` from another folder suggested recipes/configs/pretrain_tiny.yaml,
    which is not there either; from the checkout the suggestion stays relative."""
    monkeypatch.delenv("RANK", raising=False)
    shipped = Path(TINY).parent
    for where, suggested in ((tmp_path, str(shipped / "pretrain_tiny.yaml")), (shipped.parents[1], "recipes/configs/pretrain_tiny.yaml")):
        monkeypatch.chdir(where)
        assert run("pretrain", PretrainConfig, recipe, ["--config", "recipes/configs/pretrain_tny.yaml"]) == 2
        assert capsys.readouterr().err == (f"error: --config recipes/configs/pretrain_tny.yaml does not exist; did you mean "
                                           f"{suggested}?\n")
        assert (where / suggested).is_file()


@pytest.mark.parametrize("launch_config, kind", [("accelerate_configs/ddp.yaml", "an accelerate config"),
                                                 ("ds_configs/zero3.json", "a DeepSpeed JSON")])
def test_a_launch_config_given_as_the_recipes_is_one_line(launch_config, kind, recipe, capsys, monkeypatch):
    """It was a problem per key it holds (`9 problems in the config: unknown key train_batch_size, ...`)."""
    monkeypatch.delenv("RANK", raising=False)
    path = str(Path(TINY).parents[2] / launch_config)
    assert run("pretrain", PretrainConfig, recipe, ["--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path} is {kind} (") and err.count("\n") == 1, err
    assert "not a recipe's; give it as " in err


@pytest.mark.parametrize(("typed", "meant"), [("--print-confg", "--print-config"), ("--confg", "--config"),
                                             ("--main_process_portt", "--main_process_port (the launcher's)"),
                                             ("--num_proceses", "--num_processes (the launcher's)"), ("--nope", None)])
def test_a_misspelt_option_is_told_its_nearest(typed, meant):
    """A misspelt option of the recipe's or of the launcher's (which llm-toolkit hands to the recipe when it is not
    the launcher's) was "not an option of this recipe" with no hint."""
    with pytest.raises(UserError) as refused:
        command_line(["--config", TINY, typed])
    assert str(refused.value).startswith(f"{typed} is not an option of this recipe" +
                                         (f"; did you mean {meant}; " if meant else "; "))


def test_a_launchers_option_given_to_the_recipe_says_where_it_goes(recipe, capsys, monkeypatch):
    """`python recipes/pretrain.py --config X --num_processes 2` was "not an option of this recipe", without a hint;
    every option of Accelerate's launch parser (the recipe's own --config and --help aside) says where it goes."""
    from toolkit.launch.cli import launch_options

    monkeypatch.delenv("RANK", raising=False)
    for flag in launch_options():
        assert run("pretrain", PretrainConfig, recipe, ["--config", TINY, flag]) == 2
        assert capsys.readouterr().err == (
            f"error: {flag} is an option of the launcher (accelerate launch's), not of this recipe: give it before the "
            "recipe's script (bash recipes/launch.sh OPTIONS recipes/NAME.py --config ...), or anywhere to llm-toolkit\n")
    assert recipe.calls == []
