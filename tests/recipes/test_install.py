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
    """`bash recipes/install.sh ARGS` with this Python, its pip commands logged, not run: the commands."""
    log = tmp_path / "pip.log"
    log.write_text("")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", "recipes/install.sh", *args], cwd=ROOT,
                          env={**os.environ, **(env or {}), "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return log.read_text().splitlines()


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
    assert "-m pip install --quiet -e .[deepspeed,test,quant]" in install(tmp_path)
    assert stamp.read_text().split()[0] == str(ROOT)
    env, log = fake_deepspeed(tmp_path)
    assert install(tmp_path, "--build-cpu-adam", env=env) == []
    for _ in range(300):  # the build runs in the background
        if log.exists() and log.read_text():
            break
        time.sleep(0.1)
    session, nice, group_nice = log.read_text().split()
    assert int(session) != os.getsid(0), "a Ctrl-C of the install would stop the build half-way"
    assert (nice, group_nice) == ("19", "19")
