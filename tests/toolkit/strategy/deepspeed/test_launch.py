"""DeepSpeed's launch (toolkit.strategy.deepspeed.launch): its JSON read first, its CPU device count asked once."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize(("text", "says"), [
    ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage=4; DeepSpeed ZeRO stages are 0, 1, 2 or 3"),
    ('{\n  "train_batch_size": "auto",\n  oops\n}', "line 3, column 3"),
])
def test_a_deepspeed_json_that_cannot_work_is_one_line(monkeypatch, tmp_path, text, says):
    """What a launch under such an accelerate config reads first (tests/recipes/test_strategy_errors.py
    launches one, whose micro-batch contradicts the recipe's)."""
    from toolkit.config.errors import UserError
    from toolkit.strategy.deepspeed.launch import check_deepspeed_config

    (tmp_path / "ds.json").write_text(text)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    with pytest.raises(UserError) as raised:
        check_deepspeed_config()
    assert says in str(raised.value)


def test_deepspeeds_cpu_device_count_is_asked_once(monkeypatch):
    """DeepSpeed's CPU accelerator ran `numactl --hardware` each time its device count was asked (~36 times a
    step, each a fork of the rank); the count is now kept in LOCAL_SIZE, the same number, and asked no more."""
    import subprocess

    from deepspeed.accelerator import get_accelerator

    from toolkit.strategy.deepspeed.launch import count_cpu_devices_once

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    forks = []
    real = subprocess.check_output
    monkeypatch.setattr(subprocess, "check_output", lambda *a, **k: forks.append(a) or real(*a, **k))
    expected = get_accelerator().device_count()
    assert len(forks) == 1  # what DeepSpeed does on its own, each time
    count_cpu_devices_once()
    assert os.environ["LOCAL_SIZE"] == str(expected)
    for _ in range(36):
        assert get_accelerator().device_count() == expected
    assert len(forks) == 2  # the one count_cpu_devices_once asked for
