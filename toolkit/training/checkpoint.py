"""Training checkpoints: the strategy's save_state in checkpoints/step-N/, keep the last K, resume.

A checkpoint is complete only once its TrainerState (`trainer_state.json`) is written, after
every rank has finished its part of `save_state`; a folder without it (a crash mid-save) is
never resumed from and never counts towards `keep_last` (see toolkit.run_dir).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toolkit.config import field
from toolkit.run_dir import MODEL_FILES, RunDir, TrainerState
from toolkit.strategy.distributed import Strategy


@dataclass
class CheckpointConfig:
    every: int = field(100, help="save a checkpoint every N optimizer steps (0 = only at the end)")
    keep_last: int = field(2, help="complete checkpoints to keep; older ones are deleted")
    final_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", help="dtype of the weights in final/ and adapter/: the fp32 master weights cast to it, under every strategy"
    )

    def validate(self) -> list[str]:
        problems = []
        if self.every < 0:
            problems.append(f"every={self.every} must be >= 0")
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last} must be at least 1")
        return problems


def save_checkpoint(
    strategy: Strategy,
    run: RunDir,
    state: TrainerState,
    keep_last: int,
    model_files: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank must call it.

    `model_files(folder)` writes what turns the saved weights back into a model without the
    run (config, tokenizer): recipes/export.py consolidates any checkpoint from it alone.
    """
    acc = strategy.accelerator
    folder = run.checkpoint(state.step)
    if acc.is_main_process and folder.exists():
        shutil.rmtree(folder)  # a stale, incomplete save of the same step
    acc.wait_for_everyone()
    acc.save_state(str(folder))
    acc.wait_for_everyone()
    if acc.is_main_process:
        if model_files is not None:
            model_files(folder / MODEL_FILES)
        state.write(folder)
        for old in run.complete_checkpoints()[:-keep_last]:
            shutil.rmtree(old)
    acc.wait_for_everyone()
    return folder


def load_checkpoint(strategy: Strategy, folder: Path) -> TrainerState:
    strategy.accelerator.load_state(str(folder))
    return TrainerState.read(folder)
