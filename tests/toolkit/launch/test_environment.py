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
