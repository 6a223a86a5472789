"""A stop signal: a flag the loop checks once per step while training, the end of the process before it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

from toolkit.launch.verdict import reported_verdict


class StopRequest:
    """SIGTERM, SIGUSR1 (cluster preemption, `scancel`, a time limit) and SIGINT (Ctrl-C) stop the run.

    In training the handler only sets a flag; the loop checks it once per optimizer step, agreed
    across ranks (a rank that saw no signal must still stop with the others), saves a checkpoint
    and exits 3, so `resume=auto` continues where the run was stopped. Before training starts
    (data, model load, the launch's process group) there is nothing to save: the process ends at
    once, one line, exit code 128 + the signal. A second Ctrl-C ends it at once wherever it is.

    "At once" must hold while the main thread waits inside C++ (a rendezvous, a collective, a
    tokenizer), where Python runs no handler until the call returns (measured: a SIGTERM to a
    rank in a TCPStore wait ran its handler when the wait timed out). So a thread reads the
    signal numbers from the wakeup fd, which the C-level handler writes as the signal arrives,
    and ends the process from there; `release` (the run folder's lock) runs first.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    _watched: StopRequest | None = None  # the newest one; one watcher thread per process
    # the main thread (all_saved) and the watcher can both reach the end for one signal: its line was printed twice
    _ending = threading.Lock()

    def __init__(self, name: str = "run", main: bool = True, release: Callable[[], None] = lambda: None,
                 signals: tuple[int, ...] = SIGNALS):
        self.name, self.main, self.release = name, main, release
        self.signal: int | None = None
        self.training = False  # set by fit: from then on a signal stops at the end of a step
        self.step: Callable[[], int] = lambda: 0
        self.interrupts = 0
        self.saved = False  # set by all_saved: training is over and what it made is written; only samples are left
        for sig in signals:
            signal.signal(sig, self._handle)
        if threading.current_thread() is threading.main_thread():
            if StopRequest._watched is None:
                read, write = os.pipe()
                os.set_blocking(write, False)
                signal.set_wakeup_fd(write, warn_on_full_buffer=False)
                threading.Thread(target=StopRequest._watch, args=(read,), daemon=True, name="stop-signals").start()
                os.register_at_fork(after_in_child=StopRequest._not_in_a_fork)
            StopRequest._watched = self

    @staticmethod
    def _not_in_a_fork() -> None:
        """A process forked from the run (datasets' tokenizing pool, num_proc) is a worker, not the run: its
        signals are the default ones again. It inherited the handler that only sets a flag, and the wakeup fd
        of the run's watcher: a pool's terminate() (SIGTERM, after a worker's error) left its idle workers
        waiting for ever, and the pool's exit with them (the hang of a tokenizing map that failed)."""
        with contextlib.suppress(ValueError):  # forked from another thread than the main one: nothing was set there
            signal.set_wakeup_fd(-1)
            for sig in StopRequest.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        StopRequest._watched = None

    def _handle(self, signum, frame) -> None:
        self.signal = signum  # before training, the watcher has ended the process already

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @staticmethod
    def _watch(fd: int) -> None:
        while True:
            for signum in os.read(fd, 64):
                stop = StopRequest._watched
                if stop is not None and signum in StopRequest.SIGNALS:
                    stop._now_or_later(signum)

    def all_saved(self) -> None:
        """Training is over and final/ (and the adapter, the metrics) are written: a signal from now on ends the
        process at once, skipping the samples, and one that came during the final save ends it here. It was taken as
        a flag no one read any more: Ctrl-C during minutes of samples did nothing, and the run exited 0."""
        self.saved = True
        if self.signal is not None:
            self._end(self._after_saving(self.signal), 128 + self.signal)

    def _after_saving(self, signum: int) -> str:
        return (f"stopped by {signal.Signals(signum).name} after training: final/ and the run are saved; the samples "
                "(and eval.harness_tasks' scores) are skipped")

    def _now_or_later(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.saved:
            self._end(self._after_saving(signum), 128 + signum)
        if not self.training and signum == signal.SIGTERM and (code := reported_verdict()) is not None:
            # torchrun's agent ends the ranks once one exits; a peer's user error was the cause, and its
            # line is the launch's one line: end with its code, silently, as the rank would on its own
            self._end(None, code)
        if not self.training:
            self._end(f"stopped by {name} before training started; nothing was trained, so nothing is saved", 128 + signum)
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._end(f"stopped at once by a second Ctrl-C at step {self.step()}, without saving it; "
                          "continue with resume=auto (from the newest checkpoint)", 128 + signum)

    def _end(self, line: str | None, code: int) -> None:
        if not StopRequest._ending.acquire(blocking=False):
            threading.Event().wait()  # the other thread is ending the process
        if self.main and line is not None:
            print(f"\n[{self.name}] {line}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # ending is what matters; the lock goes with the process anyway
            self.release()
        with contextlib.suppress(Exception):  # os._exit runs no pool's cleanup: datasets' tokenizing workers (num_proc)
            import psutil  # were left behind, asleep for ever, ~370 MB each, by a stop while the data was prepared

            for child in psutil.Process().children(recursive=True):
                child.kill()
        sys.stdout.flush()
        os._exit(code)
