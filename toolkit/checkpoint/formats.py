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
from toolkit.checkpoint.origin import SavedLayout
from toolkit.run_dir import TrainerState, is_complete

SavedBy = Literal["ddp", "fsdp", "deepspeed", "pipeline"]
# asked in this order: a DeepSpeed or FSDP2 save may hold a model*.safetensors too
FORMATS = {"deepspeed": deepspeed, "fsdp": fsdp, "pipeline": pipeline, "ddp": ddp}


def saved_layout(folder: Path) -> SavedLayout | None:
    """The strategy and world size that wrote checkpoint `folder`; None if its files are no strategy's."""
    if is_complete(folder):
        state = TrainerState.read(folder)
        if state.strategy:
            return SavedLayout(state.strategy, state.world_size)
    kind = saved_by(folder)
    if kind is None:
        return None
    world = len(list(folder.glob("random_states_*.pkl")))
    if kind == "ddp":
        return SavedLayout("single process" if world == 1 else "DDP", world)
    if kind == "fsdp":
        return SavedLayout("FSDP2", world)  # Accelerate's FSDP version here (its DCP files do not say)
    stage = deepspeed.config(folder).get("zero_optimization", {}).get("stage", 0)
    return SavedLayout(f"DeepSpeed ZeRO-{stage}", world)


def saved_by(folder: Path) -> SavedBy | None:
    """Which strategy's save_state wrote `folder`, from the files it holds; None if none matches."""
    return next((kind for kind, files in FORMATS.items() if files.is_mine(folder)), None)


def gather_full_weights(kind: SavedBy, folder: Path, into: Path) -> Path:
    """Write the checkpoint's full float32 weights into `into`, a shard at a time, so that the
    whole model is never held twice."""
    if kind not in FORMATS:
        raise ValueError(f"not a checkpoint kind: {kind}")
    FORMATS[kind].full_weights(folder, into)
    return into
