"""The launcher's decisions, without a launch (the launches are in tests/recipes/test_launch_wrapper.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolkit.launch.launcher import (
    RANGES,
    HeldLog,
    bundled_mimalloc,
    cpu_allocator,
    killed_at_shutdown,
    missing_file,
    out_of_range,
    ranks_per_machine,
    verdict,
)

ROOT = Path(__file__).resolve().parents[3]
TERM, KILL, USR1, INT = int(signal.SIGTERM), int(signal.SIGKILL), int(signal.SIGUSR1), int(signal.SIGINT)

CASES = {
    # the ranks' codes as torchrun reports them (negative: ended by that signal), the stop signal
    # this launcher forwarded, and the launch's code (None: a crash, torchrun's report is shown)
    "bad input, the other rank ended by torchrun": ({0: 2, 1: -TERM}, None, 2),
    "bad input on rank 0, rank 1 followed it quietly": ({0: 2, 1: 2}, None, 2),
    "bad input on one rank, the others' collectives failed": ({0: 4, 1: 2, 2: 4}, None, 2),
    "stopped by a signal": ({0: 3, 1: 3}, TERM, 3),
    "a collective failed": ({0: 4, 1: -TERM}, None, 4),
    "a traceback": ({0: 1, 1: -TERM}, None, None),
    "a traceback beside a recipe's code": ({0: 2, 1: 1}, None, None),
    "killed by the OOM killer": ({0: -KILL, 1: 4}, None, None),
    "stopped while starting, before the handler": ({0: -USR1, 1: -USR1}, USR1, 128 + USR1),
    "SIGTERM from elsewhere while starting": ({0: -TERM, 1: -TERM}, None, None),
    "one process, bad input": ({0: 2}, None, 2),
    "bad input, the other rank ended at once by torchrun's SIGTERM (not training yet)": ({0: 2, 1: 128 + TERM}, None, 2),
    "Ctrl-C: stopped with a checkpoint": ({0: 3, 1: 3}, INT, 3),
    "a second Ctrl-C, or one before training: every rank ended at once": ({0: 128 + INT, 1: 128 + INT}, INT, 128 + INT),
    # killed_at_shutdown: a SIGSTOPped rank outlives torchrun's SIGTERM and is killed 30 s after the others' timeout
    "a stopped rank, killed after the others' collective failed": ({0: 4, 1: -KILL}, None, 4, {1}),
}


@pytest.mark.parametrize("name", CASES)
def test_the_launch_exits_with_the_recipes_code_unless_a_rank_crashed(name):
    codes, forwarded, expected, *hung = CASES[name]
    assert verdict(codes, forwarded, *hung) == expected


def test_a_rank_killed_after_a_recipes_exit_is_the_shutdown_and_one_killed_before_is_the_crash():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(code: int, at: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="")
        f.timestamp = at
        return f

    assert killed_at_shutdown({0: failure(4, 100), 1: failure(-KILL, 130)}) == {1}  # SIGSTOP: 30 s later
    assert killed_at_shutdown({0: failure(4, 100), 1: failure(-KILL, 100)}) == set()  # OOM killer: first
    assert killed_at_shutdown({0: failure(-TERM, 100), 1: failure(-KILL, 130)}) == set()


def launch_args(*argv: str):
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args(list(argv))


def test_missing_files_are_named_with_the_nearest_shipped_config(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert missing_file(launch_args("--config_file", "accelerate_configs/zero3.yaml", "recipes/pretrain.py")) is None
    assert missing_file(launch_args("--config_file", "accelerate_configs/zero4.yaml", "recipes/pretrain.py")) == (
        "--config_file accelerate_configs/zero4.yaml does not exist (paths are relative to where you launch); "
        "did you mean accelerate_configs/zero3.yaml?"
    )
    # a folder without configs, or llm-toolkit's name of a shipped one mistyped from elsewhere: the nearest shipped one
    assert missing_file(launch_args("--config_file", "elsewhere/ddp.yaml", "recipes/pretrain.py")).endswith(
        "did you mean ddp (accelerate_configs/ddp.yaml)?"
    )
    assert missing_file(launch_args("--config_file", "zero4", "recipes/pretrain.py")).endswith(
        "did you mean zero3 (accelerate_configs/zero3.yaml)?"
    )
    assert missing_file(launch_args("--config_file", "elsewhere/qqq.yaml", "recipes/pretrain.py")).endswith(
        "the shipped ones are in accelerate_configs/"  # from the checkout: relative
    )
    # a name alone (llm-toolkit's way to name a shipped one) where the user's own YAMLs are: the nearest shipped one,
    # not the folder's list (it offered a recipe's YAML as the accelerate config)
    (tmp_path / "my_recipe.yaml").write_text("train: {max_steps: 1}\n")
    monkeypatch.chdir(tmp_path)
    assert missing_file(launch_args("--config_file", "zero9", str(ROOT / "recipes" / "pretrain.py"))).endswith(
        "did you mean zero3 (accelerate_configs/zero3.yaml)?"
    )
    monkeypatch.chdir(ROOT)
    assert missing_file(launch_args("recipes/pretrian.py")) == (
        "recipes/pretrian.py does not exist (paths are relative to where you launch)"
    )


def test_a_config_file_that_is_empty_or_a_folder_and_a_value_accelerate_refuses_are_one_line(tmp_path, monkeypatch, capsys):
    """accelerate's own refusal (`--num_processes x`) was its 90-line usage block; a folder was "does not exist"."""
    from toolkit.launch.launcher import main

    monkeypatch.chdir(tmp_path)  # from elsewhere, the shipped configs by a path that works there
    for argv, line in (
        (["--config_file", str(tmp_path)], f"--config_file {tmp_path} is a folder; give an accelerate config in it, "
                                            f"e.g. {ROOT}/accelerate_configs/ddp.yaml"),
        (["--config_file", ""], f"--config_file '' names no file; give an accelerate config, e.g. {ROOT}/accelerate_configs/ddp.yaml"),
        (["--num_processes", "x"], "argument --num_processes/--num-processes: invalid int value: 'x'; see accelerate launch --help"),
        (["--config_file", "qqq.yaml"], f"--config_file qqq.yaml does not exist (paths are relative to where you launch); "
                                        f"the shipped ones are in {ROOT}/accelerate_configs/"),
    ):
        assert main([*argv, str(ROOT / "recipes" / "pretrain.py"), "--config", "x"]) == 2
        assert capsys.readouterr().err == f"error: {line}\n"


