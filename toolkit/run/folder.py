"""The run folder: where a run's outputs live (one contract for the trainer, the recipes, checkpoints, the
HF-folder writer and export; nothing else in the toolkit spells these names or parses `step-N`).

    runs/NAME/ (RunDir): checkpoints/step-N/ (its trainer_state.json written last: complete),
    checkpoints/step-N.converted/, final/, adapter/, metrics.jsonl, samples.md, reference_logps.npz, .run.lock, ...

The tree, with what each entry holds: docs/internals.md, toolkit/run/folder.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.run.lock import HELD, LOCK_FILE, OwnerLock, in_use

STATE_FILE = "trainer_state.json"
PRUNED = ".deleting"  # step-N.deleting: out of rotation, on its way out (a crash may leave it)
CONVERTED = ".converted"  # step-N.converted: step-N's state by parameter name, for another strategy
MODEL_FILES = "model_files"  # config, tokenizer (and a LoRA's adapter config) beside the weights
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PRUNED_DIR = re.compile(rf"^step-\d+({re.escape(CONVERTED)})?{re.escape(PRUNED)}$")
# the longest path a run writes below output_dir, with room to spare (a DeepSpeed shard of a
# checkpoint with a 9-digit step: checkpoints/step-N.converted/pytorch_model/zero_pp_rank_…)
DEEPEST_ENTRY = 160


def checkpoint_step(folder: Path) -> int | None:
    """N for a folder named step-N, else None."""
    m = _STEP_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def is_complete(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def converted_state(folder: Path) -> Path:
    """Where checkpoint `folder`'s state by parameter name is kept once it was converted to resume
    under another strategy or world size: beside it, named so that nothing takes it for a checkpoint."""
    return folder.with_name(folder.name + CONVERTED)


class RunFinished(Exception):
    """resume=auto on a run that trained all its train.max_steps and wrote its outputs: nothing to do, exit code 0;
    the message says what would train more."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # Every top-level entry the toolkit writes (final.tmp/.old and adapter.tmp/.old are left by
    # replace_folder when a crash interrupts it; tensorboard/ is Accelerate's tracker under project_dir).
    # overwrite=true deletes these, nothing else.
    ENTRIES = (
        "final", "adapter", "checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "samples.md",
        "final.tmp", "adapter.tmp", "final.old", "adapter.old", "reference_logps.npz", "reference_logps.npz.tmp",
        "profile", "harness", "base", "base.tmp", "base.old",
    )

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def base(self) -> Path:  # a GGUF base's float copy, kept with the run: what its adapter and --base load
        return self.root / "base"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def samples(self) -> Path:
        return self.root / "samples.md"

    @property
    def reference(self) -> Path:
        """DPO's reference log-probabilities of the run's pairs (toolkit.training.reference)."""
        return self.root / "reference_logps.npz"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def profile(self) -> Path:
        """logging.profile's trace and summary (toolkit.training.profiling)."""
        return self.root / "profile"

    @property
    def harness(self) -> Path:
        """eval.harness_tasks' scorings: their JSON, their output, the model being scored (toolkit.training.harness_runs)."""
        return self.root / "harness"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = []
        if self.checkpoints.is_dir():
            for child in self.checkpoints.iterdir():
                step = checkpoint_step(child)
                if step is not None and is_complete(child):
                    found.append((step, child))
        return [p for _, p in sorted(found)]

    def drop_pruned(self) -> None:
        """Main process: finish the deletions of pruned checkpoints that a crash interrupted."""
        if self.checkpoints.is_dir():
            for leftover in self.checkpoints.glob(f"step-*{PRUNED}"):
                if _PRUNED_DIR.match(leftover.name) and not leftover.is_symlink():  # only what rotation renamed
                    shutil.rmtree(leftover)

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    @classmethod
    def of_checkpoint(cls, folder: Path) -> RunDir | None:
        """The run a checkpoints/step-N folder belongs to, if it sits in one."""
        return cls(folder.parent.parent) if folder.parent.name == "checkpoints" else None

    # ------------------------------------------------------------- what may be replaced
    def entries(self) -> tuple[list[str], list[str]]:
        """(the run's own entries in ENTRIES order, the others sorted) at the top of the folder.

        Folders end in `/`."""
        own, foreign = [], []
        if self.root.is_dir():
            for entry in sorted(self.root.iterdir()):
                if entry.name == LOCK_FILE:
                    continue
                name = entry.name + ("/" if entry.is_dir() else "")
                (own if entry.name in self.ENTRIES else foreign).append(name)
        own.sort(key=lambda name: self.ENTRIES.index(name.rstrip("/")))
        return own, foreign

    def check(self, resume: str | None, overwrite: bool, launch: str | None = None, main: bool = True) -> None:
        """Refuse anything that would lose what is in the folder; every rank, before any work.

        A run's own outputs are replaced only by newer outputs of the same run (resume from its
        newest complete checkpoint, or overwrite=true), and nothing else is ever deleted.
        With `launch` (the launch's identity), the folder is first claimed for it (`claim`): two
        runs started at once into one folder would otherwise both find it free.
        """
        out = self.root
        check_path_length("output_dir", out, DEEPEST_ENTRY)
        if out.exists() and not out.is_dir():
            raise UserError(f"output_dir={out} is a file, not a folder; choose another output_dir")
        self.check_writable()
        if launch is not None:
            self.claim(launch, main)
        try:
            self._check_entries(resume, overwrite)
        except UserError:
            self.release()  # refused: the folder is left as it was found
            raise

    def _check_entries(self, resume: str | None, overwrite: bool) -> None:
        out = self.root
        own, foreign = self.entries()
        if not own and not foreign:
            return  # missing or empty: a fresh start
        resumable = bool(self.complete_checkpoints())
        if resume and resume != "auto":
            return  # an explicit checkpoint: resolve_resume checks it
        if resume == "auto" and resumable:
            return
        if foreign:
            hint = "continue the run there with resume=auto, or " if own and resumable else ""
            raise UserError(
                f"output_dir={out} holds files that are not a toolkit run ({_few(foreign)}); "
                f"the toolkit will not delete them or start a run among them; {hint}choose another output_dir"
            )
        if overwrite or resume == "auto" and self.died_before_first_checkpoint():
            return
        if resume == "auto":
            raise UserError(
                f"output_dir={out} holds a run ({_few(own)}) but no complete checkpoint to continue "
                "from, so resume=auto would start over and replace it; start that run over with "
                "overwrite=true (deletes it), or choose another output_dir"
            )
        finished = self.finished_at()
        keep = ("to keep it and train on, raise train.max_steps with resume=auto" if finished is not None else
                "to keep it and continue, resume=auto" if resumable else "")
        raise UserError(
            f"output_dir={out} already holds a {f'finished run of {finished} steps' if finished is not None else 'run'} "
            f"({_few(own)}); {keep}{'; ' if keep else ''}to start over, overwrite=true (deletes it); or choose another "
            "output_dir"
        )

    # ------------------------------------------------------------- one owner at a time
    def claim(self, launch: str, main: bool) -> None:
        """Make this launch the folder's one owner, or refuse: another run holds it.

        The launch's main process takes the lock file's lock and holds it until `release` or its
        death: the kernel drops it then, so a killed run leaves no stale lock (the file may stay;
        a file nobody holds locks nothing). An open file description lock (F_OFD_SETLK), which
        like flock belongs to the open file and not to a pid, because unlike flock it can be
        tested without being taken: the launch's other ranks test it and read whose it is, so
        that a rank of a second launch refuses too instead of waiting for its main process.
        """
        if main:
            if self.root.absolute() not in HELD:  # a second Trainer of this process: already its owner
                HELD[self.root.absolute()] = OwnerLock.take(self.root, launch)
            return
        holder = OwnerLock.holder(self.root)
        if holder is not None and holder.get("launch") != launch:
            raise UserError(in_use(self.root, holder))

    def release(self) -> None:
        """Give the folder up (the run is over, or was refused); a no-op where it holds no lock."""
        lock = HELD.pop(self.root.absolute(), None)
        if lock is not None:
            lock.release()

    def finished_at(self, outputs: tuple[Path, ...] = ()) -> int | None:
        """The step a run in this folder finished at: each of its `outputs` (by default either of final/ and adapter/)
        was written from the training of its newest complete checkpoint (their training_summary.json's last trained
        step is the checkpoint's); None for a run stopped before its outputs, or extended past them."""
        newest = self.latest_checkpoint()
        if newest is None:
            return None
        step = checkpoint_step(newest)
        delivered = [_trained(p) == step for p in outputs or (self.final, self.adapter)]
        return step if (all(delivered) if outputs else any(delivered)) else None

    def check_unfinished(self, cfg) -> None:
        """resume=auto on a finished run (RunFinished) when train.max_steps asks for no step more (a run of
        train.epochs knows its steps once its data is packed); a run missing one of its outputs makes it again."""
        adapter = getattr(cfg, "adapter", None)  # a fine-tune's: adapter/, and final/ where it is merged
        lora = adapter is not None and adapter.is_lora
        outputs = (self.adapter,) * lora + (self.final,) * (not lora or adapter.merge)
        step = self.finished_at(outputs) if cfg.resume == "auto" and cfg.train.epochs is None else None
        if step is None or cfg.train.max_steps > step:
            return
        written = " and ".join(f"{p.name}/" for p in outputs)
        raise RunFinished(
            f"{self.root} is finished: it trained its {step} steps and wrote {written}; nothing is left to train, so "
            f"nothing ran. To train on, raise train.max_steps (e.g. train.max_steps={2 * step}) with resume=auto; to "
            f"start over from the base, overwrite=true (deletes the run) or another output_dir"
        )

    def died_before_first_checkpoint(self) -> bool:
        """The folder holds only what a run writes before its first complete checkpoint (metrics,
        trackers, an interrupted save): nothing a fresh start would lose, so resume=auto starts it
        over. A deliverable (final/, adapter/) without a checkpoint is never replaced this way."""
        own, foreign = self.entries()
        delivered = {"final/", "adapter/", "final.old/", "adapter.old/"}
        return bool(own) and not foreign and not self.complete_checkpoints() and not delivered & set(own)

    def check_writable(self) -> None:
        """Refuse a folder that cannot be created or written, before the launch and any data work
        (the trainer creates it only after the launch). Leaves nothing behind: a temporary file
        (unnamed where the OS allows) in the folder, or in its nearest existing parent, asks the
        OS itself, which also answers for root, read-only mounts and /proc, where permission bits
        say nothing."""
        out = self.root
        probe, refused = nearest_folder(out, itself=True)
        if refused is None:
            return
        if isinstance(refused, NotADirectoryError):
            raise UserError(f"output_dir={out} cannot be created: {probe} is a file, not a folder; choose another output_dir")
        if probe == out:
            raise UserError(f"output_dir={out} is not writable ({refused.strerror}); choose a writable output_dir")
        raise UserError(f"output_dir={out} cannot be created: {probe} does not accept new entries ({refused.strerror}); "
                        "choose a writable output_dir")

    def remove_own(self) -> None:
        """overwrite=true, main process only, after check(): delete the run's own entries.

        Entry by entry rather than the whole folder, so that nothing the toolkit did not write can
        go with it, even a file that appeared after the check.
        """
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name not in self.ENTRIES:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def resolve_resume(self, resume: str | None) -> Path | None:
        """`None` -> fresh start; `auto` -> newest complete checkpoint (or fresh); a path -> that one."""
        if not resume:
            return None
        if resume == "auto":
            return self.latest_checkpoint()
        path = Path(resume)
        check_path_length("resume", path)
        if not os.path.lexists(path):  # a step rotated away (checkpoint.keep_last), or mistyped: say what is there
            there = sorted((p for p in path.parent.iterdir() if checkpoint_step(p) is not None and is_complete(p)),
                           key=checkpoint_step) if path.parent.is_dir() else []
            if there:
                raise UserError(f"resume={resume} does not exist; {path.parent} holds {', '.join(p.name for p in there)} "
                                "(checkpoint.keep_last keeps the newest); give one of them, or resume=auto")
            raise UserError(f"resume={resume} does not exist; give a checkpoints/step-N folder or resume=auto")
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


