"""What a failed collective looks like to the user (toolkit.strategy.collectives; the launched fault is in
tests/recipes/test_collective_timeout.py)."""

from __future__ import annotations

import torch

from toolkit.strategy.collectives import collective_failure, set_collective_timeout


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def _raised_from(call) -> BaseException:
    try:
        call()
    except BaseException as caught:
        return caught
    raise AssertionError("did not raise")


def test_a_timed_out_collective_names_the_rank_the_wait_and_the_step(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # restored after the test
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    monkeypatch.setenv("RANK", "1")
    set_collective_timeout(20)
    exc = _raised(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"))
    line = collective_failure(exc, step=2)
    assert line.startswith("[rank 1] waited 20 s (train.collective_timeout_s)")
    assert "after step 2" in line and "the ranks fell out of step" in line
    assert line.endswith("(Timed out waiting 20000ms for recv operation to complete)")  # gloo's path prefix dropped
    assert c10d.default_pg_timeout.total_seconds() == 20  # also for groups created later


def test_a_lost_peer_is_not_called_a_timeout():
    exc = _raised(torch.distributed.DistNetworkError("Connection closed by peer [127.0.0.1]:2432"))
    line = collective_failure(exc, step=5)
    assert "another rank stopped or lost its connection" in line and "waited" not in line


def test_an_ordinary_error_is_left_alone():
    assert collective_failure(_raised(RuntimeError("mat1 and mat2 shapes cannot be multiplied")), step=1) is None
    # raised inside FSDP's code (the frame's file is FSDP's), but a bug, not a wait: it keeps its traceback
    import torch.distributed.fsdp as fsdp

    bug = compile("raise RuntimeError('Trying to resize storage that is not resizable')", fsdp.__file__, "exec")
    assert collective_failure(_raised_from(lambda: exec(bug)), step=1) is None
    assert collective_failure(_raised(ValueError("bad value")), step=1) is None


# ---------------------------------------------------------------- one process: what Strategy says
