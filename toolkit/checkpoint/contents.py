"""What a checkpoint holds, stated once: each family's own parts (PARTS in toolkit.strategy.<family>.files: the
tensors, Accelerate's save_state or a pipeline's stage files) and those every family's checkpoint holds (COMMON:
the schedule, random states, a stream's position, the model files, the manifest and the TrainerState, written last).
tests/toolkit/checkpoint/test_contents.py walks a checkpoint of every family against it, and export reads the parts
that hold the weights (`weight_files`)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

from toolkit.checkpoint.formats import saved_by
from toolkit.run.folder import MODEL_FILES
from toolkit.strategy.families import FILES
from toolkit.strategy.family import Part

COMMON: tuple[Part, ...] = (
    Part("schedule", ("custom_checkpoint_0.pkl",),
         "Accelerate's save_state: the LR schedule registered for checkpointing", "Accelerate's load_state; a "
         "conversion loads it itself (manager._load_schedule)"),
    Part("random states", ("random_states_*.pkl",),
         "Accelerate's save_state: each rank's generators (dropout)", "Accelerate's load_state; a conversion, by rank"),
    Part("stream position", ("stream_*.npz",),
         "the trainer's rank_files: each data rank's place in its stream (data.streaming)",
         "checkpoint.resume's rank_files", always=False),
    Part("model files", (f"{MODEL_FILES}/*",),
         "toolkit.export.hf_folder.write_model_files: config, generation config, tokenizer (a LoRA's adapter "
         "config; a GGUF base's base_model.json)", "export, and a resume's check of the model's shape", weights=True),
    Part("manifest", ("manifest.json",),
         "save_checkpoint, after every rank's files: each file's size and CRC-32", "a resume's integrity check"),
    Part("state", ("trainer_state.json",),
         "TrainerState.write, last: its presence marks the checkpoint complete", "Checkpoint.read, once per resume"),
)


# every part of the checkpoints of each family's files (a key of toolkit.strategy.families.FILES)
PARTS: dict[str, tuple[Part, ...]] = {name: (*module.PARTS, *COMMON) for name, module in FILES.items()}


def weight_files(files: str) -> tuple[str, ...]:
    """The patterns of what an export of a checkpoint of `files` reads: the weights and the model files."""
    return tuple(pattern for part in PARTS[files] if part.weights for pattern in part.files)


def against_parts(folder: Path) -> list[str]:
    """What in checkpoint `folder` departs from PARTS: a file no part of its family names, a part it lacks."""
    family = saved_by(folder)
    if family is None:
        return [f"{folder} holds no strategy's files"]
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    parts = PARTS[family]
    found = [f"{name}: a file no part of a {family} checkpoint names" for name in sorted(files)
             if not any(fnmatch(name, pattern) for part in parts for pattern in part.files)]
    return found + [f"{part.name} ({', '.join(part.files)}): missing" for part in parts
                    if part.always and not any(fnmatch(name, pattern) for name in files for pattern in part.files)]
