"""Training checkpoints: the strategy's save_state in checkpoints/step-N/, keep the last K, resume.

A checkpoint is complete only once its TrainerState (`trainer_state.json`) is written, after
every rank has finished its part of `save_state`; a folder without it (a crash mid-save) is
never resumed from and never counts towards `keep_last` (see toolkit.run.folder). Just before it,
the manifest records every file's size and CRC-32 (toolkit.run.manifest), checked before a resume.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from toolkit.checkpoint.background import Writes, staged
from toolkit.checkpoint.conversion import cached_conversion
from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.same_model import check_same_model, different_model, first_mismatch_in
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.declarations import ALWAYS, free
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.faults import fail_point, kill_point
from toolkit.run.folder import MODEL_FILES, PRUNED, RunDir, converted_state
from toolkit.run.manifest import MANIFEST, crc32, write_manifest
from toolkit.run.writes import failed_write, release
from toolkit.strategy.by_name import ConsolidatedState
from toolkit.strategy.ddp import files as ddp
from toolkit.strategy.distributed import Strategy
from toolkit.strategy.unpickling import not_only_numbers, numbers, numbers_only_resume

SAVING = free("what is saved and when, not what trains")


def _saves_only_at_the_end(cfg) -> str | None:
    """Why checkpoint.async_save has no effect: the end's save waits for its files either way (the run ends with its
    checkpoint complete). Where it cannot write in the background at all it is refused: toolkit.config.combinations."""
    return None if cfg.checkpoint.every else "checkpoint.every=0 saves only at the end, which waits for its files either way"


@dataclass
class CheckpointConfig:
    every: int = field(100, help="save a checkpoint every N optimizer steps (0 = only at the end)", resume=SAVING,
                       used_when=ALWAYS, accepts={"0": "only at the end", "2**31": "only at the end"})
    keep_last: int = field(2, help="complete checkpoints to keep; older ones are deleted", resume=SAVING,
                           used_when=ALWAYS, accepts={"2**31": "keep every checkpoint"})
    final_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", help="dtype of the weights in final/ and adapter/: the fp32 master weights cast to it, under every "
        "strategy", resume=SAVING, used_when=ALWAYS,
    )
    on_save_error: Literal["stop", "continue"] = field(
        "stop", help="when a checkpoint cannot be written (disk full, I/O error): stop the run (exit 5; resume=auto "
        "continues from the previous checkpoint once there is room) or train on and try again at the next save",
        resume=SAVING, used_when=ALWAYS,
    )
    async_save: bool = field(
        False, help="write each checkpoint's files in the background while training goes on (its tensors are copied "
        "to host memory first, so the host needs room for one more copy of what the rank saves); DDP and FSDP2",
        resume=SAVING, used_when=_saves_only_at_the_end,
    )

    def validate(self) -> list[str]:
        problems = []
        if self.every < 0:
            problems.append(f"every={self.every} must be >= 0")
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last} must be at least 1")
        return problems


def save_checkpoint(strategy: Strategy, run: RunDir, state: TrainerState, keep_last: int,
                    model_files: Callable[[Path], None] | None = None, say: Callable[[str], None] = print,
                    rank_files: Callable[[Path], None] | None = None) -> Path:
    """Collective: a checkpoint written and complete when it returns (begin_save's arguments)."""
    return begin_save(strategy, run, state, keep_last, model_files, say, rank_files).complete()


def begin_save(
    strategy: Strategy,
    run: RunDir,
    state: TrainerState,
    keep_last: int,
    model_files: Callable[[Path], None] | None = None,
    say: Callable[[str], None] = print,
    rank_files: Callable[[Path], None] | None = None,
    background: bool = False,
) -> Saving:
    """Collective: every rank must call it. The checkpoint is complete once its `Saving.complete()` has returned
    (collective too); with `background`, the strategy's files are written meanwhile (toolkit.checkpoint.background).

    `model_files(folder)` writes what turns the saved weights back into a model without the
    run (config, tokenizer): recipes/export.py consolidates any checkpoint from it alone.
    `rank_files(folder)` is called on every rank, for what each rank keeps of its own (a stream's position).
    """
    acc = strategy.accelerator
    folder = run.checkpoint(state.step)
    # what wrote the files: a resume under another strategy or world size converts them
    state.layout = strategy.layout
    kill_point("save.start", state.step)
    if acc.is_main_process:
        if folder.is_symlink():  # the name this save writes; the link goes, never what it points to
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)  # a stale, incomplete save of the same step
        shutil.rmtree(converted_state(folder), ignore_errors=True)  # made from a checkpoint of this step before
        run.drop_pruned()
    previous = run.latest_checkpoint()
    if acc.is_main_process and previous is not None:
        warn_low_space(folder, previous, say)
    acc.wait_for_everyone()
    # training goes on from here while the writes run: the state as it is now is the checkpoint's
    saving = Saving(strategy, run, folder, copy.deepcopy(state), keep_last, model_files,
                    optimizer_parameter_names(strategy), previous)
    # A write that fails (disk full, I/O error, permission; whatever its writer raises: toolkit.run.writes)
    # on any rank fails the save on every rank: the partial folder goes, the previous checkpoint was
    # never touched, and the trainer stops or goes on as checkpoint.on_save_error says. Any other error
    # is raised as it is, its partial folder removed too.
    writes = Writes(state.step, folder) if background else None
    try:
        with staged(writes) if writes is not None else contextlib.nullcontext():
            strategy.accelerator.save_state(str(folder))
        beside = getattr(strategy.family.files, "save_beside", None)  # files Accelerate does not hold
        if beside is not None:
            beside(strategy, folder)
        if rank_files is not None:
            rank_files(folder)
        fail_point("save.rank_files", state.step, folder)
    except BaseException as exc:
        saving.failure = _write_failure(exc, strategy.rank, folder, acc.is_main_process)
    kill_point("save.rank_files", state.step)
    if writes is not None:
        # agreed before any thread starts: DCP's writes are collective, and a rank that failed here would leave
        # the others' threads waiting for it
        saving.failure = _first(strategy, saving.failure)
        if saving.failure is None:
            saving.writes = writes
            writes.start()
    return saving


