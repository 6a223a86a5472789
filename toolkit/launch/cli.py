"""`llm-toolkit`, the installed command: the recipes from any folder, one process or many.

    llm-toolkit pretrain --config pretrain_tiny train.max_steps=200
    llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora output_dir=runs/ft
    llm-toolkit export --from runs/ft --format gguf --output runs/ft.gguf            (also: evaluate, plan, chat)

`accelerate launch`'s options, anywhere: with any, the recipe runs through recipes/launch.sh's launcher.
How names, options and signals are taken: docs/internals.md, toolkit/launch/cli.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from toolkit.config.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the checkout the toolkit is installed from (pip install -e .)
# each command (recipes/NAME.py): what it does, and the README's example; `llm-toolkit --help` lists them, and a new
# recipe fails tests/toolkit/launch/test_cli.py until it is described here
COMMANDS = {
    "pretrain": ("train a LLaMA/GPT-style model from scratch",
                 "llm-toolkit pretrain --num_processes 2 --config pretrain_tiny output_dir=runs/tiny"),
    "finetune": ("fine-tune a pretrained model: continued pretraining, chat SFT, DPO; LoRA, QLoRA or full",
                 "llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora "
                 "output_dir=runs/ft"),
    "export": ("write a run for inference: a Hugging Face folder, a GGUF (llama.cpp, Ollama), int8 or int4",
               "llm-toolkit export --from runs/ft --format gguf --quant q8_0 --output exports/ft-q8_0.gguf"),
    "evaluate": ("score a run, checkpoint or export on lm-evaluation-harness tasks (pip install -e '.[eval]')",
                 "llm-toolkit evaluate --from runs/ft --tasks arc_easy,hellaswag --limit 500"),
    "plan": ("which strategy, checkpointing and micro-batch fit a config on your GPUs, before a launch",
             "llm-toolkit plan --config pretrain_llama_1b --gpus 8 --gpu-memory 80GB"),
    "chat": ("talk to a run, an export or a GGUF with its own chat template",
             'llm-toolkit chat --from runs/ft --prompt "How do I reverse a list in Python?"'),
}
RECIPES = tuple(COMMANDS)
CALLED_AS = "LLM_TOOLKIT_CALLED_AS"  # how the user started the recipe, for its usage lines: "llm-toolkit NAME"
# the options whose value may name a shipped file by its name alone, and the folder it is looked up in
SHIPPED_BY_OPTION = {"--config": "recipes/configs", "--config_file": "accelerate_configs"}


def help_text() -> str:
    """`llm-toolkit --help`: every command with what it does and its example, on one screen."""
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {what}\n  {'':<{width}}  {example}" for name, (what, example) in COMMANDS.items()]
    return "\n".join([
        "usage: llm-toolkit COMMAND [options]   the toolkit's recipes, from any folder; shipped configs by name",
        "",
        "commands:",
        *rows,
        "",
        "llm-toolkit COMMAND --help: that command's own options (pretrain and finetune: every key of their config,",
        "with its type and default). accelerate launch's options (--num_processes 2, --config_file zero3) go anywhere",
        "on a pretrain or finetune line. More: README.md.",
    ])


def shipped(name: str, folder: str) -> str:
    """`name` as written where it exists; else the shipped file of that name in ROOT/folder (with or without its
    .yaml, or a path into that folder as the docs write it from the checkout); else as written, for the recipe or the
    launcher to refuse in its own words. Nothing else of the checkout is a shipped file (README.md is not a config)."""
    if Path(name).exists():
        return name
    inside = (ROOT / folder).resolve()
    for candidate in (ROOT / folder / name, ROOT / folder / f"{name}.yaml", ROOT / name):
        if candidate.is_file() and candidate.resolve().is_relative_to(inside):
            return str(candidate)
    return name


def apart(args: list[str]) -> list[str]:
    """`--config=NAME` and `--config_file=NAME` (argparse's other spelling, which the recipes and accelerate take) as
    `--config NAME`: the shipped file is then found by its name, and the options before --config go to the launcher."""
    said = []
    for arg in args:
        option, equals, value = arg.partition("=")
        said += [option, value] if equals and option in SHIPPED_BY_OPTION else [arg]
    return said


RECIPE_OPTIONS = ("--config", "--print-config", "--preview", "--help", "-h")  # a training recipe's own (toolkit.training.entry)


def launch_options() -> dict[str, bool]:
    """`accelerate launch`'s options, each with whether it takes a value (from Accelerate's own parser)."""
    from accelerate.commands.launch import launch_command_parser

    return {flag: action.nargs != 0 for action in launch_command_parser()._actions for flag in action.option_strings
            if flag.startswith("--") and flag not in RECIPE_OPTIONS}


def split(args: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's arguments, the recipe's) of a training recipe's: `accelerate launch`'s options wherever they
    are, with their values (before --config, after it, or with no --config at all: none is an option of the recipe,
    whose arguments are --config FILE, --print-config, --help and key=value overrides); everything else the
    recipe's."""
    takes_value = launch_options()
    launch, recipe, i = [], [], 0
    while i < len(args):
        flag = args[i].partition("=")[0]
        if flag not in takes_value:
            recipe.append(args[i])
            i += 1
            continue
        width = 2 if takes_value[flag] and "=" not in args[i] and i + 1 < len(args) else 1
        launch += args[i:i + width]
        i += width
    return launch, recipe


