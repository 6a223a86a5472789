"""A recipe's command line: `--config FILE key=value ...` -> setup, train, cleanup, exit code.

Exit codes: 0 done, 2 bad input (one `error:` line), 3 stopped by a signal after saving a checkpoint
(resume=auto continues), 4 a collective failed (one `error:` line per rank), 5 the run could not go on
(non-finite loss or gradients, a checkpoint or another file it could not write; resume=auto continues once
the cause is fixed). These are each rank's: `accelerate launch` turns any into 1, `bash recipes/launch.sh`
(toolkit.launch.launcher) passes them through.
Each code's causes, and one rank's error as one line: docs/internals.md, toolkit/training/entry.py.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys

import yaml

from toolkit import quiet_weight_bars
from toolkit.checkpoint.checkpointer import SaveStopped
from toolkit.config.errors import UserError
from toolkit.config.files import SHIPPED_CONFIGS
from toolkit.config.keys import key_lines
from toolkit.config.load import load_config, to_dict
from toolkit.config.user_paths import from_here
from toolkit.launch.cli import CALLED_AS, launch_options
from toolkit.launch.environment import is_launch_main
from toolkit.launch.rank_process import die_with_launcher
from toolkit.launch.verdict import report_once, reported_verdict
from toolkit.run.folder import RunFinished, release_all
from toolkit.run.writes import WriteFailed
from toolkit.strategy.collectives import collective_failure
from toolkit.training.step import Diverged
from toolkit.training.trainer import Stopped


def shipped_config() -> str:
    """A shipped config as a --config that works where the command runs: `llm-toolkit NAME` takes it by its name."""
    return "NAME" if os.environ.get(CALLED_AS) else f"{from_here(SHIPPED_CONFIGS)}/NAME.yaml"


def usage(name: str) -> str:
    called = os.environ.get(CALLED_AS)  # llm-toolkit NAME takes a shipped config by its name
    command, config = called or from_here(SHIPPED_CONFIGS.parent / f"{name}.py"), shipped_config()
    return (f"usage: {command} --config {config} [key.sub=value ...] [--print-config | --preview N]\n"
            f"       {command} --help   (every key: its type, default and what it does)")


# A recipe's options; every other argument is a key=value override. tests/toolkit/training/test_entry.py walks each
# option's wrong values.
OPTIONS = {"--config": "FILE: the recipe's YAML", "--print-config": "print the resolved config, do not run",
           "--preview": "N: print N packed training blocks, the tokens with loss marked, and a table of the data; "
                        "no model loads, nothing trains (one process)",
           "--help": "every key, its type, default and help"}


def _value(argv: list[str], i: int) -> tuple[str | None, int]:
    """(the value of the option at argv[i], attached with = or the next argument, None where there is none or the
    next is another option; where the arguments after it start)."""
    _, equals, attached = argv[i].partition("=")
    if equals:
        return attached, i + 1
    value = argv[i + 1] if i + 1 < len(argv) else None
    return (None if value is None or value.startswith("--") else value), i + 2


def command_line(argv: list[str]) -> tuple[str, list[str], bool, int | None]:
    """(the --config file, the overrides, whether --print-config was given, --preview's count or None) of a recipe's
    arguments, each mistake refused in one line naming the argument."""
    config, overrides, show, preview = None, [], False, None
    example = f"e.g. --config {shipped_config()}"
    i = 0
    while i < len(argv):
        arg = argv[i]
        option = arg.partition("=")[0]
        if option == "--config":
            value, i = _value(argv, i)
            if value is None:
                raise UserError(f"--config needs the recipe's YAML file after it, {example}")
            if config is not None:
                raise UserError(f"--config is given twice ({config}, {value}); give one, and change its keys with "
                                "key=value overrides")
            config = value
            continue
        if option == "--preview":
            value, i = _value(argv, i)
            if value is None:
                raise UserError("--preview needs the number of packed blocks to show after it, e.g. --preview 3")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--preview {value!r} is not a positive integer; give the number of packed blocks to "
                                "show, e.g. --preview 3")
            if preview is not None:
                raise UserError(f"--preview is given twice ({preview}, {value}); give it once")
            preview = int(value)
            continue
        if arg == "--print-config":
            show = True
        elif option in OPTIONS:
            raise UserError(f"{arg}: {option} takes no value; write {option} alone")
        elif arg.startswith("--") and option in launch_options():  # a launcher's (python recipes/NAME.py --num_processes 2)
            raise UserError(f"{option} is an option of the launcher (accelerate launch's), not of this recipe: give it "
                            "before the recipe's script (bash recipes/launch.sh OPTIONS recipes/NAME.py --config ...), "
                            "or anywhere to llm-toolkit")
        elif arg.startswith("-"):
            near = difflib.get_close_matches(option, [*OPTIONS, "--config", *launch_options()], n=1, cutoff=0.8)
            hint = "" if not near else f"; did you mean {near[0]}" + ("" if near[0] in (*OPTIONS, "--config") else
                                                                      " (the launcher's)")
            raise UserError(f"{arg} is not an option of this recipe{hint}; its options are --config FILE, "
                            "--print-config, --preview N and --help, and every other argument is a key=value override")
        else:
            overrides.append(arg)
        i += 1
    if config is None:
        raise UserError(f"no --config: give the recipe's YAML file, {example}")
    if show and preview is not None:  # each runs instead of training: one of them would go unsaid
        raise UserError("--print-config and --preview each stand in for the run; give one of them")
    return config, overrides, show, preview


def help_lines(name: str, config_class: type, argv: list[str]) -> list[str]:
    """--help: the options, then every key of the config; with a --config (and overrides) in `argv`, each key they
    set with its value and where it came from beside its default: what this run would use, not the dataclass's."""
    lines = [usage(name), "", "--print-config: the config the YAML and the overrides resolve to, as YAML, without "
             "running; a YAML of it is a --config of its own",
             "--preview N: the training data as it will train, before anything trains: N packed blocks after "
             "templating, the tokens that carry loss marked, then one table (records read, dropped and why, "
             "truncated, tokens per record, share with loss, template, stop token); the tokenizer alone loads, no run "
             "folder is made, one process (docs/data.md)",
             "--help with --config FILE (and overrides): each key's value as they set it, beside its default",
             "", "a list of strings on the command line: 'samples.prompts=[How do I open a file?, What is a dict?]' "
             "(a comma separates entries: quote one that holds a comma, 'samples.prompts=[\"a, b\", c]'); one string "
             "is a list of one; quote the whole override for the shell"]
    cfg, given = None, {}
    if any(arg.partition("=")[0] == "--config" for arg in argv):
        config, overrides, _, _ = command_line(argv)
        cfg = load_config(config_class, config, overrides, given=given)
        lines += ["", f"values: as --config {config}{' and the overrides' if overrides else ''} set them (from the "
                  "config, from the command line); every other key at its default"]
    return [*lines, "", "keys (set in the YAML, or key.sub=value on the command line; the last one wins):",
            *key_lines(config_class, cfg, given)]


def run(name: str, config_class: type, recipe_class: type, argv: list[str] | None = None) -> int:
    die_with_launcher()  # first: a rank must not outlive a launcher killed while it starts
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        try:
            print("\n".join(help_lines(name, config_class, [a for a in argv if a not in ("--help", "-h")])))
        except UserError as exc:  # a --config that does not load: its one line, as a run gives it
            report_once(f"error: {exc}", 2)
            return 2
        return 0
    if not argv:
        report_once(usage(name), 2)
        return 2
    quiet_weight_bars()
    recipe = None
    try:
        config, overrides, show, preview = command_line(argv)
        notes: list[str] = []
        cfg = load_config(config_class, config, overrides, notes)
        if show:
            if is_launch_main():
                print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        if preview is not None:  # one process's work (llm-toolkit starts no launch for it); a launch's other ranks do nothing
            if is_launch_main():
                for line in notes:
                    print(f"[{name}] {line}", file=sys.stderr, flush=True)
                try:
                    recipe_class(cfg).preview(preview)
                except BrokenPipeError:  # `--preview N | head`: the reader left; quiet, as a piped command ends
                    with contextlib.suppress(OSError, ValueError):  # nothing more to flush into the pipe at exit
                        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                    return 141
            return 0
        if is_launch_main():
            for line in notes:
                print(f"[{name}] {line}", file=sys.stderr, flush=True)
        recipe = recipe_class(cfg)
        recipe.setup()
        recipe.train()
        recipe.cleanup()
    except UserError as exc:
        report_once(f"error: {exc}", 2)
        return 2
    except RunFinished as exc:  # every rank reads the same folder: each ends here, before any process group
        if is_launch_main():
            print(f"[{name}] {exc}", file=sys.stderr, flush=True)
        return 0
    except WriteFailed as exc:  # a file the run needs could not be written (toolkit.run.writes.WRITERS): one line
        report_once(f"error: {exc}", exc.exit)
        return exc.exit
    except (Diverged, SaveStopped) as exc:  # raised on every rank at the same step: one line says it
        recipe.trainer.accelerator.end_training()
        if is_launch_main():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 5
    except Stopped as exc:
        recipe.trainer.accelerator.end_training()  # flush the trackers; the checkpoint is already saved
        if is_launch_main():  # every rank stops at the same step (the flag is all-reduced): one line says it
            print(f"[{name}] {exc}", file=sys.stderr, flush=True)
        return 3
    except Exception as exc:
        trainer = getattr(recipe, "trainer", None)
        line = collective_failure(exc, trainer.step if trainer is not None else None)
        if line is None:
            raise
        verdict = reported_verdict()
        if verdict is not None:  # a peer exited after a user error; its line is the run's one line
            return verdict
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 4
    finally:
        harness = getattr(getattr(recipe, "trainer", None), "harness", None)
        if harness is not None:  # a scoring still running when the run stopped or failed
            harness.abandon()
        release_all()  # the run is over: its folder is free (a refused one is left as found)
    return 0
