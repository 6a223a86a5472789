"""Which strategy's files a checkpoint folder holds, answered in one place: each format's module
(toolkit.checkpoint.ddp, fsdp, deepspeed, pipeline) says whether a folder is its own, gathers its full
weights with the tools that strategy ships (never by hand), reads its Adam state by parameter name and
loads a checkpoint by name into a run of its kind.

Every strategy also writes one `random_states_<rank>.pkl` per process. `saved_layout` says which
strategy and world size wrote a checkpoint: recorded in its trainer_state.json, or, for checkpoints
older than that record, read from its files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from toolkit.checkpoint import ddp, deepspeed, fsdp, pipeline
from toolkit.checkpoint.unpickling import numbers_only_torch_load
from toolkit.parallel_layout import ParallelLayout
from toolkit.run_dir import TrainerState, is_complete

Format = Literal["ddp", "fsdp", "deepspeed", "pipeline"]
# asked in this order: a DeepSpeed or FSDP2 save may hold a model*.safetensors too
FORMATS = {"deepspeed": deepspeed, "fsdp": fsdp, "pipeline": pipeline, "ddp": ddp}


def saved_layout(folder: Path) -> ParallelLayout | None:
    """The layout that wrote checkpoint `folder`; None if its files are no strategy's."""
    if is_complete(folder):
        layout = TrainerState.read(folder).layout
        if layout is not None:
            return layout
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