def command(argv: list[str]) -> list[str]:
    """The command line `llm-toolkit ARGV` runs (argv[0] a recipe's name)."""
    name, args = argv[0], apart(argv[1:])
    script = str(ROOT / "recipes" / f"{name}.py")
    for option, folder in SHIPPED_BY_OPTION.items():
        if option in args and args.index(option) + 1 < len(args):
            at = args.index(option) + 1
            args[at] = shipped(args[at], folder)
    if name in ("export", "evaluate", "plan", "chat"):  # one process (a launch of evaluate: accelerate launch recipes/...)
        return [sys.executable, script, *args]
    launch, recipe = split(args)
    if not launch or "--config" not in recipe:  # --help, or no config: the recipe's usage or refusal, one process
        return [sys.executable, script, *recipe]
    if any(arg.partition("=")[0] == "--preview" for arg in recipe):  # it trains nothing: one process, never a launch
        print(f"[{name}] --preview runs in one process: the launch options ({' '.join(launch)}) are not used",
              file=sys.stderr)
        return [sys.executable, script, *recipe]
    return [sys.executable, "-m", "toolkit.launch.launcher", *launch, script, *recipe]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(help_text())
        return 0
    if argv[0] not in RECIPES:
        print(f"error: {argv[0]!r} is not a recipe: use one of {', '.join(RECIPES)} (llm-toolkit --help: how)",
              file=sys.stderr)
        return 2
    cmd = command(argv)
    os.environ[CALLED_AS] = f"llm-toolkit {argv[0]}"
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


class OneLineParser(argparse.ArgumentParser):
    """argparse for recipes/plan.py and export.py: each refusal is one line (a UserError, printed as `error: ...`
    with exit code 2) instead of argparse's usage block, and an option's value that starts with '-' (`--gpu-memory
    -5GB`, which argparse takes for an unknown option) is given to the option, for its own check to name."""

    def __init__(self, command: str, **kwargs):
        # its usage names the command the user typed: `llm-toolkit export`, not argparse's `export.py`
        super().__init__(**({"prog": os.environ[CALLED_AS]} if os.environ.get(CALLED_AS) else {}), **kwargs)
        self.command = command

    def parse_paths(self, args: argparse.Namespace, options: tuple[str, ...]) -> argparse.Namespace:
        """`options` (those naming a path) of the parsed `args` expanded as a config's paths are (~, $VAR): an
        empty one, or one that names an unset variable, is a UserError naming the option."""
        from toolkit.config.user_paths import UnusablePath, expand_path

        for action in self._actions:
            value = getattr(args, action.dest, None)
            if action.option_strings and action.option_strings[0] in options and value not in (None, action.const):
                flag = action.option_strings[0]
                if not value.strip():  # Path("") is the folder the command runs in
                    raise UserError(f"{flag} {value!r} names no path; give one")
                try:
                    setattr(args, action.dest, expand_path(value, flag))
                except UnusablePath as exc:
                    raise UserError(str(exc)) from None
        return args

    def error(self, message: str):
        raise UserError(f"{message}; see {os.environ.get(CALLED_AS) or self.command} --help")

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        options = {s for action in self._actions for s in action.option_strings}
        takes_one = {s for action in self._actions if action.option_strings and action.nargs is None
                     and isinstance(action, argparse._StoreAction) for s in action.option_strings}
        joined, i = [], 0
        while i < len(argv):
            if argv[i] in takes_one and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1] not in options \
                    and argv[i + 1] != "--" and argv[i + 1].split("=")[0] not in options:
                joined.append(f"{argv[i]}={argv[i + 1]}")
                i += 2
                continue
            joined.append(argv[i])
            i += 1
        return super().parse_args(joined, namespace)


if __name__ == "__main__":
    sys.exit(main())
