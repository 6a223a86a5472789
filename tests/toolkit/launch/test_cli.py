"""`llm-toolkit` (toolkit/launch/cli.py): the recipe's command line it runs, from any folder, shipped configs by name."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
import wrong_arguments

from toolkit.launch.cli import RECIPES, SHIPPED_BY_OPTION, command, launch_options, main
from toolkit.launch.launcher import paths_from_its_folder

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's folder, outside the checkout
    return tmp_path


# llm-toolkit ARGS -> what it runs (ROOT and sys.executable written as such)
COMMANDS = {
    "one process": (["pretrain", "--config", "pretrain_tiny", "train.max_steps=2"],
                    ["PY", "ROOT/recipes/pretrain.py", "--config", "ROOT/recipes/configs/pretrain_tiny.yaml",
                     "train.max_steps=2"]),
    "launched": (["finetune", "--config_file", "zero3", "--num_processes", "2", "--config",
                  "finetune_smollm2_lora.yaml", "output_dir=runs/ft"],
                 ["PY", "-m", "toolkit.launch.launcher", "--config_file", "ROOT/accelerate_configs/zero3.yaml",
                  "--num_processes", "2", "ROOT/recipes/finetune.py", "--config",
                  "ROOT/recipes/configs/finetune_smollm2_lora.yaml", "output_dir=runs/ft"]),
    "a path of the user's own": (["pretrain", "--config", "mine.yaml"], ["PY", "ROOT/recipes/pretrain.py", "--config",
                                                                          "mine.yaml"]),
    "plan": (["plan", "--config", "pretrain_llama_1b", "--gpus", "8"],
             ["PY", "ROOT/recipes/plan.py", "--config", "ROOT/recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8"]),
    "export": (["export", "--from", "runs/ft", "--format", "gguf"],
               ["PY", "ROOT/recipes/export.py", "--from", "runs/ft", "--format", "gguf"]),
    "chat": (["chat", "--from", "runs/ft.gguf", "--prompt", "hi"],
             ["PY", "ROOT/recipes/chat.py", "--from", "runs/ft.gguf", "--prompt", "hi"]),
    "help": (["finetune", "--help"], ["PY", "ROOT/recipes/finetune.py", "--help"]),
    # argparse's other spelling, which the recipes and accelerate take: found by name, the launch options split off
    "with =": (["finetune", "--config_file=zero3", "--num_processes", "2", "--config=finetune_smollm2_lora",
                "output_dir=runs/ft"],
               ["PY", "-m", "toolkit.launch.launcher", "--config_file", "ROOT/accelerate_configs/zero3.yaml",
                "--num_processes", "2", "ROOT/recipes/finetune.py", "--config",
                "ROOT/recipes/configs/finetune_smollm2_lora.yaml", "output_dir=runs/ft"]),
    # accelerate launch's options anywhere: after --config too (they were "not an option of this recipe")
    "launch options after --config": (["pretrain", "--config", "pretrain_tiny", "--num_processes", "2", "train.max_steps=2",
                                       "--main_process_port=0"],
                                      ["PY", "-m", "toolkit.launch.launcher", "--num_processes", "2", "--main_process_port=0",
                                       "ROOT/recipes/pretrain.py", "--config", "ROOT/recipes/configs/pretrain_tiny.yaml",
                                       "train.max_steps=2"]),
    # --preview trains nothing: one process, whatever launch options are given (they are said to be unused)
    "preview with launch options": (["finetune", "--config_file", "zero3", "--num_processes", "2", "--config",
                                     "finetune_smollm2_chat_lora", "--preview", "3"],
                                    ["PY", "ROOT/recipes/finetune.py", "--config",
                                     "ROOT/recipes/configs/finetune_smollm2_chat_lora.yaml", "--preview", "3"]),
    # without --config: the recipe's refusal (no --config), from one process, the launch not started for it
    "launch options without --config": (["pretrain", "--num_processes", "2", "train.max_steps=2"],
                                        ["PY", "ROOT/recipes/pretrain.py", "train.max_steps=2"]),
    # a file of the checkout that is not a shipped config goes on as written (README.md was the checkout's README)
    "not a shipped config": (["pretrain", "--config", "README.md"], ["PY", "ROOT/recipes/pretrain.py", "--config", "README.md"]),
    "a shipped config by its path in the checkout": (["pretrain", "--config", "recipes/configs/pretrain_tiny.yaml"],
                                                     ["PY", "ROOT/recipes/pretrain.py", "--config",
                                                      "ROOT/recipes/configs/pretrain_tiny.yaml"]),
    "plan with =": (["plan", "--config=pretrain_llama_1b", "--gpus=8"],
                    ["PY", "ROOT/recipes/plan.py", "--config", "ROOT/recipes/configs/pretrain_llama_1b.yaml",
                     "--gpus=8"]),
}


@pytest.mark.parametrize("case", COMMANDS)
def test_the_command_runs_the_recipe_with_the_shipped_files_found_by_name(case, elsewhere):
    argv, expected = COMMANDS[case]
    if case == "a path of the user's own":
        (elsewhere / "mine.yaml").write_text("train: {max_steps: 1}\n")  # the user's file wins over a lookup
    said = [w.replace(str(ROOT), "ROOT") for w in command(argv)]
    assert said == [w if w != "PY" else sys.executable for w in expected]


# llm-toolkit's own argument by kind (tests/support/wrong_arguments.py lists each kind's wrong values); the options it looks
# shipped files up for go on to the recipe or the launcher as written, which refuse them in their words:
# tests/toolkit/training/test_entry.py (--config), test_launcher.py (--config_file)
KINDS = {"recipe": "choice"}
PASSED_ON = {"--config": ["pretrain", "--config"], "--config_file": ["pretrain", "--config_file"]}


def test_no_recipe_is_one_line(capsys):
    assert {o for o in PASSED_ON} == set(SHIPPED_BY_OPTION)
    for case, value in wrong_arguments.WRONG[KINDS["recipe"]].items():
        if value is None:  # no argument at all: the help (test_the_help_lists_every_command_with_an_example_that_runs)
            continue
        code = main([value])
        out, err = capsys.readouterr()
        wrong_arguments.assert_one_line(code, out, err, "recipe", value)
        assert err.endswith("use one of pretrain, finetune, export, evaluate, plan, chat (llm-toolkit --help: how)\n"), case


def test_the_help_lists_every_command_with_an_example_that_runs(capsys):
    """`llm-toolkit --help` was one usage line. Each recipe (recipes/*.py) is a command, listed with what it does and
    an example whose command line runs that recipe with the shipped files it names: a new recipe fails here until
    COMMANDS in toolkit/launch/cli.py describes it."""
    assert sorted(RECIPES) == sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
    said = []
    for argv in (["--help"], ["-h"], []):  # the same help, on stdout, exit code 0
        assert main(argv) == 0, argv
        said.append(capsys.readouterr())
    assert {err for _, err in said} == {""} and len({out for out, _ in said}) == 1
    help_text = said[0].out
    lines = help_text.splitlines()
    assert lines[0].startswith("usage: llm-toolkit COMMAND") and len(lines) <= 24  # one screen
    assert "llm-toolkit COMMAND --help: that command's own options" in help_text
    for name in RECIPES:
        said = next((i for i, line in enumerate(lines) if line.split()[:1] == [name]), None)
        assert said is not None and len(lines[said].split()) > 3, f"{name} is not described in llm-toolkit --help"
        example = lines[said + 1].strip()
        assert example.startswith(f"llm-toolkit {name} "), f"{name} has no example in llm-toolkit --help: {example!r}"
        ran = command(shlex.split(example)[1:])
        assert str(ROOT / "recipes" / f"{name}.py") in ran, (name, ran)
        for option in SHIPPED_BY_OPTION:  # a shipped config or accelerate config it names exists
            if option in ran:
                assert Path(ran[ran.index(option) + 1]).is_file(), (name, ran)


@pytest.mark.parametrize("option", PASSED_ON)
def test_a_value_that_names_no_shipped_file_goes_on_as_written(option, elsewhere, monkeypatch):
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    (elsewhere / "file.txt").write_text("x")
    for case, value in wrong_arguments.WRONG["file"].items():
        if value is None:
            continue
        value = value.format(tmp=str(elsewhere), file=str(elsewhere / "file.txt"))
        said = command([*PASSED_ON[option], value, "--config", "x.yaml"] if option == "--config_file" else
                       [*PASSED_ON[option], value])
        assert said[said.index(option) + 1] == value, case


def test_a_shipped_deepspeed_config_is_found_from_its_accelerate_config_wherever_the_launch_runs(elsewhere):
    copies = elsewhere / "copies"
    copies.mkdir()
    launched = paths_from_its_folder(str(ROOT / "accelerate_configs" / "zero3.yaml"), copies)
    assert Path(launched).parent == copies
    assert f"deepspeed_config_file: {ROOT / 'ds_configs' / 'zero3.json'}" in Path(launched).read_text()
    # a user's config naming a JSON beside it; one found from where it runs; one found nowhere; no DeepSpeed
    (elsewhere / "mine").mkdir()
    (elsewhere / "mine" / "ds.json").write_text("{}")
    (elsewhere / "mine" / "acc.yaml").write_text("deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    assert "deepspeed_config_file: " + str(elsewhere / "mine" / "ds.json") in Path(
        paths_from_its_folder(str(elsewhere / "mine" / "acc.yaml"), copies)).read_text()
    (elsewhere / "here.json").write_text("{}")
    (elsewhere / "here.yaml").write_text("deepspeed_config:\n  deepspeed_config_file: here.json\n")
    assert paths_from_its_folder("here.yaml", copies) == "here.yaml"
    (elsewhere / "lost.yaml").write_text("deepspeed_config:\n  deepspeed_config_file: lost.json\n")
    assert paths_from_its_folder("lost.yaml", copies) == "lost.yaml"  # the rank names it in its own line
    assert paths_from_its_folder(str(ROOT / "accelerate_configs" / "ddp.yaml"), copies).endswith("ddp.yaml")
    assert paths_from_its_folder(None, copies) is None


def test_a_recipes_usage_names_the_command_the_user_typed(monkeypatch):
    """`llm-toolkit finetune --help` said `recipes/finetune.py --config recipes/configs/NAME.yaml`, a path that does
    not exist in the user's folder; the recipe started by llm-toolkit says how llm-toolkit takes it."""
    from toolkit.launch.cli import CALLED_AS
    from toolkit.training.entry import usage

    monkeypatch.setenv(CALLED_AS, "")  # restored afterwards: main() below sets it in this process
    monkeypatch.delenv(CALLED_AS)
    # from the user's folder, the paths that work from there (recipes/configs/NAME.yaml named a path that is not there)
    assert usage("finetune").startswith(f"usage: {ROOT}/recipes/finetune.py --config {ROOT}/recipes/configs/NAME.yaml")
    monkeypatch.setattr("os.execv", lambda path, args: None)  # main's exec of the recipe, not run
    main(["finetune", "--help"])
    assert usage("finetune").startswith("usage: llm-toolkit finetune --config NAME [key.sub=value ...]")


def test_every_launch_option_goes_to_the_launcher_wherever_it_is_given():
    """Each option of Accelerate's launch parser, after --config (with its value where it takes one), is the
    launcher's: none is the recipe's, whose own are --config, --print-config, --preview and --help."""
    for flag, takes_value in launch_options().items():
        said = command(["pretrain", "--config", "pretrain_tiny", flag, *(["V"] if takes_value else []), "a.b=1"])
        assert said[3:5 if takes_value else 4] == [flag, "V"][:1 + takes_value], flag
        assert said[-3:] == ["--config", str(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml"), "a.b=1"], flag


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipes_help_names_the_command_the_user_typed(name, monkeypatch, capsys):
    """`llm-toolkit export --help` said `usage: export.py` (argparse's name of the script), plan's `usage: plan.py`."""
    from recipe_runner import recipe_module

    from toolkit.launch.cli import CALLED_AS

    monkeypatch.setenv(CALLED_AS, f"llm-toolkit {name}")  # what main() sets before it runs the recipe
    with pytest.raises(SystemExit) as exited:
        sys.exit(recipe_module(name).main(["--help"]))
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: llm-toolkit {name} "), name