OUT_OF_RANGE = {  # every bounded launch argument, each past both of its ends
    "main_process_port": (["-1", "65536", "2961234"], "use 0-65535"),
    "num_processes": (["0", "-2"], "use 1 or more"),
    "num_machines": (["0"], "use 1 or more"),
    "machine_rank": (["-1"], "use 0 or more"),
    "max_restarts": (["-1"], "use 0 or more"),
}


def test_launch_arguments_out_of_range_are_one_line():
    assert OUT_OF_RANGE.keys() == RANGES.keys()  # a bounded argument added there is walked here
    assert out_of_range(launch_args("--main_process_port", "29500", "--num_processes", "2", "x.py")) is None
    assert out_of_range(launch_args("--main_process_port", "0", "x.py")) is None  # accelerate picks a free port
    for name, (values, use) in OUT_OF_RANGE.items():
        for value in values:
            assert out_of_range(launch_args(f"--{name}", value, "x.py")) == f"--{name} {value} is out of range: {use}"


# (launch arguments, GPUs, CPU cores) -> the line before any rank starts (None: they fit)
CROWDED = {
    "zero3.yaml's 8 on 2 cores": (["--config_file", "accelerate_configs/zero3.yaml"], 0, 2,
                                  "warning: 8 processes on 2 CPU cores (num_processes: 8 in accelerate_configs/zero3.yaml)"),
    "2 on 2 cores": (["--config_file", "accelerate_configs/zero3.yaml", "--num_processes", "2"], 0, 2, None),
    "3 on 2 cores, asked": (["--num_processes", "3"], 0, 2, "warning: 3 processes on 2 CPU cores (--num_processes)"),
    "8 on 2 GPUs": (["--config_file", "accelerate_configs/ddp.yaml"], 2, 16,
                    "error: 8 processes on a machine with 2 GPUs (num_processes: 8 in accelerate_configs/ddp.yaml): "
                    "one GPU a process; use --num_processes 2"),
    "8 on 8 GPUs": (["--config_file", "accelerate_configs/ddp.yaml"], 8, 16, None),
    "16 over 2 machines of 8 GPUs": (["--config_file", "accelerate_configs/multinode_zero3.yaml"], 8, 16, None),
    "16 over 2 machines of 4 GPUs": (["--config_file", "accelerate_configs/multinode_zero3.yaml"], 4, 16,
                                     "error: 8 processes on a machine with 4 GPUs (num_processes: 16 in "
                                     "accelerate_configs/multinode_zero3.yaml): one GPU a process; use --num_processes 8"),
    "--cpu on a GPU machine": (["--cpu", "--num_processes", "4"], 8, 2, "warning: 4 processes on 2 CPU cores"),
    "no config, one process": ([], 0, 1, None),
}


