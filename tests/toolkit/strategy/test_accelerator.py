"""The Accelerator for the launched strategy (toolkit.strategy.accelerator): what it does with the process's
memory, FSDP2's reduction precision, and a DeepSpeed JSON read before Accelerate sees it."""

from __future__ import annotations

FAULTS_PROBE = """
import ctypes, resource, torch
from toolkit.strategy.accelerator import keep_freed_memory

def faults():
    seen = []
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        xs = [torch.ones(4 << 20) for _ in range(3)]  # 3 x 16 MB, like a micro-batch's logits and grads
        del xs
        seen.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(seen[5:])

# the control first: glibc told to map every block afresh and give it back on free
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-3, 1 << 20) and libc.mallopt(-1, 0)  # M_MMAP_THRESHOLD 1 MB, M_TRIM_THRESHOLD 0
control = faults()
assert keep_freed_memory()
kept_faults = faults()

# then what the trainer does before it evaluates: 512 MB freed from the heap stays resident under the run's
# settings, and release_freed_memory gives it back, though small tensors allocated between stay
from toolkit.strategy.accelerator import release_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
assert not release_freed_memory(torch.device("meta"))  # not a CPU: nothing done
start = rss()
xs = [torch.ones(2 << 20) for _ in range(64)]  # 64 x 8 MB, as a step's temporaries
pins = [torch.ones(64) for _ in range(64)]
del xs
kept = rss()
assert release_freed_memory(torch.device("cpu"))
print(control, kept_faults, start, kept, rss())
"""


def test_cpu_runs_keep_freed_memory_instead_of_faulting_it_back_in():
    """Three 16 MB tensors allocated and freed 20 times. When glibc gives freed memory back to the
    OS (what its defaults do, depending on the heap's history), each allocation faults its pages in
    again; after keep_freed_memory() the same memory is reused, not faulted in again at every step.
    Both in one process (one import of the toolkit): the control's settings first, then the toolkit's; then
    release_freed_memory, which hands what was kept back to the OS before each evaluation."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAULTS_PROBE], capture_output=True, text=True)  # one import
    assert done.returncode == 0 and done.stdout.split(), (done.returncode, done.stderr[-3000:])
    faults = dict(zip(("control", "keep"), map(int, done.stdout.split()[-5:-3]), strict=True))
    assert faults["control"] > 15 * 3 * 4000 // 512, faults  # the probe sees faults (4k pages; 2 MB ones under THP)
    # kept: at most one step's pages over the 15 measured steps, where the control faults them all in every step.
    # Usually 0; once in a whole suite 4096 (one 16 MB tensor's pages, faulted in once: r15), so not `< 100`
    assert faults["keep"] <= faults["control"] // 15, faults
    # Issue 42 point 12: what is kept for the next step was kept after the last one too, and the evaluation, merge
    # and saves after training came on top (5.50 GB against the steps' 5.29 for the README's SmolLM2 LoRA)
    start, kept, released = map(int, done.stdout.split()[-3:])
    assert kept - start > 400e6, (start, kept)  # kept: the run's setting is in force
    assert released - start < 100e6, (start, kept, released)  # and given back before an evaluation


def test_the_trainer_releases_freed_memory_before_it_evaluates():
    """The one place that calls it: Trainer.evaluate, with the run's device (a GPU run: nothing done)."""
    import inspect

    from toolkit.training.trainer import Trainer

    assert "release_freed_memory(self.accelerator.device)" in inspect.getsource(Trainer.evaluate)
