"""Which family's files a checkpoint folder holds, and the checkpoint value everything else reads: each family's
files module (toolkit.strategy.<family>.files) says whether a folder is its own and what layout wrote it, gathers
its full weights with the tools that strategy ships, reads its Adam state by parameter name and loads a
checkpoint by name into a run of its kind. `saved_layout`: recorded in trainer_state.json, or, for checkpoints
older than that record, read from the files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import is_complete
from toolkit.strategy.families import FILES
from toolkit.strategy.unpickling import numbers_only_torch_load


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
    return None if files is None else FILES[files].layout_from(folder, len(list(folder.glob("random_states_*.pkl"))))


def saved_by(folder: Path) -> str | None:
    """Which family's files `folder` holds (a key of toolkit.strategy.families.FILES: one process writes DDP's);
    None if none matches."""
    return next((name for name, module in FILES.items() if module.is_mine(folder)), None)


def gather_full_weights(files: str, folder: Path, into: Path) -> Path:
    """Write the checkpoint's full float32 weights into `into`, a shard at a time, so that the
    whole model is never held twice; every file read by the weights-only unpickler (pickle.UnpicklingError
    for anything else)."""
    if files not in FILES:
        raise ValueError(f"not a family's checkpoint files: {files}")
    with numbers_only_torch_load():
        FILES[files].full_weights(folder, into)
    return into
