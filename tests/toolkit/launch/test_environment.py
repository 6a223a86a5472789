"""What a rank knows from its launcher (toolkit.launch.environment)."""

from __future__ import annotations

import pytest

from toolkit.launch.environment import is_launch_main, launched_kind


@pytest.mark.parametrize("rank, main", [(None, True), ("0", True), ("1", False), ("3", False)])
def test_is_launch_main_follows_the_launchers_rank(monkeypatch, rank, main):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert is_launch_main() is main


@pytest.mark.parametrize(("deepspeed", "fsdp", "strategy"), [(None, None, "ddp"), ("true", None, "deepspeed"),
                                                             (None, "true", "fsdp"), ("false", "false", "ddp")])
def test_the_launched_kind_is_read_from_accelerates_variables(monkeypatch, deepspeed, fsdp, strategy):
    for name, value in (("ACCELERATE_USE_DEEPSPEED", deepspeed), ("ACCELERATE_USE_FSDP", fsdp)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert launched_kind() == strategy


@pytest.mark.parametrize("local, world, gpus, line", [
    (8, 8, 2, "8 processes on a machine with 2 GPUs: one GPU a process; use --num_processes 2"),
    (8, 16, 4, "8 processes on a machine with 4 GPUs: one GPU a process; use --num_processes 8"),
    (2, 2, 2, None),
    (8, 8, 0, None),  # no GPU: the ranks share the CPU (recipes/launch.sh warns of more ranks than cores)
])
def test_a_rank_launched_beside_more_ranks_than_gpus_says_so_in_one_line(monkeypatch, local, world, gpus, line):
    import torch

    from toolkit.launch.environment import gpu_short

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert gpu_short() == line
