"""`llm-toolkit`, the installed command: the recipes from any folder, one process or many.

    llm-toolkit pretrain --config pretrain_tiny train.max_steps=200
    llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora output_dir=runs/ft
    llm-toolkit export --from runs/ft --format gguf --output runs/ft.gguf
    llm-toolkit plan --config pretrain_llama_1b --gpus 8 --gpu-memory 80GB

A shipped recipe config or accelerate config may be named without its folder or suffix; any other path is taken
as written, relative to where the command runs. Options before `--config` are `accelerate launch`'s: with any of
them the recipe runs through recipes/launch.sh's launcher (its exit codes, its one line for a user error),
without them as `python recipes/NAME.py` does. The process is replaced by the recipe's (signals reach it as they
would the script).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout the toolkit is installed from (pip install -e .)
RECIPES = ("pretrain", "finetune", "export", "plan")
CALLED_AS = "LLM_TOOLKIT_CALLED_AS"  # how the user started the recipe, for its usage lines: "llm-toolkit NAME"
USAGE = (f"usage: llm-toolkit {{{','.join(RECIPES)}}} [accelerate launch options] --config CONFIG [key=value ...]\n"
         "       llm-toolkit NAME --help   (the recipe's own keys and options)")


def shipped(name: str, folder: str) -> str:
    """`name` as written where it exists; else the shipped file of that name in ROOT/folder (with or without its
    .yaml); else as written, for the recipe to refuse in its own words."""
    if Path(name).exists():
        return name
    for candidate in (ROOT / folder / name, ROOT / folder / f"{name}.yaml", ROOT / name):
        if candidate.is_file():
            return str(candidate)
    return name


def command(argv: list[str]) -> list[str]:
    """The command line `llm-toolkit ARGV` runs (argv[0] a recipe's name)."""
    name, args = argv[0], list(argv[1:])
    script = str(ROOT / "recipes" / f"{name}.py")
    config_at = args.index("--config") if "--config" in args else len(args)
    if config_at + 1 < len(args):
        args[config_at + 1] = shipped(args[config_at + 1], "recipes/configs")
    if name in ("export", "plan"):
        return [sys.executable, script, *args]
    launch, recipe = (args[:config_at], args[config_at:]) if "--config" in args else ([], args)  # --help, a usage
    if "--config_file" in launch and launch.index("--config_file") + 1 < len(launch):
        at = launch.index("--config_file") + 1
        launch[at] = shipped(launch[at], "accelerate_configs")
    if not launch:
        return [sys.executable, script, *recipe]
    return [sys.executable, "-m", "toolkit.launch.launcher", *launch, script, *recipe]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv or argv[0] not in RECIPES:
        said = f"{argv[0]!r} is not a recipe" if argv else "no recipe named"
        print(f"{USAGE}\nerror: {said}: use one of {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    cmd = command(argv)
    os.environ[CALLED_AS] = f"llm-toolkit {argv[0]}"
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
