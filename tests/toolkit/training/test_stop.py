"""A stop signal (toolkit.training.stop), in a child process that plays a rank: before training it ends the
process at once, even inside a C++ wait; in training it sets the flag, and a second Ctrl-C ends it at once."""

from __future__ import annotations

import signal

import pytest

STOPPING = """
import datetime, sys, time
import torch.distributed as dist
from toolkit.training.stop import StopRequest
stop = StopRequest("unit", main=True, release=lambda: print("released", flush=True))
stop.training = sys.argv[1] == "training"
stop.step = lambda: 7
print("ready", flush=True)
if stop.training:
    while True:
        time.sleep(0.05)
        if stop.requested:
            print("flag", flush=True)
            break
    time.sleep(60)  # a checkpoint being saved, until the second Ctrl-C (not stdin: its EOF would end the child)
else:  # a rank waiting in C++ (a rendezvous): Python runs no handler until the wait ends
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    store.get("a key no one sets")
"""


@pytest.mark.parametrize("phase", ["starting", "training"])
def test_ctrl_c_before_training_ends_at_once_and_a_second_one_in_training(phase):
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", STOPPING, phase], cwd=root, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    if phase == "training":
        assert child.stdout.readline().strip() == "flag"  # the first one: stop at the end of the step
        child.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, err = child.communicate(timeout=30)
    assert time.monotonic() - start < 10  # not the store's 60 s
    assert child.returncode == 128 + signal.SIGINT
    assert "released" in out  # the run folder's lock
    expected = ("[unit] stopped by SIGINT before training started; nothing was trained, so nothing is saved"
                if phase == "starting" else "[unit] stopped at once by a second Ctrl-C at step 7, without saving "
                "it; continue with resume=auto (from the newest checkpoint)")
    assert err.strip() == expected, err


def test_the_launchers_sigterm_after_a_peers_user_error_ends_a_rank_with_that_error_s_code():
    """torchrun's agent SIGTERMs the other ranks once one exits: when rank 0 exited 2 on bad input,
    rank 1 (still waiting for rank 0's data) ends with code 2 too, silently, not 143: the ranks agree,
    whichever of the broken barrier and the agent's SIGTERM reaches rank 1 first."""
    import datetime
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))  # port 0: the kernel's pick
    port = agent.port
    agent.set("llm_toolkit/verdict/0", "2 0")  # rank 0's report_once: code 2
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", STOPPING, "starting"], cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 2, err
    assert "released" in out and err == ""


AFTER = """
import sys, time
from toolkit.training.stop import StopRequest
stop = StopRequest("unit", main=True)
stop.training = True
print("ready", flush=True)
if sys.argv[1] == "saving":  # the signal comes during the final save, which goes on
    while not stop.requested:
        time.sleep(0.05)
    print("saved", flush=True)
stop.all_saved()
print("sampling", flush=True)
time.sleep(60)  # minutes of samples
"""


@pytest.mark.parametrize("when", ["saving", "sampling"])
def test_ctrl_c_after_training_ends_once_all_is_saved_skipping_the_samples(when):
    """A Ctrl-C after the last step (the final save, then samples) was a flag no one read: the samples went on for
    minutes and the run exited 0 (issue 44's probe). During the save it lets the save finish; after it, it ends at
    once."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", AFTER, when], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    if when == "sampling":
        assert child.stdout.readline().strip() == "sampling"
    child.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, err = child.communicate(timeout=30)
    assert time.monotonic() - start < 10
    assert child.returncode == 128 + signal.SIGINT
    assert out.split() == (["saved"] if when == "saving" else [])  # the save finished; no sample began after
    assert err.strip() == ("[unit] stopped by SIGINT after training: final/ and the run are saved; the samples "
                           "(and eval.harness_tasks' scores) are skipped"), err


WORKERS = """
import os, time
import datasets
from toolkit.training.stop import StopRequest
stop = StopRequest("unit", main=True)
datasets.disable_progress_bars()

def tokenize(batch):  # a worker says it is there, then works for a minute
    print(os.getpid(), flush=True)
    time.sleep(60)
    return batch

datasets.Dataset.from_dict({"text": ["a", "b"]}).map(tokenize, batched=True, batch_size=1, num_proc=2)
"""


def test_a_stop_before_training_takes_the_tokenizing_workers_with_it():
    """SIGTERM (or a Ctrl-C sent to the main process alone) while datasets tokenized with num_proc=2 ended the recipe
    and left its pool's processes asleep for ever, ~370 MB each (issue 44's probe)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", WORKERS], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    assert child.stdout.readline().strip().isdigit()  # a worker is tokenizing
    deadline = time.monotonic() + 10
    while len(descendants := psutil.Process(child.pid).children(recursive=True)) < 3:  # 2 workers, the pool's helper
        assert time.monotonic() < deadline, descendants
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM  # not communicate(): a worker left holds its pipes
    deadline = time.monotonic() + 5

    def left() -> list[psutil.Process]:
        return [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    try:
        while left():
            assert time.monotonic() < deadline, f"left behind: {[p.pid for p in left()]}"
            time.sleep(0.05)
    finally:
        for process in left():  # a failed test leaves nothing behind either
            process.kill()


FORKED_WORKER = """
import multiprocessing, signal, time
from toolkit.training.stop import StopRequest
stop = StopRequest("unit", main=True)
stop.training = True  # a run's process, its handler only setting a flag
held = multiprocessing.get_context("fork").Semaphore(0)
# a pool's idle worker waiting on its queue's lock, which the pool's terminate() holds and ends it by SIGTERM
worker = multiprocessing.get_context("fork").Process(target=held.acquire)
worker.start()
time.sleep(0.5)
worker.terminate()
worker.join(10)
print(worker.exitcode, stop.signal, flush=True)
"""


def test_a_process_forked_from_the_run_ends_on_sigterm_as_any_process():
    """The run's handler only sets a flag, and its watcher reads the wakeup fd: a forked worker inherited both, so a
    tokenizing pool's terminate() (after a worker's error: a full disk) could not end a worker waiting on the pool's
    lock, and the map hung for ever (seen in tests/toolkit/run/test_writes.py). Forked, it takes the default signals back,
    and the run does not take its signal for its own."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", FORKED_WORKER], cwd=root, capture_output=True, text=True, timeout=30)
    assert done.stdout.split() == [str(-signal.SIGTERM), "None"], (done.stdout, done.stderr[-2000:])