@pytest.mark.parametrize("case", CROWDED)
def test_more_ranks_than_the_machine_has_gpus_or_cores_is_said_before_any_starts(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv, gpus, cores, line = CROWDED[case]
    said = ranks_per_machine(launch_args(*argv, "recipes/pretrain.py"), gpus, cores)
    assert said == line if line is None or line.startswith("error") else said.startswith(line), said


def test_cpu_ranks_get_the_bundled_mimalloc_and_it_is_what_their_processes_run_on():
    """The toolkit's own allocator, installed with it (docs/benchmarks.md: 5.3 GB of resident memory under glibc,
    3.1 under mimalloc for the README's LoRA of SmolLM2), preloaded before tcmalloc, and mapped in a process given
    the launcher's variables."""
    added = cpu_allocator(0, {})
    assert added == {"LD_PRELOAD": bundled_mimalloc()} and added["LD_PRELOAD"].endswith("libmimalloc.so")
    maps = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"], env={**os.environ, **added},
                          capture_output=True, text=True, check=True)
    assert "libmimalloc.so" in maps.stdout and not maps.stderr
    assert cpu_allocator(2, {}) == {} and cpu_allocator(0, {"LD_PRELOAD": ""}) == {}


@pytest.mark.parametrize(("libraries", "gpus", "environ", "expected"), [
    ({"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}, 0, {}, "libtcmalloc_minimal.so.4"),
    ({"tcmalloc": "libtcmalloc.so.4"}, 0, {}, "libtcmalloc.so.4"),  # gperftools' full library, when only it is there
    ({"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}, 2, {}, None),  # GPUs: their memory has its own allocator
    ({"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}, 0, {"LD_PRELOAD": ""}, None),  # the user's choice, even empty
    ({"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}, 0, {"LD_PRELOAD": "libjemalloc.so.2"}, None),
    ({}, 0, {}, None),  # a system without it: glibc, as before
])
def test_cpu_ranks_get_tcmalloc_where_the_system_has_it(monkeypatch, libraries, gpus, environ, expected):
    """What the launcher adds to its ranks' environment (docs/benchmarks.md: 5.3 GB of resident memory
    under glibc, 3.6 under tcmalloc, for the shipped LoRA of SmolLM2)."""
    import ctypes.util

    import toolkit.launch.launcher as launcher

    monkeypatch.setattr(ctypes.util, "find_library", libraries.get)
    monkeypatch.setattr(launcher, "bundled_mimalloc", lambda: None)  # a system without the package (not Linux)
    added = cpu_allocator(gpus, environ)
    assert added.get("LD_PRELOAD") == expected
    if expected:  # and tcmalloc's "large alloc" lines stay off the user's terminal
        assert int(added["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 2**40


def test_torchruns_exit_warnings_are_held_back_until_released(caplog):
    logger = logging.getLogger("toolkit.test.elastic")
    with caplog.at_level(logging.WARNING):
        held = HeldLog(logger)
        logger.warning("Sending process %s closing signal %s", 123, "SIGTERM")
        assert caplog.records == []
        held.release()  # a crash: shown after all
        assert [r.getMessage() for r in caplog.records] == ["Sending process 123 closing signal SIGTERM"]
        logger.warning("after")
        assert len(caplog.records) == 2


FORWARDING = textwrap.dedent("""
    import signal, subprocess, sys, os, time
    from toolkit.launch.launcher import StopForwarder
    stop = StopForwarder()
    # a rank: stops on SIGUSR1 with the recipe's code 3
    rank = subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(3)); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    rank.stdout.readline()
    os.kill(os.getpid(), signal.SIGUSR1)
    print(rank.wait(timeout=30), stop.signal)
""")


def test_a_stop_signal_to_the_launcher_reaches_its_ranks():
    done = subprocess.run([sys.executable, "-c", FORWARDING], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["3", str(USR1)], done.stderr


def test_a_stop_signal_before_any_rank_started_ends_the_launch():
    code = "from toolkit.launch.launcher import StopForwarder; import os, signal, time\n" \
           "StopForwarder(); os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + TERM, done.stderr


def test_a_second_ctrl_c_after_the_ranks_exited_does_not_raise_in_the_launcher():
    """The ranks stopped at the first Ctrl-C and exited; a second one must not raise SystemExit
    while the launcher returns their code (it did, inside an atexit callback: a traceback)."""
    code = "from toolkit.launch.launcher import StopForwarder; import os, signal, time\n" \
           "stop = StopForwarder(); stop.signal = signal.SIGINT; os.kill(os.getpid(), signal.SIGINT); " \
           "time.sleep(0.2); print('returned')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "returned", "")


def test_a_busy_port_is_one_line_and_other_warnings_are_shown_as_they_were(capsys):
    from toolkit.launch.launcher import port_in_use_in_one_line

    shown = []
    show = port_in_use_in_one_line(lambda *args: shown.append(str(args[0])))
    show(UserWarning("Port `29500` is already in use. Accelerate will attempt to launch in a standalone-like mode "
                     "by finding an open port automatically for this session. If this current attempt fails, ..."),
         UserWarning, "accelerate/utils/launch.py", 236)
    show(UserWarning("something else"), UserWarning, "x.py", 1)
    assert capsys.readouterr().err == ("note: port 29500 is in use (another launch on this machine?): this one takes a "
                                       "free port; --main_process_port N picks one\n")
    assert shown == ["something else"]
