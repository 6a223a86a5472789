"""Which checkpoint a resume may trust: its manifest, its state file and every rank's files checked first;
resume=auto falls back past damaged ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.formats import Checkpoint
from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import STATE_FILE, RunDir, checkpoint_step
from toolkit.run.manifest import MANIFEST, check_manifest, crc32
from toolkit.strategy.distributed import Strategy
from toolkit.strategy.families import family_of


def intact_checkpoint(
    strategy: Strategy, run: RunDir, chosen: Path, auto: bool, say: Callable[[str], None] = print
) -> Checkpoint:
    """Collective: the checkpoint to resume from once its manifest is checked, read once on the main process;
    every rank gets the same verdict and the same value.

    resume=auto falls back to the newest older checkpoint that is intact, saying so, and moves
    each damaged one aside (`step-N.damaged`: kept for a post-mortem, out of rotation, never
    resumed from); resume=PATH stops in one line that names the damaged file.
    """

    def choose() -> Checkpoint:
        run.drop_pruned()
        candidates = [chosen] + ([c for c in reversed(run.complete_checkpoints()) if c != chosen] if auto else [])
        problems = []
        for folder in candidates:
            checkpoint, problem = None, check_manifest(folder)
            if problem is None:
                checkpoint, problem = read_intact(folder)
            if checkpoint is not None:
                return checkpoint
            problems.append(problem)
            if not auto:
                break
            aside = folder.with_name(folder.name + ".damaged")
            folder.rename(aside)
            say(f"checkpoint {folder.name} is damaged ({problem}); moved to {aside.name}, trying the one before")
        where = f"resume={chosen}" if not auto else f"resume=auto: no intact checkpoint in {run.checkpoints}"
        raise UserError(f"{where}: {problems[0]}; resume from an intact checkpoint or start a new output_dir")

    return strategy.on_main(choose)


def check_state_file(folder: Path) -> str | None:
    """None if the checkpoint's trainer_state.json is its own: readable, of the folder's step, and
    naming the checksum of the manifest beside it (checkpoints older than that field pass on the step)."""
    return read_intact(folder)[1]


def read_intact(folder: Path) -> tuple[Checkpoint | None, str | None]:
    """(the checkpoint read, None), or (None, what is wrong with its state file: check_state_file)."""
    path = folder / STATE_FILE
    try:
        checkpoint = Checkpoint.read(folder)
    except (OSError, ValueError, TypeError) as exc:
        return None, f"{path} is not a readable trainer state ({exc})"
    state, step = checkpoint.state, checkpoint_step(folder)
    if step is not None and state.step != step:
        return None, f"{path} is of step {state.step}, not {step}: a state file from another checkpoint"
    manifest = folder / MANIFEST
    if state.manifest_crc32 and not manifest.is_file():  # else every file it lists would go unchecked
        return None, f"{manifest} is missing (its {STATE_FILE} names one), so its files cannot be checked"
    if state.manifest_crc32 and crc32(manifest) != state.manifest_crc32:
        return None, f"{path} belongs to another checkpoint (it names another manifest than {manifest})"
    if not manifest.is_file():  # a checkpoint older than manifests: at least every rank's files
        missing = missing_rank_file(folder, checkpoint.layout)
        if missing is not None:
            return None, missing
    return checkpoint, None


def missing_rank_file(folder: Path, saved: ParallelLayout | None) -> str | None:
    """The first file one rank of the run that saved `folder` (under layout `saved`) should have written and
    did not: its random states (every strategy), its ZeRO optimizer partition (DeepSpeed ZeRO-1/2/3, which
    otherwise fails deep in DeepSpeed with a ValueError that names no rank)."""
    if saved is None or not saved.world:
        return None
    for rank in range(saved.world):
        if not (folder / f"random_states_{rank}.pkl").is_file():
            return f"{folder / f'random_states_{rank}.pkl'} is missing (rank {rank} of {saved.world} writes it)"
    missing = getattr(family_of(saved).files, "missing_partition", None)
    return None if missing is None else missing(folder, saved)
