"""`accelerate launch` that exits with the recipe's own code: what `recipes/launch.sh` runs.

    bash recipes/launch.sh --config_file accelerate_configs/zero3.yaml --num_processes 2 \\
        recipes/pretrain.py --config recipes/configs/pretrain_tiny.yaml

Same arguments as `accelerate launch`, each honoured or refused (toolkit/launch/options.py); the recipe's exit code
and one line, a missing --config_file or script refused in one line, SIGTERM/SIGUSR1/SIGINT passed on to the ranks.
What torchrun does instead, and why no flag could: docs/internals.md, toolkit/launch/launcher.py.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import yaml

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.files import read_yaml
from toolkit.config.user_paths import from_here
from toolkit.launch.environment import gpus_short
from toolkit.launch.options import given, honour, refusal, repeated
from toolkit.launch.rank_process import LAUNCHER_PID
from toolkit.run.writes import WriteFailed, writing

# entry.run's codes, first the one that names the cause when ranks differ: a user error makes its
# peers' collectives fail (4), and a rank stops (3) only when every rank does
RECIPE_CODES = (2, 4, 5, 3)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # its warnings are all about ranks' exits


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands import launch as accelerate_launch

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = one_line_parser(accelerate_launch.launch_command_parser()).parse_args(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    problem = (repeated(accelerate_launch.launch_command_parser(), argv, args.training_script) or missing_file(args)
               or out_of_range(args) or unreadable_config(args.config_file))
    crowded = None if problem else ranks_per_machine(args, gpus(), len(os.sched_getaffinity(0)))
    if crowded is not None and crowded.startswith("error: "):
        problem = crowded.removeprefix("error: ")
    if not problem:  # every option honoured or refused (toolkit.launch.options), once the counts are checked
        launch = honour(args, config_in_force(args), gpus())
        problem = refusal(given(accelerate_launch.launch_command_parser(), argv), launch)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    if crowded is not None:
        print(crowded, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="llm-toolkit-launch-") as copies:
        try:
            args.config_file = paths_from_its_folder(args.config_file, Path(copies))
        except WriteFailed as exc:  # a full temporary folder: one line (toolkit.run.writes.WRITERS)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return exc.exit
        return _launch(args)


def _launch(args) -> int:
    from accelerate.commands import launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ["PET_SIGNALS_TO_HANDLE"] = ",".join(
        s for s in os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
        if s.strip() not in {sig.name for sig in STOP_SIGNALS}
    )
    # with --debug and ACCELERATE_ENABLE_RICH=1, accelerate prints a failed launch's traceback and
    # returns as if all went well (exit 0); it must raise for the ranks' codes to be read
    accelerate_launch.is_rich_available = lambda: False
    os.environ[LAUNCHER_PID] = str(os.getpid())  # a rank's parent: how it knows it was not orphaned while starting
    os.environ.update(cpu_allocator(gpus(), os.environ))
    accelerate_launch.deepspeed_launcher = _with_launch_environment(accelerate_launch.deepspeed_launcher)
    warnings.showwarning = port_in_use_in_one_line(warnings.showwarning)
    stop = StopForwarder()
    held = HeldLog(logging.getLogger(ELASTIC_LOGGER))
    try:
        accelerate_launch.launch_command(args)
    except ChildFailedError as exc:
        hung = killed_at_shutdown(exc.failures)
        code = verdict({rank: failure.exitcode for rank, failure in exc.failures.items()}, stop.signal, hung)
        if code is None:
            held.release()
            raise
        for rank in sorted(hung):
            print(f"note: rank {rank} did not end when the launch asked it to (stopped or hung) and was killed",
                  file=sys.stderr, flush=True)
        return code
    except subprocess.CalledProcessError as exc:  # one process, or DeepSpeed's multi-node launcher
        code = verdict({0: exc.returncode}, stop.signal)
        if code is None:
            raise
        return code
    except SignalException as exc:  # SIGHUP/SIGQUIT: torchrun has ended the ranks with it
        return 128 + int(exc.sigval)
    finally:
        stop.finished = True
    return 0


PORT_IN_USE = re.compile(r"Port `(\d+)` is already in use\.")


def port_in_use_in_one_line(show):
    """warnings.showwarning, with Accelerate's paragraph about a busy port (another launch on this machine; it then
    takes a free one) said in one line instead of five, its source line included."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        busy = PORT_IN_USE.match(str(message))
        if busy is None:
            return show(message, category, filename, lineno, file, line)
        print(f"note: port {busy.group(1)} is in use (another launch on this machine?): this one takes a free port; "
              "--main_process_port N picks one", file=sys.stderr, flush=True)

    return showwarning


