"""What each phase of a run cost, and the bar of each pass over batches or prompts.

    with trainer.phases("reference pass", total=forwards) as bar:  # timed; a pass gets its bar
        ...; bar.update()

PHASES is the one list: a phase not in it is refused, a pass (True) must be given its `total` and nothing else gets a
bar. The seconds are each phase's own: a phase opened inside another (an evaluation inside training) pauses the
outer one, so that the parts add up to the whole. They are this process's: a resumed run reports its own.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

# In the order a run goes through them (the end summary's order). True: a pass over batches or prompts, which can take
# minutes, shown with a bar; False: one call, or a library that draws its own bars (datasets' maps, lm-eval's).
PHASES = {
    "base load": False,  # a fine-tune's base model read
    "data": False,  # read, tokenized, packed (datasets draws its maps' bars)
    "model build": False,  # pretraining's model, initialised
    "samples before": True,  # a fine-tune's base generating for each prompt
    "model setup": False,  # the adapter, the compile, the strategy's wrap, a resume's load (assemble)
    "reference pass": True,  # DPO's reference log-probabilities
    "evaluation before": True,  # the base's held-out loss (and the forgetting budget's general set)
    "training": True,  # the steps, less what is timed inside them (the phases below)
    "evaluations during training": True,  # every eval.every steps, summed
    "evaluation after": True,
    "checkpoints": False,
    "final save": False,  # final/ or adapter/
    "merge and reload": False,  # the adapter merged into the base; the result loaded as a user loads it
    "harness": False,  # eval.harness_tasks scored at the end (lm-eval draws its own bars)
    "samples after": True,
}

# Trainer.evaluate's phase of each evaluation, by its own phase name
EVALUATIONS = {"before": "evaluation before", "train": "evaluations during training", "after": "evaluation after"}


def bar(phase: str, total: int, main: bool, **more) -> tqdm:
    """A pass's bar, drawn as the training bar is: on the main process only, to stderr whether or not it is a terminal.
    On the line the training bar is on (position 0): a bar of its own below it would move the cursor with escape codes,
    which a log file keeps as garbage. In a terminal it is gone at its end (`more` may say leave=True); in a file
    (SLURM, `> log`), where its updates are "\r" with no end of line, its line is ended with its last count and time,
    so that what is printed next starts a line of its own (not glued after the bar's "\r", where grep misses it)."""
    return tqdm(total=total, desc=phase, disable=not main, **{"leave": not sys.stderr.isatty(), "position": 0, **more})


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour."""
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Phases:
    """The wall seconds of each phase this process went through (`seconds`, PHASES' names) since it was made."""

    def __init__(self, main: bool, now: Callable[[], float] = time.perf_counter):
        self.main, self.now = main, now
        self.started = now()
        self.seconds: dict[str, float] = {}
        self.open: list[str] = []  # the phases entered and not left, innermost last
        self.since = self.started  # when the innermost one's clock last started

    @contextlib.contextmanager
    def __call__(self, phase: str, total: int | None = None, **more) -> Iterator[tqdm | None]:
        """Time `phase`; a pass's bar over its `total` steps (`more`: tqdm's arguments) is yielded, and closed at the
        end; any other phase yields None."""
        if phase not in PHASES:
            raise ValueError(f"{phase!r} is not a phase; add it to toolkit.training.phases.PHASES")
        if PHASES[phase] != (total is not None):
            raise ValueError(f"{phase!r} is {'a pass: give its total' if PHASES[phase] else 'no pass: give no total'}"
                             " (toolkit.training.phases.PHASES)")
        self._charge()  # the outer phase's clock stops while this one runs
        self.open.append(phase)
        self.seconds.setdefault(phase, 0.0)
        shown = bar(phase, total, self.main, **more) if total is not None else None
        try:
            yield shown
        finally:
            if shown is not None:
                shown.close()
            self._charge()
            self.open.pop()

    def _charge(self) -> None:
        now = self.now()
        if self.open:
            self.seconds[self.open[-1]] += now - self.since
        self.since = now

    def total(self) -> float:
        return self.now() - self.started

    def row(self) -> dict:
        """metrics.jsonl's `phases` columns: each phase's seconds, in PHASES' order, and the whole since the start."""
        return {"seconds": {p: round(self.seconds[p], 1) for p in PHASES if p in self.seconds},
                "total_seconds": round(self.total(), 1)}

    def said(self) -> str:
        """The end summary's line: the whole, then each phase that ran, in PHASES' order, and what none of them
        timed (the launch, the summary) where it comes to a second."""
        total = self.total()
        parts = [f"{p} {clock(self.seconds[p])}" for p in PHASES if p in self.seconds]
        other = total - sum(self.seconds.values()) - (self.now() - self.since if self.open else 0.0)
        if other >= 0.5:
            parts.append(f"other {clock(other)}")
        return f"time        : {clock(total)} ({', '.join(parts)})"
