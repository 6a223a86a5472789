"""Which strategy's files a checkpoint folder holds, answered in one place: each format's module
(toolkit.checkpoint.ddp, fsdp, deepspeed, pipeline) says whether a folder is its own, gathers its full
weights with the tools that strategy ships (never by hand), reads its Adam state by parameter name and
loads a checkpoint by name into a run of its kind.

Every strategy also writes one `random_states_<rank>.pkl` per process. `saved_layout` says which
strategy and world size wrote a checkpoint: recorded in its trainer_state.json, or, for checkpoints
older than that record, read from its files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toolkit.checkpoint import ddp, deepspeed, fsdp, pipeline
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.checkpoint.unpickling import numbers_only_torch_load
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import is_complete

Format = Literal["ddp", "fsdp", "deepspeed", "pipeline"]
# asked in this order: a DeepSpeed or FSDP2 save may hold a model*.safetensors too
FORMATS = {"deepspeed": deepspeed, "fsdp": fsdp, "pipeline": pipeline, "ddp": ddp}


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint, read once: its folder, its state file, and the layout that wrote its files
    (recorded in the state, or read from the files of checkpoints older than that record; None if they are no
    strategy's). Everything a resume checks and loads is asked of this value (toolkit.checkpoint.resume)."""

    folder: Path
    state: TrainerState
    layout: ParallelLayout | None

    @classmethod
    def read(cls, folder: Path) -> Checkpoint:
        """DamagedState (a ValueError) when its state file is not what TrainerState.write wrote."""
        state = TrainerState.read(folder)
        return cls(folder, state, state.layout or layout_from_files(folder))


def saved_layout(folder: Path) -> ParallelLayout | None:
    """The layout that wrote checkpoint `folder` (complete or not); None if its files are no strategy's."""
    if is_complete(folder):
        layout = TrainerState.read(folder).layout
        if layout is not None:
            return layout
    return layout_from_files(folder)


def layout_from_files(folder: Path) -> ParallelLayout | None:
    """The layout of a checkpoint older than the record, from the files it holds."""
    files = saved_by(folder)
    if files is None:
        return None
    world = len(list(folder.glob("random_states_*.pkl")))
    if files == "ddp":
        return ParallelLayout("single" if world == 1 else "ddp", world)
    if files == "fsdp":
        return ParallelLayout("fsdp", world)  # Accelerate's FSDP version here (its DCP files do not say)
    if files == "pipeline":
        return ParallelLayout("ddp", world, pp=len(pipeline.stage_files(folder)))
    stage = deepspeed.config(folder).get("zero_optimization", {}).get("stage", 0)
    return ParallelLayout("deepspeed", world, zero_stage=int(stage))


def saved_by(folder: Path) -> Format | None:
    """Which strategy's save_state wrote `folder`, from the files it holds; None if none matches."""
    return next((name for name, module in FORMATS.items() if module.is_mine(folder)), None)


def gather_full_weights(format: Format, folder: Path, into: Path) -> Path:
    """Write the checkpoint's full float32 weights into `into`, a shard at a time, so that the
    whole model is never held twice; every file read by the weights-only unpickler (pickle.UnpicklingError
    for anything else)."""
    if format not in FORMATS:
        raise ValueError(f"not a checkpoint format: {format}")
    with numbers_only_torch_load():
        FORMATS[format].full_weights(folder, into)
    return into
