"""A rank's duties to its launch: dying with its launcher, naming its launch, bounded group creation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from toolkit.launch.rank_process import launch_id, within

ROOT = Path(__file__).resolve().parents[3]

# a launcher that starts a "rank" in a session of its own, as torchrun does, and waits
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c",
        "from toolkit.launch.rank_process import die_with_launcher; import time; "
        "die_with_launcher(); print('started', flush=True); time.sleep(120)"],
        start_new_session=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "test"})
    print(rank.pid, flush=True)
    rank.wait()
""")


def test_a_rank_in_its_own_session_dies_with_its_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    rank = psutil.Process(int(launcher.stdout.readline()))
    assert launcher.stdout.readline().strip() == "started"
    launcher.kill()  # kill -9: the rank is out of reach of its process group
    launcher.wait(timeout=10)
    gone, alive = psutil.wait_procs([rank], timeout=5)
    for orphan in alive:
        orphan.kill()
    assert not alive, "the rank outlived its launcher"


def test_the_launch_is_named_by_torchruns_store_address(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launch_id() == "node1:29500"
    monkeypatch.delenv("MASTER_PORT")
    assert launch_id().endswith(f":{os.getpid()}")


def test_a_wait_past_its_bound_is_ended_naming_where_it_waits():
    said: list[str] = []
    with within(0.2, "creating a process group", said.append):
        time.sleep(1.0)  # a wait inside C++ looks the same from the watcher
    assert said == ["creating a process group"]  # where: a recipe or toolkit line, none in a test
    with within(5, "a quick one", said.append):
        pass
    time.sleep(0.1)
    assert len(said) == 1


def test_groups_created_later_get_the_collective_timeout(tmp_path):
    """DeepSpeed's _clone_world_group and FSDP's device mesh call torch.distributed.new_group
    without a timeout: they get train.collective_timeout_s, and their creation is bounded."""
    code = textwrap.dedent(f"""
        import datetime, torch, torch.distributed as dist
        from toolkit.strategy.collectives import set_collective_timeout
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, world_size=1)
        set_collective_timeout(7)
        group = dist.new_group([0])
        from torch.distributed import device_mesh
        print(dist.new_group.bounded and device_mesh.new_group.bounded,
              group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["True", "7.0"], done.stderr[-3000:]


@pytest.mark.parametrize("seconds", [2])
def test_a_group_that_never_forms_ends_the_rank_with_exit_code_4(tmp_path, seconds):
    """Rank 0 of 2 creates the launch's group; rank 1 never comes. torch's store wait would end it
    too; here the store waits longer than the bound, as a wait for an orphan's listener did."""
    code = textwrap.dedent(f"""
        import datetime, os, torch.distributed as dist
        import toolkit.strategy.collectives as d
        d.set_collective_timeout({seconds})
        os.environ["RANK"] = "0"
        with d.creating_groups("creating the launch's process group"):
            dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store')!r}, 2), rank=0, world_size=2,
                                    timeout=datetime.timedelta(seconds=120))
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 4, done.stderr[-3000:]
    assert time.monotonic() - start < 60
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: [rank 0] waited {seconds} s (train.collective_timeout_s) creating the launch's process group for "
        "ranks that never joined: a rank is stuck elsewhere or died, or an earlier launch's ranks share the "
        "rendezvous; see the other ranks' errors"
    )
