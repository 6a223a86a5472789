"""Training checkpoints: save_state folders `checkpoints/step-N/`, keep the last K, resume.

A checkpoint is complete only once `trainer_state.json` is written, after every rank has
finished its part of `save_state`; a folder without it (a crash mid-save) is never resumed
from and never counts towards `keep_last`.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from accelerate import Accelerator

from toolkit.config import UserError, field

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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


def is_complete(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    root = output_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and is_complete(child):
                found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """`None` -> fresh start; `auto` -> newest complete checkpoint (or fresh); a path -> that one."""
    if not resume:
        return None
    if resume == "auto":
        done = complete_checkpoints(output_dir)
        return done[-1] if done else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume={resume} is not a folder; give a checkpoints/step-N folder or resume=auto")
    if not is_complete(path) and not _looks_like_checkpoint(path):
        raise UserError(
            f"resume={resume} is not a training checkpoint (no optimizer or RNG state); give a "
            "checkpoints/step-N folder of a run, or resume=auto"
        )
    if not is_complete(path):
        raise UserError(
            f"resume={resume} is an incomplete checkpoint (no {STATE_FILE}; the save was interrupted); "
            f"resume from an earlier one or use resume=auto"
        )
    return path


def _looks_like_checkpoint(folder: Path) -> bool:
    return _STEP_DIR.match(folder.name) is not None or any(folder.glob("optimizer*")) or any(folder.glob("random_states*"))


def read_state(folder: Path) -> dict:
    return json.loads((folder / STATE_FILE).read_text())


MODEL_FILES = "model_files"  # config, tokenizer (and a LoRA's adapter config) beside the weights


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    state: dict,
    keep_last: int,
    model_files: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank must call it.

    `model_files(folder)` writes what turns the saved weights back into a model without the
    run (config, tokenizer): recipes/export.py consolidates any checkpoint from it alone.
    """
    folder = output_dir / "checkpoints" / f"step-{state['step']}"
    if accelerator.is_main_process and folder.exists():
        shutil.rmtree(folder)  # a stale, incomplete save of the same step
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if model_files is not None:
            model_files(folder / MODEL_FILES)
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.rename(folder / STATE_FILE)
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return folder


def load_checkpoint(accelerator: Accelerator, folder: Path) -> dict:
    accelerator.load_state(str(folder))
    return read_state(folder)


# Every top-level entry the recipes write into output_dir (final.tmp and adapter.tmp are the
# atomic renames of toolkit.export.hf_folder and toolkit.models.adapter; tensorboard/ is Accelerate's tracker
# under project_dir), what a user would miss first. overwrite=true deletes these, nothing else.
RUN_ENTRIES = (
    "final", "adapter", "checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "samples.md",
    "final.tmp", "adapter.tmp",
)


def run_entries(output_dir: Path) -> tuple[list[str], list[str]]:
    """(the run's own entries in RUN_ENTRIES order, the others sorted) at the top of output_dir.

    Folders end in `/`."""
    own, foreign = [], []
    if output_dir.is_dir():
        for entry in sorted(output_dir.iterdir()):
            name = entry.name + ("/" if entry.is_dir() else "")
            (own if entry.name in RUN_ENTRIES else foreign).append(name)
    own.sort(key=lambda name: RUN_ENTRIES.index(name.rstrip("/")))
    return own, foreign


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_output_dir(output_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse anything that would lose what is in output_dir; every rank, before any work.

    A run's own outputs are replaced only by newer outputs of the same run (resume from its
    newest complete checkpoint, or overwrite=true), and nothing else is ever deleted.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir={output_dir} is a file, not a folder; choose another output_dir")
    own, foreign = run_entries(output_dir)
    if not own and not foreign:
        return  # missing or empty: a fresh start
    resumable = bool(complete_checkpoints(output_dir))
    if resume and resume != "auto":
        return  # an explicit checkpoint: resolve_resume checks it
    if resume == "auto" and resumable:
        return
    if foreign:
        hint = "continue the run there with resume=auto, or " if own and resumable else ""
        raise UserError(
            f"output_dir={output_dir} holds files that are not a toolkit run ({_few(foreign)}); "
            f"the toolkit will not delete them or start a run among them; {hint}choose another output_dir"
        )
    if overwrite:
        return
    if resume == "auto":
        raise UserError(
            f"output_dir={output_dir} holds a run ({_few(own)}) but no complete checkpoint to continue "
            "from, so resume=auto would start over and replace it; start that run over with "
            "overwrite=true (deletes it), or choose another output_dir"
        )
    hint = "continue it with resume=auto, " if resumable else ""
    raise UserError(
        f"output_dir={output_dir} already holds a run ({_few(own)}); {hint}"
        "start over with overwrite=true (deletes it), or choose another output_dir"
    )


def remove_run(output_dir: Path) -> None:
    """overwrite=true, main process only, after check_output_dir: delete the run's own entries.

    Entry by entry rather than the whole folder, so that nothing the toolkit did not write can
    go with it, even a file that appeared after the check.
    """
    if not output_dir.is_dir():
        return
    for entry in output_dir.iterdir():
        if entry.name not in RUN_ENTRIES:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class StopRequest:
    """SIGTERM/SIGUSR1 (cluster preemption, `scancel`, a time limit) ask the run to stop cleanly.

    The handler only sets a flag; the loop checks it once per optimizer step, agreed across
    ranks (a rank that saw no signal must still stop with the others), saves a checkpoint and
    exits, so `resume=auto` continues where the run was stopped.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signal: int | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


class Stopped(Exception):
    """Raised after the stop checkpoint is saved; the recipe exits with a non-zero code."""
