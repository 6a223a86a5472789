"""A run's checkpoints, one object the trainer builds once: `load` (a resume, its weights checked, its first step
after checked for a dead model), `save` (a save marked suspect where its weights may be diverged; blocking, or
written in the background and moved on by `poll` at the steps where no rank writes any more), and `wait`; a failed
save stopped or said as checkpoint.on_save_error says. What a save writes: toolkit.checkpoint.manager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from toolkit.checkpoint.alive import dead_after_resume, nonfinite_weight
from toolkit.checkpoint.integrity import intact_checkpoint
from toolkit.checkpoint.manager import CheckpointConfig, SaveFailed, Saving, begin_save, load_checkpoint
from toolkit.checkpoint.resume import resume
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.declarations import Resume
from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir, is_complete
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
        self.tried = -1  # the step of the newest save begun, failed or not: the end and a stop do not try it again
        self.model: torch.nn.Module | None = None  # the unwrapped model whose weights are saved (attach)
        self.model_files: Callable[[Path], None] | None = None
        self.stream = None  # what each rank keeps of its own: a stream's position (toolkit.data.streaming)
        self.loaded: Path | None = None  # the checkpoint a load resumed
        self.unproven = False  # a loaded model whose first training step is still to be checked

    def attach(self, model: torch.nn.Module, model_files: Callable[[Path], None], stream=None) -> None:
        """What a save holds besides the strategy's files: the prepared (unwrapped) `model`, whose weights are checked,
        `model_files(folder)` writing the files that turn its weights back into a model, and a streamed run's
        `stream`, whose save(folder) and load(folder) keep each rank's position."""
        self.model, self.model_files, self.stream = model, model_files, stream

    def load(self, folder: Path, fresh: TrainerState, *, auto: bool, streaming: bool, max_steps: int, peak_lr: float,
             on_resume: dict[str, Resume], scheduler=None) -> TrainerState:
        """Collective: the state to go on from, with checkpoint `folder` (or, with `auto`, the newest intact one)
        loaded into the prepared run (toolkit.checkpoint.resume.resume); non-finite weights refused now, a dead model
        at its first step (check_loaded). `on_resume`: what the recipe's config declares a resume does with each
        key's change."""
        self.loaded, state = resume(
            self.strategy, self.run, folder, fresh, auto=auto, streaming=streaming, max_steps=max_steps,
            peak_lr=peak_lr, on_resume=on_resume, scheduler=scheduler,
            rank_files=self.stream.load if self.stream is not None else None,
            say=self.say,
        )
        bad = nonfinite_weight(self.strategy.accelerator, self.model)
        if bad is not None:
            raise UserError(f"checkpoint {self.loaded} holds non-finite weights ({bad} has NaN or inf); resume from an "
                            "earlier checkpoint with resume=PATH, or start a new output_dir")
        self.step = self.tried = state.step
        self.unproven = True
        self.say(f"resumed from {self.loaded} at step {state.step}")
        return state

    def restore(self, step: int, resumed_from: Path | None) -> Path | None:
        """Collective, after training: the weights (and optimizer state) of checkpoint `step` into the prepared run, the
        step a forgetting budget keeps for final/ (toolkit.training.forgetting); None where it is gone. It is in this
        run's checkpoints, or beside the one it resumed from (resume=PATH of another run's)."""
        found = [f for f in (self.run.checkpoint(step), resumed_from and resumed_from.parent / f"step-{step}")
                 if f and is_complete(f)]
        if not found:
            return None
        checkpoint = intact_checkpoint(self.strategy, self.run, found[0], False, self.say)
        load_checkpoint(self.strategy, checkpoint, self.say)
        return checkpoint.folder

    def check_loaded(self, loss: float, grad_norm, vocab_size: int | None, preference: bool) -> None:
        """The first step that trained after a load: garbage loaded from the checkpoint (finite weights pass every
        other check) refused in one line."""
        if not self.unproven:
            return
        self.unproven = False
        why = dead_after_resume(loss, grad_norm, vocab_size, preference)
        if why is not None:
            raise UserError(f"checkpoint {self.loaded} holds a dead model: the first step after resuming {why}; resume "
                            "from an earlier checkpoint with resume=PATH, or start a new output_dir")

    def writing(self) -> bool:
        """Whether this rank still writes files of a save in the background (the step's all-reduce carries it)."""
        return self.saving is not None and self.saving.writing()

    def save(self, state: TrainerState, background: bool = False, skipped: int = 0) -> Path | None:
        """Collective: a checkpoint of `state`, once a save still being made is complete; its folder, or None when
        it failed and checkpoint.on_save_error=continue, or goes on in the `background` (poll and wait end it). One
        that may hold a diverged model (non-finite weights, or right after `skipped` non-finite steps in a row) is
        marked suspect, so that rotation keeps an older one."""
        self.wait(state.step)
        bad = nonfinite_weight(self.strategy.accelerator, self.model)
        state.suspect = (f"non-finite weights ({bad})" if bad is not None
                         else f"saved right after {skipped} skipped non-finite step(s)" if skipped else "")
        self.step = self.tried = state.step
        self.saving = begin_save(self.strategy, self.run, state, self.cfg.keep_last, self.model_files, self.say,
                                 rank_files=self.stream.save if self.stream is not None else None,
                                 background=background)
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
                self.step = -1  # the step has no checkpoint: the end and a stop try again, at a later step
            self.log("checkpoint_error", {"step": saving.state.step, "checkpoint_error": str(exc)})
            if self.cfg.on_save_error == "stop":
                then = ("continue with resume=auto" if self.run.latest_checkpoint() is not None
                        else "run the same command again: there is no checkpoint to continue from")
                raise SaveStopped(f"{exc}; free space, then {then}") from None
            self.say(f"warning: {exc}; training goes on (checkpoint.on_save_error=continue)")
            return None
        if folder is None:  # the manifest and state file being written, in the background
            saving.since = step
            return None
        self.saving = None
        self.say(f"checkpoint saved: {folder}")
        return folder
