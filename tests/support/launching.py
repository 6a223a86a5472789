"""Start a multi-process launch from a test so that a hang fails the test instead of stalling CI.

`subprocess.run(..., timeout=)` kills only the launcher; its ranks keep the output pipes open,
and reading them then blocks for ever. Here the launch gets a session of its own, and a
timeout kills the launcher and every rank it started.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess

import pytest


def free_port() -> int:
    """A free TCP port for one launch's rendezvous, so that launches never share one.

    Not one the kernel picks (bind to port 0): that comes from the ephemeral range, where any process's
    outgoing connection (gloo's, a store client's) may take it as its own port in the seconds before the
    launch listens on it; measured, once in ~8 runs of the suite a launch failed with EADDRINUSE. So
    ports come from outside the ephemeral range, each pytest worker its own share of it, handed out in
    turn, skipping any in use.
    """
    low, high = _PORTS
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    share = (high - low) // 4  # up to 4 workers
    if share < 64:  # the ephemeral range takes nearly every port: the kernel's pick it is
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first = low + (worker % 4) * share
    for _ in range(share):
        port = first + next(_handed) % share
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in {first}-{first + share}")


def _outside_ephemeral() -> tuple[int, int]:
    try:
        start, end = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        start, end = 32768, 60999  # Linux's default
    return (start - 12000, start) if start >= 22000 else (end + 1, 65536)


_PORTS = _outside_ephemeral()
_handed = itertools.count(random.randrange(1000))  # a rerun in the same minute starts elsewhere


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
