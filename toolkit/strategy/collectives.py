"""How long a collective may wait, and what its failure says.

Every collective and every process group's creation is bounded by train.collective_timeout_s, so
that ranks that fell out of step stop with one line per rank (exit code 4, toolkit.training.entry)
instead of sleeping; `collective_failure` writes that line from the error torch or DeepSpeed raised.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from toolkit.launch.rank_process import within

_COLLECTIVE_TIMEOUT_S: int | None = None


def set_collective_timeout(seconds: int) -> timedelta:
    """How long any collective may wait before it fails, for the default group and all later ones.

    The launch's process group gets it through Accelerate; groups that DeepSpeed and FSDP create
    later with `new_group` take torch's per-backend default instead (30 min for gloo, 10 for
    NCCL), read from module globals of distributed_c10d: those are set here too. A run whose
    ranks fall out of step then stops with an error (see toolkit.training.entry) rather than sleeping.
    """
    import torch.distributed.distributed_c10d as c10d

    global _COLLECTIVE_TIMEOUT_S
    _COLLECTIVE_TIMEOUT_S = seconds
    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    # Each step of a group's creation has its own timeout; the whole is bounded here too (see
    # rank_process.within), in each module callers find new_group in: DeepSpeed's comm looks it up
    # in torch.distributed, FSDP2's device mesh imported it into its own module.
    import torch.distributed.device_mesh as device_mesh

    for module in (torch.distributed, c10d, device_mesh):
        if hasattr(module, "new_group") and not hasattr(module.new_group, "bounded"):
            module.new_group = _bounded_new_group(module.new_group)
    return timeout


def _bounded_new_group(new_group: Callable) -> Callable:
    @functools.wraps(new_group)
    def bounded(*args, **kwargs):
        with creating_groups("creating a process group (new_group)"):
            return new_group(*args, **kwargs)

    bounded.bounded = True
    return bounded


def creating_groups(what: str):
    """A process group's creation, ended with the collective-timeout line and exit code 4 once it
    waits past train.collective_timeout_s (with a little room, so that torch's own timeout, where
    it fires, is the one reported)."""
    seconds = _COLLECTIVE_TIMEOUT_S or 1800
    return within(seconds * 1.05 + 5, what, _group_never_formed)


def _group_never_formed(what: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    print(
        f"error: [rank {rank}] waited {_COLLECTIVE_TIMEOUT_S} s (train.collective_timeout_s) {what} for ranks "
        "that never joined: a rank is stuck elsewhere or died, or an earlier launch's ranks share the rendezvous; "
        "see the other ranks' errors",
        file=sys.stderr, flush=True,
    )
    os._exit(4)  # the main thread is blocked in C++: only ending the process stops it


def collective_failure(exc: BaseException, step: int | None = None) -> str | None:
    """One line for an error raised inside a collective (timed out, or a peer gone); None for any other error.

    Names this rank, the collective, where the recipe was (innermost frame in recipes/ or
    toolkit/) and the step, so that a run whose ranks fell out of step says what it waited for.
    """
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = _TIMED_OUT.search(detail) is not None
    peer_lost = _PEER_LOST.search(detail) is not None
    # judged by what the error says, not by where it was raised: a bug inside FSDP or DDP code
    # must keep its traceback
    if not (timed_out or peer_lost or isinstance(exc, torch.distributed.DistError)):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    comm = [f for f in frames if _COMM_FILES.search(f.filename.replace(os.sep, "/"))]
    ops = [f.name for f in comm if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    ddp = [f.name for f in comm if f.filename.endswith("parallel/distributed.py")]
    op = ops[-1] if ops else f"DDP's {ddp[-1].strip('_')}" if ddp else "a collective"
    ours = [f for f in frames if _is_ours(f.filename)]
    where = f" in {_relative(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})" if ours else ""
    at_step = f" after step {step}" if step is not None else ""
    rank = int(os.environ.get("RANK", "0"))
    if timed_out:
        limit = f" {_COLLECTIVE_TIMEOUT_S} s (train.collective_timeout_s)" if _COLLECTIVE_TIMEOUT_S else ""
        what = (
            f"waited{limit} in {op}{where}{at_step} for ranks that never joined: the ranks fell out of step "
            "(one skipped this collective or is stuck elsewhere); see the other ranks' errors"
        )
    elif peer_lost:
        what = f"{op}{where}{at_step} failed because another rank stopped or lost its connection; see that rank's error"
    else:
        what = f"{op}{where}{at_step} failed in the communication backend"
    return f"[rank {rank}] {what} ({_short(detail)})"


def _is_ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_relative_to(_PACKAGE_ROOT / "toolkit") or path.is_relative_to(_PACKAGE_ROOT / "recipes")


def _relative(filename: str) -> str:
    return str(Path(filename).resolve().relative_to(_PACKAGE_ROOT))


def _short(detail: str) -> str:
    detail = re.sub(r"^\[[^\]]*\]\s*", "", detail)  # gloo's "[/path/to/pair.cc:553]" prefix
    return detail if len(detail) <= 160 else detail[:157] + "..."


_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Where collectives are entered (torch's c10d, DDP, DeepSpeed's comm) and what their failures say
# (gloo: "Timed out waiting 20000ms for recv operation", "Connection closed by peer"; NCCL's
# watchdog: "Watchdog caught collective operation timeout").
_COMM_FILES = re.compile(r"torch/distributed/|torch/nn/parallel/distributed\.py|deepspeed/comm/")
_TIMED_OUT = re.compile(r"[Tt]imed out|operation timeout|Timeout")
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|[Bb]roken pipe")
