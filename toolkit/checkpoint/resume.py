"""A resume in one call: the checkpoint read once, checked, converted if another layout wrote it, and loaded.

    checkpoint = intact_checkpoint(...)   the manifest and state file checked, read once; every rank gets the value
    check_same_data_order / _mixture      the data position carries over, or one line says why not
    check_same_settings                   the changes a resume can take, or one line naming those it cannot
    load_checkpoint                       the model's shape, then the strategy's files (or their conversion)
    take_changed_settings                 the taken changes from the next step on, said in one line
Each step in full: docs/internals.md, toolkit/checkpoint/resume.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.integrity import intact_checkpoint
from toolkit.checkpoint.manager import load_checkpoint
from toolkit.checkpoint.settings import (
    check_same_data_order,
    check_same_mixture,
    check_same_settings,
    take_changed_settings,
)
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.declarations import Resume
from toolkit.run.folder import RunDir
from toolkit.strategy.distributed import Strategy


def resume(
    strategy: Strategy,
    run: RunDir,
    chosen: Path,
    fresh: TrainerState,
    *,
    auto: bool,
    streaming: bool,
    max_steps: int,
    peak_lr: float,
    on_resume: dict[str, Resume],
    scheduler=None,
    rank_files: Callable[[Path], None] | None = None,
    say: Callable[[str], None] = print,
) -> tuple[Path, TrainerState]:
    """Collective: (the checkpoint resumed, the state to continue from) into the prepared `strategy`.

    `fresh` is this run's new state: its seed, global batch, mixture and trained settings are what the
    checkpoint is checked against, and what the next checkpoint records. `scheduler` is the recipe's schedule
    (None where a user's DeepSpeed JSON owns it); `rank_files(folder)` reads what each rank kept of its own
    (a stream's position), as save_checkpoint's `rank_files` wrote it. `on_resume` is what the recipe's config declares a
    resume does with each key's change (declared(type(cfg), "resume"))."""
    checkpoint = intact_checkpoint(strategy, run, chosen, auto, say)
    check_same_data_order(checkpoint, fresh.seed, fresh.global_batch_size, streaming)
    check_same_mixture(checkpoint, fresh.mixture, say)
    changed = check_same_settings(checkpoint, fresh.settings, max_steps, on_resume)
    load_checkpoint(strategy, checkpoint, say)
    take_changed_settings(changed, scheduler, checkpoint.state.step, peak_lr, say, on_resume)
    if rank_files is not None:
        rank_files(checkpoint.folder)
    # this run's data description and settings, for the next checkpoint (a global batch too: older
    # checkpoints have none)
    state = dataclasses.replace(checkpoint.state, settings=fresh.settings, mixture=fresh.mixture,
                                global_batch_size=fresh.global_batch_size)
    return checkpoint.folder, state
