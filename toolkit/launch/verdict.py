"""One error line per launch, and the exit code that goes with it.

A recipe's ranks usually meet the same bad input at once, and torchrun kills every rank as soon as
one exits with an error; some errors only one rank meets. `report_once` makes the launch say one
`error:` line either way, `reported_verdict` lets a rank whose collective failed because a peer
exited end with that peer's code, silently, and `exit_process` ends a rank without the teardown
that deadlocks on CPU. The codes: toolkit.training.entry.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from datetime import timedelta

import torch

from toolkit.launch.environment import has_gpu

ERROR_GRACE_S = 15.0  # how long ranks other than 0 let rank 0 report a shared error first: rank 0 can lag
# that much behind in importing on a loaded 2-core machine (seen at 5 s: rank 1 reported a config error every rank met)


def report_once(line: str, code: int) -> None:
    """Print a recipe's one-line error once per launch, on stderr; `code` is the exit code it goes with.

    Every rank normally hits the same bad input at the same place, and the launcher (torchrun's
    agent) kills all ranks as soon as one exits with an error: had rank 1 exited first, rank 0
    could be killed before printing anything. So rank 0 reports at once and the other ranks give
    it a few seconds first; one that then finds no report met an error of its own (a file
    missing on one node only) and reports it with its rank.

    Under torchrun the report is also recorded in the launch's store (held by torchrun's agent,
    so it outlives the rank): the first rank to record it prints, the others stay quiet, and
    ranks whose collectives fail because the reporting rank exited stay quiet too
    (`reported_verdict`). Some errors are met by one rank only: rank 0 reads and packs the data
    while the others wait in a barrier, which fails with "Connection reset by peer" once rank 0
    exits. Without a store (a launch by other means) the other ranks wait, then print.
    """
    rank = int(os.environ.get("RANK", "0"))
    if _first_to_report(code, rank):
        print(line if rank == 0 else f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def reported_verdict() -> int | None:
    """The exit code another rank reported with `report_once` in this launch, or None.

    A rank whose collective failed because its peer exited after a user error ends with that
    code and says nothing: the peer's line is the run's one line.
    """
    store = _launch_store()
    try:
        if store is None or not store.check([_verdict_key()]):
            return None
        code, rank = store.get(_verdict_key()).decode().split()
    except RuntimeError:  # the store went away with the launch: nothing known
        return None
    return int(code) if int(rank) != int(os.environ.get("RANK", "0")) else None


def _first_to_report(code: int, rank: int) -> bool:
    """Whether this rank's report is the launch's one (rank 0's, unless it has none within the grace)."""
    store = _launch_store()
    if store is not None:
        try:
            if rank != 0:
                deadline = time.monotonic() + ERROR_GRACE_S
                while time.monotonic() < deadline and not store.check([_verdict_key()]):
                    time.sleep(0.1)
            mine = f"{code} {rank}"
            # compare_set with "" sets the key only where it is absent: exactly one rank reports
            return store.compare_set(_verdict_key(), "", mine).decode() == mine
        except RuntimeError:  # the store went away with the launch: report as without one
            pass
    if rank != 0:
        time.sleep(ERROR_GRACE_S)
    return True


@functools.cache
def _launch_store():
    """torchrun's key-value store, where the ranks of a launch agree on its one error line; None elsewhere.

    torchrun's agent holds it (TORCHELASTIC_USE_AGENT_STORE) for the whole launch, and it exists
    before any process group, so ranks reach it in config errors and after a peer has exited.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=10)
        )
    except (RuntimeError, KeyError, ValueError):  # agent gone or variables missing: report as without a store
        return None


def _verdict_key() -> str:
    # per restart: a launch with --max_restarts starts its ranks again against the same store
    return f"llm_toolkit/verdict/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def exit_process(code: int) -> None:
    """End the process with `code` once everything is written and closed.

    On CPU (gloo), torch tears the process group down during interpreter finalization, where
    it can deadlock or abort: the DDP Reducer / DeepSpeed engine still holds the gloo group, and
    its destructor joins a worker thread that needs the GIL the exiting main thread holds
    (py-spy: `~ProcessGroupGloo` -> `std::thread::join` vs `AsyncAllgatherWork` waiting for the
    GIL), or destroys it while joinable ("terminate called without an active exception",
    SIGABRT). Seen in ~3 of 100 CPU launches, always after all work was done. So a multi-process
    CPU run leaves without running destructors; everything else exits normally.

    The same deadlock happens earlier if the prepared model is freed when the function holding
    it returns (py-spy: `~Reducer` -> `~ProcessGroupGloo` waiting on the mutex that the gloo
    worker holds while `~AsyncAllgatherWork` waits for the GIL), so `prepare` keeps every
    prepared object alive until this call.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if not has_gpu() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)
