"""Score what training made on lm-evaluation-harness tasks: the numbers to put beside a published score.

    python recipes/evaluate.py --from runs/ft --tasks arc_easy,hellaswag --num-fewshot 0 --limit 500
    python recipes/evaluate.py --from runs/ft --checkpoint step-300 --tasks my_task --include-path my_tasks/
    accelerate launch --num_processes 8 recipes/evaluate.py --from runs/ft --tasks mmlu     # data parallel on GPUs

`--from` takes what recipes/export.py takes: a run folder (its final/, or --checkpoint step-N / latest), any Hugging
Face model folder (an export), a checkpoint of any strategy (DDP, FSDP, ZeRO-1/2/3, stages: consolidated as export
consolidates it, into a temporary folder, never into the run), or a LoRA adapter (merged into its base). The harness
itself scores it (its `hf` model on that folder, as `lm_eval --model hf` does: the same numbers to the last digit),
and the recipe prints its table and writes its JSON to --output (default ./harness-<name>.json).

Under `accelerate launch` the harness splits the documents over the processes where each has a GPU; on CPU the first
process evaluates alone, said in one line. Errors, one line and exit code 2: an unknown task (with the closest
names), the tasks whose documents are on the Hub when it cannot be reached and the datasets cache does not hold
them (within seconds: docs/evaluation.md, "Offline"), a folder that is not a model, a
checkpoint still being written, an existing --output without --overwrite, an --output inside a run's own entry (a
checkpoint's folder, which rotation deletes with the scores) or inside what it reads, the harness not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit import quiet_weight_bars
from toolkit.config.errors import UserError
from toolkit.export.destination import check_base, check_creatable
from toolkit.export.run_base import add_base_option, take_run_base
from toolkit.launch import environment
from toolkit.launch.cli import OneLineParser
from toolkit.launch.rank_process import die_with_trainer
from toolkit.run.paths import COMMAND_OPTIONS, READ, check_scores_output
from toolkit.run.writes import WriteFailed, writing
from toolkit.training.harness import HarnessConfig, check_tasks, harness, scores, table, task_manager
from toolkit.training.harness_hub import check_hub

if TYPE_CHECKING:
    from toolkit.export.consolidate import Source

MARK = "llm_toolkit_evaluation"  # in the JSON this recipe writes: what --overwrite may replace


def parser() -> OneLineParser:
    parser = OneLineParser("python recipes/evaluate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="source", required=True, help="run, model, checkpoint or adapter folder")
    parser.add_argument("--checkpoint", help="with a run folder: step-N or latest (default: its final/)")
    parser.add_argument("--tasks", required=True, help="harness task or group names, comma-separated")
    parser.add_argument("--include-path", help="a folder of your own task YAML files")
    parser.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own)")
    parser.add_argument("--limit", type=float, help="documents per task (below 1: a fraction); for a quick look")
    parser.add_argument("--batch-size", type=int, default=8)
    add_base_option(parser)
    parser.add_argument("--output", help="the JSON file for the harness's results (default ./harness-<name>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier evaluation's JSON")
    return parser


# the options that name a path: `~` and environment variables expanded as in a config's paths
PATH_OPTIONS = ("--from", "--include-path", "--base", "--output")


def parse_args(argv: list[str] | None):
    options = parser()
    args = options.parse_paths(options.parse_args(argv), PATH_OPTIONS)
    take_run_base(args)
    cfg = HarnessConfig([t.strip() for t in args.tasks.split(",")], args.include_path, args.num_fewshot, args.limit,
                        args.batch_size)
    if problems := cfg.validate():
        raise UserError(problems[0])
    return args, cfg


def as_evaluation(read, *args, **kwargs):
    """recipes/export.py's reading of a source, its lines said of an evaluation: what to evaluate instead of what to
    export (--from and --checkpoint mean the same in both)."""
    try:
        return read(*args, **kwargs)
    except UserError as exc:
        line = re.sub(r"\bexported\b", "evaluated", re.sub(r"\bexport\b", "evaluate", str(exc)))
        raise UserError(line) from None


def output_path(args, source: Source) -> Path:
    """--output, or ./harness-<run or folder name>[-step-N].json; an existing file only with --overwrite, and only one
    this recipe wrote."""
    if args.output:
        output = Path(args.output)
    else:
        name = (source.run_dir or source.path).name + (f"-step-{source.step}" if source.step is not None else "")
        output = Path(f"harness-{name}.json")
    check_creatable(output)
    if output.is_dir():
        raise UserError(f"--output {output} is a folder; give a file name ending in .json")
    check_scores_output(output, reads(args))
    if output.exists():
        if not args.overwrite:
            raise UserError(f"{output} exists; give another --output, or --overwrite to replace it")
        try:
            ours = MARK in json.loads(output.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise UserError(f"{output} was not written by recipes/evaluate.py; --overwrite replaces only an earlier "
                            "evaluation's results: give another --output")
    return output


def reads(args) -> dict[str, Path | None]:
    """What the evaluation reads, by option (toolkit.run.paths.COMMAND_OPTIONS): --output never lies in it."""
    return {f"--{dest.replace('_', '-')}".replace("--source", "--from"): Path(value) if value else None
            for dest, role in COMMAND_OPTIONS["evaluate"].items() if role == READ
            for value in [getattr(args, dest)]}


def write_results(output: Path, results: dict) -> None:
    """The JSON, whole: an earlier evaluation stays as it was until this one is written."""
    staged = output.with_name(f".{output.name}.tmp")
    with writing("evaluation", staged):
        output.absolute().parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(json.dumps(results, indent=2, default=str))
        staged.replace(output)


def model_folder(source: Source, base: str | None, work: Path) -> Path:
    """A Hugging Face folder the harness loads: the source itself, or the checkpoint or adapter made into one."""
    if source.kind == "hf":
        return source.path
    from toolkit.export.consolidate import load_model
    from toolkit.export.hf_folder import write_model_folder

    model, tokenizer, notes = as_evaluation(load_model, source, base, merge_lora=True)
    for line in notes:
        print(f"[evaluate] {line}")
    return write_model_folder(model, tokenizer, work / "model", {}, {}, card="", writer="evaluation")


def main(argv: list[str] | None = None) -> int:
    die_with_trainer()  # a training run's scoring (eval.harness_tasks) ends with it
    world, main_process = environment.world_size(), environment.is_launch_main()
    try:
        args, cfg = parse_args(argv)
        if world > 1 and not environment.has_gpu():
            # the harness splits its documents over processes only where each has a GPU; elsewhere every process
            # would score them all: the first does, alone, as one process
            if not main_process:
                return 0
            print(f"[evaluate] {world} processes were launched, and the harness splits its work over GPUs only: "
                  "the first process evaluates alone on the CPU")
            environment.run_alone()
            world = 1
        # first: offline, a task of the Hub's is refused in a second or two, before the imports, the harness's index
        # and the model that take ~10 s
        check_hub(cfg)
        from toolkit.export.consolidate import resolve_source
        from toolkit.models.adapter import leave_out_bitsandbytes

        leave_out_bitsandbytes()
        quiet_weight_bars()
        harness()  # installed, and quiet
        check_base(args.base)
        source = as_evaluation(resolve_source, args.source, args.checkpoint)
        check_base(args.base, source)
        output = output_path(args, source)
        manager = task_manager(cfg)
        check_tasks(cfg, manager)
        # a checkpoint or adapter becomes a folder beside the output, so that every process of a launch reads it
        work = None
        if main_process and source.kind != "hf":
            with writing("evaluation"):
                output.absolute().parent.mkdir(parents=True, exist_ok=True)
                work = Path(tempfile.mkdtemp(prefix=".evaluate-", dir=output.absolute().parent))
        try:
            if world > 1:
                folder = shared_folder(source, args.base, work, main_process)
            else:
                folder = model_folder(source, args.base, work)
            if main_process:
                print(f"[evaluate] {source.describe()}: tasks {', '.join(cfg.tasks)}")
            from toolkit.training.harness import score

            results = score(folder, cfg, manager)
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
        if results is None:  # a data-parallel run's other processes
            return 0
        results[MARK] = {"source": source.describe(), "scores": scores(results)}
        print(table(results))
        write_results(output, results)
        print(f"[evaluate] wrote {output}")
    except UserError as exc:
        return said(exc, 2, main_process)
    except WriteFailed as exc:
        return said(exc, exc.exit, main_process)
    except Elsewhere as exc:
        return exc.code  # the first process said why
    except KeyboardInterrupt:  # Ctrl-C: its temporary model folder is gone (finally above), an earlier --output whole
        if main_process:
            print("[evaluate] stopped by Ctrl-C (SIGINT) before its scores were written; nothing was written",
                  file=sys.stderr)
        return 130
    return 0


class Elsewhere(Exception):
    """The first process of a launch failed where the others wait for it: they end with its exit code, silently."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def said(exc: Exception, code: int, main_process: bool) -> int:
    """Every process of a launch meets the same refusal: its line is said once."""
    if main_process:
        print(f"error: {exc}", file=sys.stderr)
    return code


def shared_folder(source: Source, base: str | None, work: Path | None, main_process: bool) -> Path:
    """Collective: the model folder, made by the first process and named to the others (who wait for it); a
    refusal or failed write of its making ends every process with its exit code, said by the first."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState()
    made: list = [None]
    if main_process:
        try:
            made = [(str(model_folder(source, base, work)), None)]
        except (UserError, WriteFailed) as exc:
            made = [(None, exc.exit if isinstance(exc, WriteFailed) else 2)]
            broadcast_object_list(made)
            raise
    broadcast_object_list(made)
    folder, code = made[0]
    if folder is None:
        raise Elsewhere(code)
    return Path(folder)


if __name__ == "__main__":
    sys.exit(main())