@dataclass
class Saving:
    """A checkpoint being written: its folder has no state file until it is complete (a resume never takes it).

    It is complete in two steps, each agreed by every rank: every rank's files are written, then the main process
    writes what names them (model_files/, the manifest with every file's CRC-32, the state file) and rotates. In
    the background both run while training goes on: `writing()` says whether this rank is still at it, and the
    trainer calls `advance()` once no rank is."""

    strategy: Strategy
    run: RunDir
    folder: Path
    state: TrainerState  # as it was when the save began
    keep_last: int
    model_files: Callable[[Path], None] | None
    optimizer_names: list[list[str]] | None
    previous: Path | None
    failure: str | None = None  # this rank's, from the files written before training went on
    writes: Writes | None = None  # the files written in the background, where they are
    naming: threading.Thread | None = None  # the main process's second step, in the background
    named: BaseException | None = None  # what that step raised
    since: int = -1  # the step the current step of the save began at (the trainer's)

    def writing(self) -> bool:
        """Whether this rank is still writing (the trainer asks every rank, in its step's reduce)."""
        return (self.writes is not None and self.writes.writing()) or (self.naming is not None and self.naming.is_alive())

    def complete(self) -> Path:
        """Collective: both steps, waiting for what runs in the background. Raises SaveFailed on every rank alike."""
        folder = self.advance()
        return folder if folder is not None else self.advance()

    def advance(self, background: bool = False) -> Path | None:
        """Collective: the next step, once it can run without waiting (or waiting for it). After the files, the main
        process names them (in the `background`: returns None, and the next call ends it); after that, the folder
        of the complete checkpoint."""
        strategy, folder = self.strategy, self.folder
        main = strategy.accelerator.is_main_process
        if self.naming is None:  # every rank's files
            failure, crash = self.failure, None
            if self.writes is not None and (error := self.writes.wait()) is not None:
                try:
                    failure = _write_failure(error, strategy.rank, folder, main)
                except BaseException as exc:  # not a write's failure: raised once every rank knows
                    crash = exc
            self._agree(_first(strategy, CRASHED if crash is not None else failure), crash)
            self.naming = threading.Thread(target=self._name, daemon=True, name="checkpoint-manifest")
            if main:
                self.naming.start() if background else self._name()
            if background:
                return None
        if main and self.naming.ident is not None:  # started in the background
            self.naming.join()
        named = self.named if main else None
        crash = named if named is not None and not isinstance(named, SaveFailed) else None
        failure = CRASHED if crash is not None else str(named) if named is not None else None
        self._agree(_first(strategy, failure), crash)
        return folder

    def _name(self) -> None:
        """The main process's step: what names the files, the manifest, the state file (complete from here), the
        rotation. A write that fails is kept as a SaveFailed for `advance` to agree on; anything else as it is."""
        folder, state = self.folder, self.state
        try:
            try:
                if self.model_files is not None:
                    self.model_files(folder / MODEL_FILES)
                if self.optimizer_names is not None:  # optimizer.bin numbers its parameters; say which is which
                    (folder / ddp.OPTIMIZER_NAMES).write_text(json.dumps({"groups": self.optimizer_names}))
                fail_point("save.manifest", state.step, folder / MANIFEST)
                # The manifest before the state file (a complete checkpoint always has one), and its
                # checksum in the state: a state file copied in from another checkpoint is told apart.
                state.manifest_crc32 = crc32(write_manifest(folder))
                kill_point("save.manifest", state.step)
                state.write(folder)
            except BaseException as exc:
                self.named = SaveFailed(_write_failure(exc, self.strategy.rank, folder, True))
                return
            kill_point("save.state_file", state.step)
            self._rotate()
        except BaseException as exc:
            self.named = exc

    def _agree(self, failure: str | None, crash: BaseException | None = None) -> None:
        """Collective: raise SaveFailed on every rank where any rank failed (`failure`, the same on every rank), the
        partial folder removed and the previous checkpoint's state said. Where a rank raised something that is not
        a write's failure (CRASHED), it raises that, and the others say so, all at once: none is left waiting."""
        if failure is None:
            return
        strategy, folder, previous = self.strategy, self.folder, self.previous
        if failure == CRASHED:
            if crash is not None:
                raise crash
            raise RuntimeError(f"checkpoint {folder.name}: another process failed while writing it; its error is "
                               "above")
        if strategy.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
            # what the failed save wrote is no measure of it (nothing, where its first write failed)
            needed = (f"about {_size(_bytes(previous))}" if previous is not None
                      else f"at least {_size(least_bytes(strategy))}")
            failure += f"; a checkpoint needs {needed}, {_size(_free(folder))} is free there"
            failure += f"; {previous.name} is intact" if previous is not None else "; no earlier checkpoint exists"
        failure = _first(strategy, failure if strategy.accelerator.is_main_process else None)
        raise SaveFailed(f"checkpoint {folder.name} could not be written: {failure}")

    def _rotate(self) -> None:
        done = self.run.complete_checkpoints()
        # never the newest one that passed its checks: after a skipped non-finite step or with
        # non-finite weights, the last keep_last saves may all hold a model that diverged
        passed = [c for c in done if TrainerState.passed(c)][-1:]
        # nor the step a forgetting budget keeps for final/ (toolkit.training.forgetting)
        if self.state.budget.get("best_step") is not None:
            passed.append(self.run.checkpoint(self.state.budget["best_step"]))
        # a link in checkpoints/ is not a folder this run wrote: rotation never deletes through one
        for old in [c for c in done[:-self.keep_last] if c not in passed and not c.is_symlink()]:
            # Out of rotation in one rename, then deleted: a crash mid-delete leaves a folder
            # that is plainly not a checkpoint, never a step-N that lost some of its files.
            going = old.rename(old.with_name(old.name + PRUNED))
            kill_point("prune", self.state.step)
            shutil.rmtree(going)
            converted = converted_state(old)  # its state by parameter name goes with it, the same way
            if converted.exists():
                shutil.rmtree(converted.rename(converted.with_name(converted.name + PRUNED)))