def _with_launch_environment(deepspeed_launcher):
    """accelerate's DeepSpeed launcher, with what its DDP and FSDP launchers set and it does not.

    They pass --num_cpu_threads_per_process (default: OMP_NUM_THREADS, else 1) on to the ranks as
    OMP_NUM_THREADS; the DeepSpeed one does not, and torchrun then sets 1 itself under a 4-line
    warning box. (DeepSpeed's import here, for its launcher's constants, finds DS_ACCELERATOR set by
    the toolkit's import on a machine without a GPU, and logs no guess.)"""

    def launch(args):
        os.environ.setdefault("OMP_NUM_THREADS", str(args.num_cpu_threads_per_process or 1))
        return deepspeed_launcher(args)

    return launch


def cpu_allocator(gpus: int, environ) -> dict[str, str]:
    """The variables that give the ranks of a launch without GPUs an allocator that reuses freed memory without
    glibc's holes, as torch's own CPU launcher (torch.backends.xeon.run_cpu) preloads one: mimalloc, which the
    toolkit installs with it (cmeel-mimalloc, on Linux), else the system's tcmalloc (libtcmalloc-minimal4); {}
    where there is neither.

    glibc's heap keeps the holes a step's temporaries leave between the tensors it keeps, and a step allocates ~5x
    its peak in temporaries: the shipped LoRA of SmolLM2 (one process) peaks at 5.3 GB of resident memory under
    glibc, 3.1 GB under mimalloc and 3.6 GB under tcmalloc, at about the same speed, with the same numbers
    (docs/benchmarks.md). Giving freed memory back instead costs 1.5-2x the step time in page faults
    (toolkit.strategy.accelerator.keep_freed_memory). An LD_PRELOAD already set, even empty, is the user's choice
    and is kept."""
    import ctypes.util

    if gpus or "LD_PRELOAD" in environ:
        return {}
    bundled = bundled_mimalloc()
    if bundled is not None:
        return {"LD_PRELOAD": bundled}
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if found is None:
        return {}
    # tcmalloc reports each allocation above 1 GB on stderr ("tcmalloc: large alloc"): a large logits tensor is no news
    return {"LD_PRELOAD": found, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**62)}


def bundled_mimalloc() -> str | None:
    """The mimalloc library the cmeel-mimalloc package installs (a dependency on Linux), or None."""
    import importlib.util

    spec = importlib.util.find_spec("cmeel")
    if spec is None or not spec.submodule_search_locations:
        return None
    library = Path(next(iter(spec.submodule_search_locations))).parent / "cmeel.prefix" / "lib" / "libmimalloc.so"
    return str(library) if library.is_file() else None


def one_line_parser(parser):
    """accelerate launch's parser, whose refusals (`--num_processes x`) are one line instead of its 90-line usage."""

    def error(message: str):
        raise UserError(f"{message}; see accelerate launch --help")

    parser.error = error
    return parser


def missing_file(args) -> str | None:
    """The launch's config file or script, when it does not exist: accelerate would raise a traceback."""
    if args.config_file is not None and not args.config_file.strip():
        return f"--config_file {args.config_file!r} names no file; give an accelerate config, e.g. {from_here(SHIPPED / 'ddp.yaml')}"
    if args.config_file is not None and Path(args.config_file).is_dir():
        return f"--config_file {args.config_file} is a folder; give an accelerate config in it, e.g. {from_here(SHIPPED / 'ddp.yaml')}"
    if args.config_file is not None and not Path(args.config_file).is_file():
        given = Path(args.config_file)
        shipped = sorted(p.name for p in given.parent.glob("*.yaml")) if given.parent.is_dir() else []
        close = difflib.get_close_matches(given.name, shipped, n=1)
        # from elsewhere (llm-toolkit takes a shipped config by its name): the nearest of the shipped ones, first
        # for a name alone (`zero9`), whose folder is where the command runs and holds the user's own YAMLs
        names = sorted(p.stem for p in SHIPPED.glob("*.yaml"))
        near = difflib.get_close_matches(given.stem, names, n=1)
        alone = given.parent == Path(".")
        hint = (
            f"did you mean {near[0]} (accelerate_configs/{near[0]}.yaml)?" if alone and near
            else f"did you mean {given.parent / close[0]}?" if close
            else f"{given.parent}/ has {', '.join(shipped)}" if shipped and not alone
            else f"did you mean {near[0]} (accelerate_configs/{near[0]}.yaml)?" if near
            else f"the shipped ones are in {from_here(SHIPPED)}/"
        )
        return f"--config_file {args.config_file} does not exist (paths are relative to where you launch); {hint}"
    if not (args.module or args.no_python) and not Path(args.training_script).is_file():
        return f"{args.training_script} does not exist (paths are relative to where you launch)"
    return None


