"""recipes/install.sh run again in the environment it installed: pip is skipped while its stamp matches."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pip_commands(tmp_path: Path) -> list[str]:
    """The pip commands `bash recipes/install.sh` runs with this Python; logged, not run."""
    log = tmp_path / "pip.log"
    log.write_text("")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", "recipes/install.sh"], cwd=ROOT, env={**os.environ, "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return log.read_text().splitlines()


def test_a_second_install_skips_pip_until_the_stamp_says_otherwise(tmp_path):
    """tests/run.sh installs before every run: the second time in one environment costs no pip (~25 s). A stamp
    made from another checkout (or another pyproject.toml or install.sh) installs again."""
    stamp = Path(sysconfig.get_paths()["purelib"]) / "llm_toolkit_install.stamp"
    kept = stamp.read_text() if stamp.exists() else None
    try:
        stamp.write_text(f"{ROOT}-elsewhere 0123456789abcdef\n")
        assert "-m pip install --quiet -e .[deepspeed,test,quant]" in pip_commands(tmp_path)
        assert stamp.read_text().split()[0] == str(ROOT)
        assert pip_commands(tmp_path) == []
    finally:  # this environment's own stamp: this test installed nothing
        if kept is None:
            stamp.unlink()
        else:
            stamp.write_text(kept)
