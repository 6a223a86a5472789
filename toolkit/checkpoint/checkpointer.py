"""A run's checkpoints, one object the trainer builds once: each save taken to complete, one at a time (blocking, or
written in the background and moved on at the steps where no rank writes any more), and a failed save stopped or
said as checkpoint.on_save_error says. What a save writes: toolkit.checkpoint.manager.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.manager import CheckpointConfig, SaveFailed, Saving, begin_save
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.run.folder import RunDir
from toolkit.strategy.distributed import Strategy


class SaveStopped(Exception):
    """A checkpoint could not be written and checkpoint.on_save_error=stop: raised on every rank;
    the previous checkpoint is intact. The message is the run's one `error:` line."""


class Checkpointer:
    def __init__(self, strategy: Strategy, run: RunDir, cfg: CheckpointConfig, say: Callable[[str], None],
                 log: Callable[[str, dict], None]):
        self.strategy, self.run, self.cfg, self.say, self.log = strategy, run, cfg, say, log
        self.saving: Saving | None = None  # a checkpoint still being made complete
        self.step = -1  # the step of the newest checkpoint begun (-1: none yet, or its save failed)

    def writing(self) -> bool:
        """Whether this rank still writes files of a save in the background (the step's all-reduce carries it)."""
        return self.saving is not None and self.saving.writing()

    def save(self, state: TrainerState, model_files: Callable[[Path], None],
             rank_files: Callable[[Path], None] | None = None, background: bool = False) -> Path | None:
        """Collective: a checkpoint of `state`, once a save still being made is complete; its folder, or None when
        it failed and checkpoint.on_save_error=continue, or goes on in the `background` (poll and wait end it)."""
        self.wait(state.step)
        self.step = state.step
        self.saving = begin_save(self.strategy, self.run, state, self.cfg.keep_last, model_files, self.say,
                                 rank_files=rank_files, background=background)
        self.saving.since = state.step
        return None if background else self.wait(state.step)

    def poll(self, step: int, seen_at: int, flags: list[float] | None) -> None:
        """Collective, at training step `step`: a background save taken to its next step once no rank writes any
        more, as `flags` (the step's all-reduce, read at `seen_at`) say."""
        if self.saving is not None and flags is not None and seen_at > self.saving.since and flags[-1] == 0:
            self._complete(step, wait=False)

    def wait(self, step: int) -> Path | None:
        """Collective: the save being made (if any) complete, waiting for what is still written; its folder, or
        None when there was none or it failed and checkpoint.on_save_error=continue."""
        return self._complete(step, wait=True)

    def _complete(self, step: int, wait: bool) -> Path | None:
        saving = self.saving
        if saving is None:
            return None
        try:
            folder = saving.complete() if wait else saving.advance(background=True)
        except SaveFailed as exc:
            self.saving = None
            if self.step == saving.state.step:
                self.step = -1  # the step has no checkpoint: the end and a stop try again
            self.log("checkpoint_error", {"step": saving.state.step, "checkpoint_error": str(exc)})
            if self.cfg.on_save_error == "stop":
                raise SaveStopped(f"{exc}; free space, then continue with resume=auto") from None
            self.say(f"warning: {exc}; training goes on (checkpoint.on_save_error=continue)")
            return None
        if folder is None:  # the manifest and state file being written, in the background
            saving.since = step
            return None
        self.saving = None
        self.say(f"checkpoint saved: {folder}")
        return folder