SHIPPED = Path(__file__).resolve().parents[2] / "accelerate_configs"

# accelerate takes these as any int; past their range it raises a traceback from deep inside its launch
# (--main_process_port 2961234: "OverflowError: connect_ex(): port must be 0-65535"; 0 picks a free one)
RANGES = {"main_process_port": (0, 65535), "num_processes": (1, None), "num_machines": (1, None),
          "machine_rank": (0, None), "max_restarts": (0, None)}


def out_of_range(args) -> str | None:
    """The first launch argument given outside what it can be, as a line to show."""
    for name, (low, high) in RANGES.items():
        value = getattr(args, name)
        if value is not None and (value < low or high is not None and value > high):
            return f"--{name} {value} is out of range: use {f'{low}-{high}' if high else f'{low} or more'}"
    return None


# what each key of an accelerate config the launcher reads must be (Accelerate's own checks are tracebacks)
CONFIG_TYPES = {"num_processes": int, "num_machines": int, "use_cpu": bool, "deepspeed_config": dict}


def read_accelerate_config(config_file: str | None) -> dict:
    """The accelerate config a launch names ({} for none), read strictly (toolkit.config.read_yaml: not UTF-8,
    binary, not YAML, a key written twice are each one line), or ConfigError: one line naming the file."""
    if config_file is None:
        return {}
    config = read_yaml(config_file)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError([f"--config_file {config_file} must hold a mapping of keys (an accelerate config, e.g. "
                           f"accelerate_configs/ddp.yaml), found a {type(config).__name__}"])
    for key, kind in CONFIG_TYPES.items():
        value = config.get(key)
        if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
            raise ConfigError([f"--config_file {config_file}: {key}={value!r:.60} must be "
                               f"{ {int: 'an integer', bool: 'true or false', dict: 'a mapping'}[kind]}"])
    return config


def config_in_force(args) -> dict:
    """The accelerate config the launch takes: --config_file's, else the one `accelerate config` saved (Accelerate
    reads it unless --cpu), else {}."""
    from accelerate.commands.config import default_config_file

    path = args.config_file or (default_config_file if Path(default_config_file).is_file() and not args.cpu else None)
    try:
        return read_accelerate_config(path)
    except ConfigError:
        return {}  # --config_file's problem is said first; Accelerate's own reads its saved one


def unreadable_config(config_file: str | None) -> str | None:
    """What is wrong with the launch's accelerate config file, as a line to show; None when it reads."""
    try:
        read_accelerate_config(config_file)
    except ConfigError as exc:
        return str(exc)
    return None


