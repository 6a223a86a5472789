"""tests/support/probe_ranks.py, the harness the strategy probes run on: a rank's exit code and output (stdout and
stderr interleaved as written) come back, a rank that hangs is killed and fails the test, and each rank sees the launcher's variables
and the caller's own."""

from __future__ import annotations

import json

import probe_ranks
import pytest

pytestmark = pytest.mark.distributed

PROBE = """
import json, os, sys, time
import torch.distributed as dist
rank = int(os.environ["RANK"])
if sys.argv[1] == "exit" and rank == 1:
    print("rank 1 starts", flush=True)
    print("rank 1 warns", file=sys.stderr, flush=True)
    print("rank 1 gives up")
    sys.exit(3)
if sys.argv[1] == "hang" and rank == 1:
    time.sleep(600)
dist.init_process_group("gloo")
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "PROBE_RANKS_TEST")
json.dump({k: os.environ.get(k) for k in names} | {"world": dist.get_world_size()}, open(sys.argv[2] + str(rank), "w"))
dist.destroy_process_group()
"""


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def test_each_rank_sees_the_launchers_variables_and_the_callers(probe, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_RANKS_TEST", "set by the caller")
    out = tmp_path / "env"
    proc = probe_ranks.run(probe, ["run", out], nproc=2, accelerate_config="zero2.yaml")
    assert proc.returncode == 0, proc.stdout
    seen = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in (0, 1)]
    assert seen == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true",
                     "PROBE_RANKS_TEST": "set by the caller", "world": 2} for r in (0, 1)]


def test_a_rank_that_fails_gives_its_exit_code_and_output(probe, tmp_path):
    proc = probe_ranks.run(probe, ["exit", tmp_path / "env"], nproc=2)
    assert proc.returncode == 3
    assert "--- rank 1\nrank 1 starts\nrank 1 warns\nrank 1 gives up" in proc.stdout  # stdout and stderr in order


def test_a_rank_that_hangs_is_killed_and_fails_the_test(probe, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="on 2 ranks still running after 2 s"):
        probe_ranks.run(probe, ["hang", tmp_path / "env"], nproc=2, timeout=2)
