"""Start a multi-process launch from a test so that a hang fails the test instead of stalling CI.

`subprocess.run(..., timeout=)` kills only the launcher; its ranks keep the output pipes open,
and reading them then blocks for ever. Here the launch gets a session of its own, and a
timeout kills the launcher and every rank it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest


def free_port() -> int:
    """A free TCP port for one launch's rendezvous, so that launches never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Popen in a new session (text, stdout/stderr piped), for kill_all."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


def kill_all(child: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL the launcher and all its ranks; what they wrote so far.

    torchrun starts each rank in a session of its own, out of reach of the launcher's process
    group: the ranks are found as the launcher's descendants, and killed one by one.
    """
    import psutil

    try:
        ranks = psutil.Process(child.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    os.killpg(child.pid, signal.SIGKILL)
    for rank in ranks:
        try:
            rank.kill()
        except psutil.NoSuchProcess:
            pass
    return child.communicate()


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run to the end, or fail the test after `timeout` seconds with what the launch printed."""
    with start(cmd, **kwargs) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = kill_all(child)
            pytest.fail(f"{' '.join(cmd)} still running after {timeout:.0f} s (killed with all its ranks)\n"
                        f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
