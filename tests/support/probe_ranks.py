"""Run a probe script on N ranks forked from a server that imported torch, transformers,
Accelerate and DeepSpeed once, instead of starting N new Pythons through a launcher.

A rank that `accelerate launch` or torchrun starts spends ~5.5 CPU-s importing those before its
first line of work, and the suite is CPU-bound on two cores (tests/README.md). The probes under
tests/toolkit test the toolkit's strategy code, not the launcher (the recipes' tests launch as
users do). So each pytest worker keeps one server (tests/support/probe_rank_server.py) that imported
the heavy modules, and a probe's ranks are forked from it, each with this process's environment
plus the variables the real launcher gives that rank: recorded once per launcher and process
count, by launching a script that only saves its environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cost
import launching
import pytest

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent  # the helpers and the probes that run on ranks
# Variables that tie a rank to the launcher that recorded them: its store, its error files.
LAUNCHER_ONLY = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID")
_recorded: dict[tuple[str, ...], list[dict[str, str]]] = {}
_printed: dict[tuple[str, ...], str] = {}  # what each recording launch printed: the launcher's own lines
_server: subprocess.Popen | None = None


def server() -> subprocess.Popen:
    """This process's rank server (tests/support/probe_rank_server.py), started on first use."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("probe_rank_server.py"))], cwd=ROOT,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return _server


def _answer(process: subprocess.Popen, deadline: float) -> dict | None:
    """The server's next line, or None if none came before the deadline."""
    ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return None
    line = process.stdout.readline()
    if not line:
        pytest.fail(f"tests/support/probe_rank_server.py ended (exit code {process.wait()})")
    return json.loads(line)


def launcher(accelerate_config: str | None) -> list[str]:
    """The launcher a probe's ranks come from: `accelerate launch --config_file` a shipped config
    (or one by path), or plain torchrun with None."""
    if accelerate_config is None:
        return [sys.executable, "-m", "torch.distributed.run"]
    path = accelerate_config if "/" in accelerate_config else f"accelerate_configs/{accelerate_config}"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", path]


def recorded_environment(accelerate_config: str | None, nproc: int, launch_args: list[str] = ()) -> list[dict[str, str]]:
    """What the launcher sets for each of `nproc` ranks, beyond this process's own environment."""
    key = (accelerate_config or "torchrun", str(nproc), *launch_args)
    if key not in _recorded:
        with tempfile.TemporaryDirectory(prefix="launcher-environment-") as folder:
            out = Path(folder)
            size = ["--num_processes", str(nproc)] if accelerate_config else ["--nproc_per_node", str(nproc)]
            port = ["--main_process_port" if accelerate_config else "--master_port", str(launching.free_port())]
            (out / "save_environment.py").write_text(
                "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))\n"
            )
            cmd = [*launcher(accelerate_config), *size, *port, *launch_args, str(out / "save_environment.py"),
                   str(out / "rank")]
            proc = launching.run(cmd, 120, cwd=ROOT, env=os.environ.copy())
            if proc.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            seen = [json.loads((out / f"rank{rank}").read_text()) for rank in range(nproc)]
        _recorded[key] = [{k: v for k, v in rank.items() if os.environ.get(k) != v and k not in LAUNCHER_ONLY}
                          for rank in seen]
        _printed[key] = proc.stdout + proc.stderr
    return _recorded[key]


def launcher_output(accelerate_config: str | None, nproc: int, launch_args: list[str] = ()) -> str:
    """What the launcher printed while it started `nproc` ranks that print nothing: the lines a user sees from it
    above a forked run's own."""
    recorded_environment(accelerate_config, nproc, launch_args)
    return _printed[(accelerate_config or "torchrun", str(nproc), *launch_args)]


def run(script: Path, args: list[str], nproc: int, accelerate_config: str | None = None,
        env: dict[str, str] | None = None, timeout: float = 300, launch_args: list[str] = ()) -> subprocess.CompletedProcess:
    """`script args` on `nproc` ranks as `launcher(accelerate_config) *launch_args` would start them; returncode:
    the exit code of the first rank to fail (the others are then killed, as torchrun does), else 0;
    stdout: every rank's output, rank by rank. Ranks still running after `timeout` seconds are
    killed and fail the test."""
    port = str(launching.free_port())
    envs = [{**os.environ, **launched, "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             **(env or {})} for launched in recorded_environment(accelerate_config, nproc, launch_args)]
    with tempfile.TemporaryDirectory(prefix="probe-ranks-") as folder:
        logs = [str(Path(folder) / str(rank)) for rank in range(nproc)]
        done = _serve(script, args, envs, logs, timeout)
        output = "\n".join(f"--- rank {r}\n{Path(log).read_text(errors='replace')}" for r, log in enumerate(logs))
    if done is None:
        pytest.fail(f"{script} on {nproc} ranks still running after {timeout:.0f} s (killed)\n{output[-8000:]}")
    return subprocess.CompletedProcess([str(script), *map(str, args)], done["first"], output, "")


def python(script: Path, args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python script args` with exactly the environment `env`, in a process forked from the server: for
    a run whose results a test compares, not one whose output it reads as a user would see it (the
    imports' own notices went to the server)."""
    with tempfile.TemporaryDirectory(prefix="probe-ranks-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        done = _serve(script, args, [env], [[str(out), str(err)]], timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if done is None:
        pytest.fail(f"python {script} still running after {timeout:.0f} s (killed)\n{stdout[-4000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(["python", str(script), *map(str, args)], done["first"], stdout, stderr)


def _serve(script: Path, args: list, envs: list[dict[str, str]], logs: list, timeout: float) -> dict | None:
    """One request to the server; its answer with the exit codes, or None when the ranks hung and were killed."""
    request = {"script": str(script), "args": [str(a) for a in args], "envs": envs, "logs": logs}
    for log in logs:  # a rank opens its own log: one killed (its timeout) before that still leaves an empty one
        for path in log if isinstance(log, list) else [log]:
            Path(path).touch()
    process = server()
    process.stdin.write(json.dumps(request) + "\n")
    process.stdin.flush()
    deadline = time.monotonic() + timeout
    started = _answer(process, deadline + 60)
    if started is None:
        pytest.fail(f"tests/support/probe_rank_server.py did not start the ranks of {script} in {timeout + 60:.0f} s")
    done = _answer(process, deadline)
    if done is None:  # hung: kill the ranks; the server then reports them
        for pid in started["pids"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _answer(process, time.monotonic() + 60)
    else:
        cost.tally["forked_cpu_s"] += done["cpu_s"]
        cost.tally["forked_runs"] += 1
    return done
