"""recipes/launch.sh: `accelerate launch` that exits with the recipe's code and shows a user error as one line.

Plain `accelerate launch` exits 1 for every failure, after torchrun's ChildFailedError report
(the last test here shows what it still does and what the ranks now do under it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import launching
import pytest
from recipe_runner import ROOT, TINY, run_recipe

from toolkit.training.metrics import read_metrics


def wrapper(accelerate_config: str | None, overrides: list[str], cache) -> list[str]:
    """recipes/launch.sh on 2 processes; without an accelerate config, by --num_processes alone."""
    config = ["--config_file", f"accelerate_configs/{accelerate_config}"] if accelerate_config else []
    return [
        "bash", "recipes/launch.sh", *config, "--num_processes", "2", "--main_process_port", str(launching.free_port()),
        "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", *TINY, *overrides,
    ]


def environment(cache) -> dict[str, str]:
    return {**os.environ, "LLM_TOOLKIT_CACHE": str(cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHON": sys.executable}


def launch(cmd: list[str], cache) -> subprocess.CompletedProcess:
    return launching.run(cmd, 300, cwd=ROOT, env=environment(cache))


def the_one_error(proc: subprocess.CompletedProcess) -> str:
    """The launch's only `error:` line, wherever a progress bar left it; and no launcher report."""
    out = proc.stdout + proc.stderr
    errors = re.findall(r"error: .*", out)
    assert len(errors) == 1, out[-6000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-6000:]
    return errors[0]


def test_a_missing_accelerate_config_is_one_line():
    proc = launching.run(["bash", "recipes/launch.sh", "--config_file", "accelerate_configs/zero4.yaml",
                          "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml"],
                         120, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "error: --config_file accelerate_configs/zero4.yaml does not exist (paths are relative to where you "
        "launch); did you mean accelerate_configs/zero3.yaml?\n"
    )


@pytest.mark.distributed
def test_bad_input_exits_2_with_one_line(tmp_path, data_cache):
    proc = launch(wrapper("ddp.yaml", ["train.max_stepz=3", f"output_dir={tmp_path}"], data_cache), data_cache)
    assert proc.returncode == 2, proc.stderr[-6000:]
    assert the_one_error(proc) == "error: unknown key train.max_stepz; did you mean train.max_steps?"


