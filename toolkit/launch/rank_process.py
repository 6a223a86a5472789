"""What a rank's process owes its launch: to die with its launcher, to know which launch it is
part of, and to create its process groups within train.collective_timeout_s.

torchrun starts every rank in a session of its own, so `kill -9 -- -PGID` of an `accelerate
launch` (a shell's job control, a job runner, the OOM killer) ended only the launcher: measured,
its ranks trained on as orphans, wrote checkpoints into the run folder, and held torchrun's
rendezvous port, where a relaunch's process-group creation then hung.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

LAUNCHER_PID = "LLM_TOOLKIT_LAUNCHER_PID"  # set by toolkit.launch.launcher for its ranks
TRAINER_PID = "LLM_TOOLKIT_TRAINER_PID"  # set by a training run for the process that scores its model
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def die_with_launcher() -> None:
    """Under torchrun, have the kernel SIGKILL this rank when its launcher dies (PR_SET_PDEATHSIG).

    The parent of a torchrun rank is the launcher itself: `accelerate launch` runs torchrun's
    agent in its own process. SIGKILL rather than SIGTERM: a stop that saves a checkpoint is a
    SIGTERM to the launcher, which passes it on (bash recipes/launch.sh, or torchrun itself); a
    launcher that died without doing so was killed hard on purpose or by the system. A rank
    that outlived it to checkpoint would do so with nobody to collect its exit code, its
    output going to a pipe that may be closed, and while stuck in a collective (often why the
    launcher was killed) it would hold the run folder, the ports and the memory for up to
    train.collective_timeout_s. Checkpoints are written whole or not at all, so a kill loses
    at most the steps since the last one, as any hard kill does.

    One-process runs are left alone: `python recipes/...` has no launcher, and accelerate's
    one-process launcher keeps its child in its own process group, where a group kill reaches it.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    launcher = os.environ.get(LAUNCHER_PID)
    # The launcher may have died while this rank was importing, before the line above: then
    # this process was handed to another parent and nothing would ever deliver the signal.
    if launcher is not None and os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_trainer() -> None:
    """recipes/evaluate.py started by a training run (eval.harness_tasks): killed when that run ends, however it
    ends, as its ranks die with their launcher; a scoring nobody will read is only a GPU and cores held."""
    trainer = os.environ.get(TRAINER_PID)
    if trainer is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(trainer):  # it ended while this process was starting
        os.kill(os.getpid(), signal.SIGKILL)


def launch_id() -> str:
    """What the ranks of one launch share and no other launch running now does: the address of
    torchrun's store (two live launches cannot hold one port), or this process for a run of one."""
    if "MASTER_PORT" in os.environ:
        return f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ['MASTER_PORT']}"
    return f"{socket.gethostname()}:{os.getpid()}"


@contextlib.contextmanager
def within(seconds: float, what: str, on_expiry: Callable[[str], None]) -> Iterator[None]:
    """Bound a wait in C++ that torch's own timeouts do not bound as a whole.

    Creating a process group waits in several steps, each with its own timeout (the store's
    keys, then gloo's connections to each peer): a relaunch sharing a rendezvous with orphans
    of an earlier one hung 32 minutes in DeepSpeed's `_clone_world_group` -> `new_group` with
    collective_timeout_s=1800. After `seconds`, `on_expiry` gets one line naming `what` and
    where the main thread waits (it is expected to end the process: nothing else can stop a
    thread blocked in C++).
    """
    done = threading.Event()
    caller = threading.current_thread().ident

    def watch() -> None:
        if not done.wait(seconds):
            on_expiry(f"{what}{_where(caller)}")

    threading.Thread(target=watch, daemon=True, name="bounded-wait").start()
    try:
        yield
    finally:
        done.set()


def _where(thread_id: int | None) -> str:
    """' in toolkit/…:N (function)': the innermost recipe or toolkit frame of a thread."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    ours = [f for f in traceback.extract_stack(frame) if _is_ours(f.filename)]
    if not ours:
        return ""
    return f" in {Path(ours[-1].filename).resolve().relative_to(_PACKAGE_ROOT)}:{ours[-1].lineno} ({ours[-1].name})"


def _is_ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return (path.is_relative_to(_PACKAGE_ROOT / "toolkit") and path != Path(__file__).resolve()) or \
        path.is_relative_to(_PACKAGE_ROOT / "recipes")