def paths_from_its_folder(config_file: str | None, copies: Path) -> str | None:
    """The accelerate config to launch with: as given, or a copy in `copies` whose DeepSpeed JSON path is absolute,
    where the given one is relative and found from the config's folder (or the folder above it: the shipped
    configs name ds_configs/X.json, beside accelerate_configs/) but not from where the launch runs."""
    if config_file is None:
        return None
    try:
        config = read_accelerate_config(config_file)
    except ConfigError:
        return config_file  # main() said what is wrong with it
    ds = config.get("deepspeed_config")
    named = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    if not isinstance(named, str) or Path(named).is_absolute() or Path(named).exists():
        return config_file
    here = Path(config_file).resolve().parent
    found = next((p for p in (here / named, here.parent / named) if p.is_file()), None)
    if found is None:
        return config_file  # the rank's own check names it
    ds["deepspeed_config_file"] = str(found)
    copy = copies / Path(config_file).name
    with writing("launch config copy", copy):
        copy.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(copy)


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def ranks_per_machine(args, gpus: int, cores: int) -> str | None:
    """One line when the launch starts more ranks on this machine than it has GPUs ("error: ...": each rank takes
    a GPU of its own, and the surplus would fail one by one after its imports) or, without a GPU, than it has CPU
    cores ("warning: ...": they share them, each with its own copy of the model). None when they fit.
    The counts are --num_processes and --num_machines, else the config file's, as Accelerate takes them."""
    try:
        config = read_accelerate_config(args.config_file)
    except ConfigError:
        return None  # main() says what is wrong with it
    processes = args.num_processes or config.get("num_processes") or 1
    machines = args.num_machines or config.get("num_machines") or 1
    here = -(-int(processes) // int(machines))
    where = "--num_processes" if args.num_processes else f"num_processes: {processes} in {args.config_file}"
    if args.cpu or config.get("use_cpu") or not gpus:
        if here <= cores:
            return None
        return (f"warning: {here} processes on {cores} CPU cores ({where}): they share the cores, each with its own "
                f"copy of the model; --num_processes {cores} trains the same steps (the global batch is the recipe's)")
    short = gpus_short(here, gpus, int(machines), where)
    return None if short is None else f"error: {short}"


def killed_at_shutdown(failures: dict) -> set[int]:
    """The ranks torchrun killed (SIGKILL) after another had exited with a recipe's code: a rank that did not end on
    its SIGTERM within the shutdown's 30 s (SIGSTOPped, or stuck) is ended so, and hides nothing. A rank killed
    before (the OOM killer) is the crash itself. `failures`: ChildFailedError's, each with the second it was seen."""
    first = min((f.timestamp for f in failures.values() if f.exitcode in RECIPE_CODES), default=None)
    return {rank for rank, f in failures.items()
            if f.exitcode == -signal.SIGKILL and first is not None and f.timestamp > first}


def verdict(codes: dict[int, int], forwarded: int | None, hung: set[int] = frozenset()) -> int | None:
    """The launch's exit code from its failed ranks' codes; None for a crash (torchrun's report stays).

    A negative code is a rank ended by a signal: SIGTERM is what torchrun sends the other ranks
    once one has exited, so it hides nothing, nor does its SIGKILL of the `hung` ranks that outlived it
    (killed_at_shutdown); any other SIGKILL or SIGSEGV is the crash itself.
    `forwarded` is the stop signal this launcher passed on: ranks that had no handler for it yet
    (still starting) die of it, and the launch ends as a process killed by it would (128 + n).
    """
    recipe = [c for c in codes.values() if c in RECIPE_CODES]
    ended = [c for rank, c in codes.items() if c not in RECIPE_CODES and rank not in hung]
    # a rank that was not training yet ends at once on a signal, with 128 + n (toolkit.training.stop.StopRequest)
    if recipe and all(c in (-signal.SIGTERM, 128 + signal.SIGTERM) for c in ended):
        return min(recipe, key=RECIPE_CODES.index)
    if forwarded is not None and codes and all(c in (-forwarded, 128 + forwarded) for c in codes.values()):
        return 128 + forwarded
    return None


class StopForwarder:
    """Passes SIGTERM/SIGUSR1 on to the ranks (this process's children), and the launch goes on.

    Each rank saves a checkpoint at the end of its step and exits with 3; the launcher sees those
    exits as it sees any other. `signal` is the last one forwarded.
    """

    def __init__(self):
        self.signal: int | None = None
        self.finished = False  # the launch is over: a late Ctrl-C must not raise while the interpreter exits
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._forward)

    def _forward(self, signum, frame) -> None:
        import psutil

        first, self.signal = self.signal is None, signum
        ranks = psutil.Process().children()
        if not ranks:
            # none started yet: end here (torchrun's cleanup stops any it is starting); after a
            # first stop they have exited, and the launch is ending with their code
            if first and not self.finished:
                sys.exit(128 + signum)
            return
        for rank in ranks:
            try:
                # A Ctrl-C goes to the terminal's whole foreground group (a job runner's SIGINT
                # usually to a group too): a rank in ours (one process: accelerate keeps it
                # there) has it already, and a second one would end it at once, unsaved.
                if signum == signal.SIGINT and os.getpgid(rank.pid) == os.getpgrp():
                    continue
                rank.send_signal(signum)
            except (psutil.NoSuchProcess, ProcessLookupError):  # exited meanwhile
                pass


class HeldLog(logging.Filter):
    """Holds a logger's records back until `release`; without it they are dropped."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.logger = logger
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)


if __name__ == "__main__":
    sys.exit(main())