CRASHED = "\0 not a write's failure"  # what a rank tells the others when it raised something else


class SaveFailed(Exception):
    """A checkpoint could not be written; its partial folder is gone and the previous one is intact."""


def _write_failure(exc: BaseException, rank: int, folder: Path, main: bool) -> str:
    """One line for a failed write (toolkit.run.writes.failed_write: an OSError, safetensors' SafetensorError,
    torch.save's RuntimeError from its zip writer, a PicklingError); anything else is re-raised, the
    partial folder removed first by the main process."""
    cause = failed_write(exc)
    if cause is None:
        if main:
            shutil.rmtree(folder, ignore_errors=True)
        raise exc
    release(exc)  # its files closed: the folder's removal frees their room (a background save's error is kept)
    if isinstance(exc, OSError) and exc.filename:
        return f"rank {rank} writing {exc.filename}: {exc.strerror or exc}"
    full = " (the disk is full)" if _free(folder) == 0 else ""
    return f"rank {rank} writing into {folder}: {cause}{full}"


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _first(strategy: Strategy, failure: str | None) -> str | None:
    """Collective: the first rank's failure, the same verdict on every rank."""
    if strategy.layout.world == 1:
        return failure
    from accelerate.utils import gather_object

    return next((f for f in gather_object([failure]) if f is not None), None)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def least_bytes(strategy: Strategy) -> int:
    """What a checkpoint of this run holds at least, before any was written: each weight of this process's models in
    fp32 and AdamW's two fp32 moments of each weight trained (a 16-bit copy, the schedule and random states on top)."""
    total = 0
    for model in strategy.prepared()[0]:
        for param in model.parameters():
            count = getattr(param, "ds_numel", param.numel())  # ZeRO-3 keeps an empty stand-in; numel() is 0
            total += count * (12 if param.requires_grad else 4)
    return total