def nearest_folder(path: Path, itself: bool = False) -> tuple[Path, OSError | None]:
    """The nearest path at or above `path` (`itself` or its parents) that exists, and why it cannot take new entries:
    NotADirectoryError for a file, the OS's own error (asked with an unnamed temporary file: it also answers for root,
    read-only mounts and /proc, where permission bits say nothing), or None where it can."""
    probe = next((p for p in ((path, *path.parents) if itself else path.parents) if p.exists()), Path("."))
    if not probe.is_dir():
        return probe, NotADirectoryError(probe)
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return probe, exc
    return probe, None


def replace_folder(new: Path, target: Path) -> Path:
    """Put the finished folder `new` at `target` with renames only, so that a crash at any moment
    leaves `target` whole (the old one or the new one) or absent, never half deleted; a previous
    `target` goes to `target.old` first and is deleted last."""
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def _trained(output: Path) -> int | None:
    """The last step trained into final/ or adapter/ (its training_summary.json), None where it cannot be read."""
    try:
        facts = json.loads((output / "training_summary.json").read_text())
    except (OSError, ValueError):
        return None
    return facts.get("trained_steps", facts.get("step")) if isinstance(facts, dict) else None


def _looks_like_checkpoint(folder: Path) -> bool:
    return checkpoint_step(folder) is not None or any(folder.glob("optimizer*")) or any(folder.glob("random_states*"))


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_path_length(key: str, path: Path, deeper: int = 0) -> None:
    """Refuse a path the system cannot hold, with `deeper` bytes more below it: a folder name over
    the filesystem's NAME_MAX (255 bytes on most), or the whole over PATH_MAX (4096 on Linux);
    the OS would fail on the first file written, deep inside a step. Bytes, as the OS counts them
    (an accented letter takes two)."""
    existing = next((p for p in (path.absolute(), *path.absolute().parents) if _exists(p)), Path("/"))
    name_max = os.pathconf(existing, "PC_NAME_MAX") if existing.is_dir() else 255
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise UserError(
                f"{key}={_cut(str(path))} has a folder name of {len(os.fsencode(part))} bytes ({_cut(part, 24)}); "
                f"this filesystem allows at most {name_max}: choose a shorter name"
            )
    path_max = os.pathconf(existing, "PC_PATH_MAX") if existing.is_dir() else 4096
    size = len(os.fsencode(str(path.absolute())))
    if size + deeper >= path_max:
        below = f" and the run writes up to {deeper} more below it (checkpoints/step-N/…)" if deeper else ""
        raise UserError(
            f"{key}={_cut(str(path))} is {size} bytes long{below}, over this system's limit of {path_max} for a "
            "path: choose a shorter one"
        )


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long: not there
        return False


def _cut(text: str, keep: int = 60) -> str:
    return text if len(text) <= keep else f"{text[: keep // 2]}…{text[-keep // 2 :]}"


def release_all() -> None:
    """Give up every run folder this process holds (its run is over, whichever way it ended)."""
    for root in list(HELD):
        RunDir(root).release()
