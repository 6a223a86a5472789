"""A run folder has one owner at a time: two runs into one folder, a killed owner, the other ranks of a launch."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir
from toolkit.run.lock import LOCK_FILE

CLAIM = """
import os, sys
from pathlib import Path
from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir
run = RunDir(Path(sys.argv[1]))
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):  # both check at the same moment, however long their imports took
    pass
try:
    run.check(None, False, launch=sys.argv[3], main=True)
except UserError as exc:
    print("refused:", exc, flush=True)
    sys.exit(2)
(run.root / "metrics.jsonl").write_text("{}")  # what the run writes first
print("owner", flush=True)
sys.stdin.readline()  # the owner holds the folder until the test lets it go
"""


def claimants(folder: Path, go: Path, n: int = 2) -> list[subprocess.Popen]:
    """n processes that claim `folder` once `go` exists, each after saying it is ready."""
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM, str(folder), str(go), f"launch-{i}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()
    return procs


def test_two_runs_started_at_once_into_one_new_folder_get_one_owner(tmp_path):
    folder = tmp_path / "runs" / "seed"
    procs = claimants(folder, tmp_path / "go")
    lines = [p.stdout.readline().strip() for p in procs]  # the loser exits; the owner waits on stdin
    assert sorted(line.split(":")[0] for line in lines) == ["owner", "refused"], [p.stderr.read() for p in procs]
    results = [(p.communicate("\n", timeout=60)[1], p.returncode) for p in procs]
    assert sorted(code for _, code in results) == [0, 2], results
    refused = next(line for line in lines if line.startswith("refused"))
    assert re.fullmatch(
        rf"refused: output_dir={folder} is in use by another run \(pid \d+ on {re.escape(socket.gethostname())}, "
        r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it or choose another output_dir", refused), refused


def test_a_killed_owner_leaves_no_stale_lock(tmp_path):
    folder = tmp_path / "run"
    owner = claimants(folder, tmp_path / "go", n=1)[0]
    assert owner.stdout.readline().strip() == "owner"
    with pytest.raises(UserError, match="is in use by another run"):
        RunDir(folder).check("auto", False, launch="another", main=True)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=30)
    assert (folder / LOCK_FILE).exists()  # a killed owner leaves its file, but not its lock
    run = RunDir(folder)
    with pytest.raises(UserError, match="already holds a run"):  # now the folder's content speaks
        run.check(None, False, launch="next", main=True)
    run.check(None, True, launch="next", main=True)  # overwrite=true takes it over
    run.release()
    assert not (folder / LOCK_FILE).exists()


def test_the_other_ranks_of_a_launch_follow_its_owner_and_refuse_another(tmp_path):
    folder = tmp_path / "run"
    owner = RunDir(folder)
    owner.check(None, False, launch="host:29500", main=True)
    try:
        RunDir(folder).check(None, False, launch="host:29500", main=False)  # rank 1 of the same launch
        with pytest.raises(UserError, match=r"is in use by another run \(pid \d+ on"):
            RunDir(folder).check(None, False, launch="host:29501", main=False)  # a rank of another launch
        assert RunDir(folder).entries() == ([], [])  # the lock file is neither the run's nor foreign
    finally:
        owner.release()
    assert not folder.exists()  # claimed for a run that wrote nothing: left as it was found
