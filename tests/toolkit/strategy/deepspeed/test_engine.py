"""A dropped DeepSpeed update: a real engine (ZeRO-1/2/3, one process with the variables accelerate launch gives it)
stepped through toolkit.strategy.deepspeed.engine by tests/support/deepspeed_step_probe.py.

A step whose loss the caller reports non-finite, and one with NaN gradients, leave the fp32 master
weights and Adam's moments exactly as they were, while DeepSpeed counts the step (global_steps,
what a resume restores) and its skip (skipped_steps); the next good step trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import probe_ranks
import pytest

pytestmark = pytest.mark.distributed

PROBE = probe_ranks.SUPPORT / "deepspeed_step_probe.py"


def launch(strategy: str, out: Path) -> dict:
    proc = probe_ranks.run(PROBE, [out], nproc=1, accelerate_config=f"{strategy}.yaml", timeout=600)
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"{PROBE.name} under {strategy} exited {proc.returncode}\n{proc.stdout[-8000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_dropped_update_leaves_weights_and_adam_untouched_and_is_counted(strategy, tmp_path):
    result = launch(strategy, tmp_path / "probe.json")
    assert result["strategy"] == f"DeepSpeed ZeRO-{strategy[-1]}"
    good, loss, grad, again = result["steps"]
    assert [s["found"] for s in result["steps"]] == [None, "loss", "grad", None]
    for skipped in (loss, grad):
        assert skipped["weights"] == good["weights"]
        assert skipped["exp_avg"] == good["exp_avg"]
    assert again["weights"] != good["weights"] and again["exp_avg"] != good["exp_avg"]
    assert [(s["global_steps"], s["skipped_steps"]) for s in result["steps"]] == [(1, 0), (2, 1), (3, 2), (4, 2)]
    assert all(s["step_restored"] for s in result["steps"])  # the torch optimizer's own step is back