def _free(folder: Path) -> int:
    """Free bytes on the filesystem that holds `folder` (or its nearest existing parent)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def warn_low_space(folder: Path, previous: Path, say: Callable[[str], None]) -> None:
    """Before a save: say so when the disk has less room than the previous checkpoint took (a
    save of the same model needs as much), while there is still time to free some."""
    needed, free = _bytes(previous), _free(folder)
    if free < needed:
        say(f"warning: {_size(free)} free for checkpoint {folder.name}, the previous one took {_size(needed)}: "
            "it will likely fail; free space or lower checkpoint.keep_last")


def load_checkpoint(strategy: Strategy, checkpoint: Checkpoint, say: Callable[[str], None] = print) -> None:
    """Collective: the checkpoint's tensors, schedule and random states into the prepared run. A checkpoint of
    another model shape is refused with one line, before loading.

    The shapes are compared from the configs (the checkpoint's model_files/ and the live model's),
    which reads the same under every strategy and on every rank; a size mismatch that still
    reaches the strategy's loader is translated the same way.

    A checkpoint of another strategy or world size that Accelerate cannot load as it is (see
    resumes_natively) is converted to its state by parameter name and loaded from that
    (toolkit.checkpoint.conversion), with one line saying so."""
    folder, saved = checkpoint.folder, checkpoint.layout
    # outside_training: the meta models are built as in a single process (under ZeRO-3 too)
    with strategy.outside_training():
        for model in strategy.prepared()[0]:  # the trainer hands over only the strategy
            check_same_model(folder, model)
    if saved is not None and not resumes_natively(strategy, saved):
        _load_converted(strategy, checkpoint, say)
    else:
        _load_native(strategy, folder)
        beside = getattr(strategy.family.files, "load_beside", None)
        if beside is not None:
            beside(strategy, folder)
    # Accelerate counts micro-batches to know which one closes an optimizer step, and load_state
    # restores the count of the run that saved: with another accumulation (another world size)
    # the steps would close on the wrong micro-batch (measured: FSDP2 from 2 processes to 1 went
    # off the curve at the first step). Every optimizer step is `accumulation` micro-batches.
    strategy.accelerator.step = checkpoint.state.step * strategy.accumulation


def _load_native(strategy: Strategy, folder: Path) -> None:
    try:
        with numbers_only_resume():
            strategy.accelerator.load_state(str(folder))
    except pickle.UnpicklingError as exc:
        raise UserError(not_only_numbers(folder, exc)) from None
    except RuntimeError as exc:
        found = first_mismatch_in(str(exc))
        if found is None:
            raise
        raise UserError(different_model(folder, found)) from None


def _load_converted(strategy: Strategy, checkpoint: Checkpoint, say: Callable[[str], None]) -> None:
    """Weights and Adam state from the checkpoint's state by parameter name; the LR schedule and the
    random states (of the ranks that exist in both) from the checkpoint itself."""
    folder, saved, here = checkpoint.folder, checkpoint.layout, strategy.layout.describe()
    if why := strategy.family.conversion_refused(strategy):
        raise UserError(f"checkpoint {folder} was saved under {saved.describe()}; resuming it under {here} needs a "
                        f"conversion, and {why}: remove them from the JSON, or resume under {saved.describe()}")
    # made by the main process alone (or found made before) while the others wait
    converted, cached = strategy.on_main(lambda: cached_conversion(checkpoint))
    _load_by_name(strategy, ConsolidatedState(converted))
    for index, obj in enumerate(strategy.prepared()[2]):  # the LR schedule
        saved_state = numbers(folder / f"custom_checkpoint_{index}.pkl")
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            _load_schedule(obj, saved_state, folder)
        else:
            obj.load_state_dict(saved_state)
    _restore_random_states(folder / f"random_states_{strategy.rank}.pkl")
    how = f"reused its conversion {converted.name}" if cached else f"converted it into {converted.name}"
    say(f"checkpoint {folder.name} was saved under {saved.describe()}, this run is {here}: {how} (weights and "
        "Adam state by parameter name) and loaded it")


def _load_schedule(schedule: torch.optim.lr_scheduler.LRScheduler, saved: dict, folder: Path) -> None:
    """The saved schedule onto this run's parameter groups, and the rate of the next step into each
    group (a native load takes it from the optimizer's saved groups).

    A schedule keeps one rate (and one rate function) per parameter group of the run that saved it,
    and strategies do not agree on empty groups: DeepSpeed drops the recipe's no-decay group when it
    is empty (LoRA, whose adapter weights are all matrices), torch keeps it. The recipe gives every
    group the same rate and schedule, so the saved values are then one value, given to every group."""
    groups = schedule.optimizer.param_groups
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = saved.get(key)
        if not isinstance(values, list) or len(values) == len(groups):
            continue
        if any(value != values[0] for value in values):
            raise UserError(
                f"checkpoint {folder} has a learning rate for each of {len(values)} parameter groups and this run "
                f"has {len(groups)}, with different rates: they cannot be matched; resume it under the strategy "
                "it was saved with"
            )
        saved[key] = [values[0]] * len(groups)
    schedule.load_state_dict(saved)
    for group, lr in zip(groups, schedule.get_last_lr(), strict=True):
        group["lr"] = lr


def _restore_random_states(file: Path) -> None:
    """This rank's random generators as the rank of the same number left them, where it existed
    (dropout is the only consumer: the batch order is a function of the seed and step)."""
    if not file.is_file():
        return
    import random

    import numpy as np
    from accelerate.utils import load

    states = load(file)  # weights_only, numpy's state allowed
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def resumes_natively(strategy: Strategy, saved: ParallelLayout) -> bool:
    """Whether Accelerate's load_state (and a pipeline's stage files) read checkpoint `saved` as it is: its
    backend's answer (measured on CPU: DDP's files fit any number of processes, FSDP2's DCP files are resharded to
    any number on load, ZeRO's partitions fit only the stage and world size that wrote them, a pipeline's stage
    files only the same cut). Anything else goes through the state by parameter name
    (toolkit.checkpoint.conversion)."""
    return strategy.family.resumes_natively(strategy.layout, saved)


def optimizer_parameter_names(strategy: Strategy) -> list[list[str]] | None:
    """DDP / one process: the parameter names of the optimizer's groups, in the order that optimizer.bin numbers
    them (saved beside it: ddp.OPTIMIZER_NAMES). None elsewhere: FSDP2 and DeepSpeed checkpoints name their
    parameters themselves."""
    return strategy.family.optimizer_names(strategy)


def _load_by_name(strategy: Strategy, state: ConsolidatedState) -> None:
    """Collective: a converted checkpoint into the prepared model and optimizer, with this strategy's
    own setters (each format's load_into)."""
    strategy.family.files.load_into(strategy, state)