@pytest.mark.distributed
def test_a_data_error_seen_by_rank_0_only_is_one_line(tmp_path, data_cache):
    """Rank 0 reads the corpus while rank 1 waits in a barrier, which breaks when rank 0 exits. Launched by the
    installed command from a folder outside the checkout, the shipped configs named without their folders: ZeRO-3's
    DeepSpeed JSON is found from its accelerate config (the rank would refuse a path it cannot find first)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = [str(Path(sys.executable).with_name("llm-toolkit")), "pretrain", "--config_file", "zero3", "--num_processes",
           "2", "--main_process_port", str(launching.free_port()), "--config", "pretrain_tiny", *TINY,
           f"data.path={empty}", f"output_dir={tmp_path / 'run'}"]
    proc = launching.run(cmd, 300, cwd=elsewhere, env=environment(data_cache))
    assert proc.returncode == 2, proc.stderr[-6000:]
    assert the_one_error(proc) == f"error: data.path={empty} holds no text (all 1 file(s) are empty)"
    assert not any(elsewhere.iterdir())  # nothing written where it ran


@pytest.mark.distributed
def test_a_crash_keeps_its_traceback_and_torchruns_report(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text('import os, time\nif os.environ["RANK"] == "0":\n    raise RuntimeError("boom")\ntime.sleep(60)\n')
    proc = launching.run(["bash", "recipes/launch.sh", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes",
                          "2", "--main_process_port", str(launching.free_port()), str(script)],
                         120, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "ChildFailedError" in proc.stderr
    assert "closing signal SIGTERM" in proc.stderr  # torchrun's own lines, held back, shown after all


def losses(out) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def start_training(out, data_cache, accelerate_config: str | None = "ddp.yaml") -> subprocess.Popen:
    """A 2-process launch through the wrapper, once it has trained 3 steps."""
    cmd = wrapper(accelerate_config, ["train.max_steps=100000", "checkpoint.every=0", "eval.every=0", f"output_dir={out}"],
                  data_cache)
    proc = launching.start(cmd, cwd=ROOT, env=environment(data_cache))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(losses(out)) >= 3:
            break
        time.sleep(0.5)
    if proc.poll() is not None or len(losses(out)) < 3:
        pytest.fail(f"no 3 steps within 300 s: {launching.kill_all(proc)[1][-3000:]}")
    return proc


@pytest.mark.distributed
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_stops_after_a_checkpoint_with_code_3_and_resume_continues(tmp_path, data_cache, sig):
    """What SLURM does at preemption or a time limit: SIGTERM to the launcher; and a Ctrl-C, which
    the terminal sends the launcher alone (torchrun's ranks are in sessions of their own)."""
    out = tmp_path / "preempted"
    proc = start_training(out, data_cache)
    proc.send_signal(getattr(signal, sig))  # bash exec'd the launcher: this is its process
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 120 s after SIGTERM: {launching.kill_all(proc)[1][-3000:]}")
    assert proc.returncode == 3, stderr[-6000:]
    stops = re.findall(r"stopped by a signal at step \d+.*", stderr)
    assert len(stops) == 1 and stops[0].endswith("continue with resume=auto"), stderr[-6000:]  # rank 0's line only
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr and "SignalException" not in stderr
    assert "KeyboardInterrupt" not in stderr
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1 and (out / "checkpoints" / saved[0] / "trainer_state.json").is_file()
    stopped_at = int(saved[0].split("-")[1])
    if sig == "SIGINT":
        return  # what it saved is what SIGTERM's stop saves (one handler): resumed once, below

    # the resume is the trainer's, not the launcher's: on forked ranks
    run_recipe("pretrain", [*TINY, f"train.max_steps={stopped_at + 2}", "eval.every=0", f"output_dir={out}", "resume=auto"],
               nproc=2, cache=data_cache)
    assert sorted(losses(out)) == list(range(1, stopped_at + 3))


@pytest.mark.distributed
def test_plain_accelerate_launch_shows_a_rank_0_data_error_as_one_error_line(tmp_path, data_cache):
    """Without the wrapper the launcher still exits 1 and prints its report below the line; the
    ranks themselves agree: rank 1, whose barrier broke, exits with rank 0's code 2, silently."""
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"\x00\x01\xff\xfe not text")
    proc = run_recipe("pretrain", [*TINY, f"data.path={data}", f"output_dir={tmp_path / 'run'}"], nproc=2,
                      cache=data_cache, check=False, launcher=True)
    assert proc.returncode == 1  # accelerate launch passes no rank's code through
    errors = re.findall(r"error: .*", proc.stdout + proc.stderr)
    assert errors == [f"error: data.path={data} is not UTF-8 text (byte 0xff at offset 2, line 1); it holds NUL "
                      "bytes, so it is a binary file, not text; give a text file"], proc.stderr[-6000:]
    assert sorted(re.findall(r"exitcode\s+: (-?\d+)", proc.stderr)) == ["2", "2"], proc.stderr[-6000:]


@pytest.mark.distributed
def test_killing_the_launchers_process_group_ends_its_ranks(tmp_path, data_cache):
    """`kill -9 -- -PGID` of the launch (a shell, a job runner): torchrun's ranks sit in sessions of
    their own, and trained on as orphans, writing checkpoints into the folder; now they die with it,
    and the folder is free for a relaunch at once. Launched with --num_processes 2 and no accelerate config, which
    trained on one process (Accelerate's one-process launcher): two ranks, one world of 2 (toolkit.launch.options)."""
    import psutil

    out = tmp_path / "killed"
    proc = start_training(out, data_cache, accelerate_config=None)
    launcher = psutil.Process(proc.pid)
    ranks = launcher.children()
    assert len(ranks) == 2 and all(os.getsid(r.pid) != os.getsid(proc.pid) for r in ranks)  # out of the group's reach
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    for orphan in alive:
        orphan.kill()
    said = "".join(proc.communicate())  # the ranks held its pipes
    assert not alive, f"{len(alive)} rank(s) outlived the launcher"
    assert "strategy=DDP world_size=2 backend=gloo" in said and "were not passed" not in said, said[-3000:]
    steps = losses(out)
    time.sleep(3)
    assert losses(out) == steps  # nothing more written
    # killed before its first checkpoint: started over, the run folder's lock free (forked ranks: the lock is the
    # trainer's, not the launcher's)
    run_recipe("pretrain", [*TINY, f"train.max_steps={max(steps) + 1}", "eval.every=0", "checkpoint.every=0",
                            f"output_dir={out}", "resume=auto"], nproc=2, cache=data_cache)
    assert sorted(losses(out)) == list(range(1, max(steps) + 2))
