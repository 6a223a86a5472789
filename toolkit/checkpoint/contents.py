"""What a checkpoint holds, stated in one place: each part, the files it is in, which formats' checkpoints hold it,
what writes it and what reads it back. tests/toolkit/checkpoint/test_contents.py walks a checkpoint of every format
against this table: a file no part names, or a part a checkpoint lacks, fails it.

The tensors are the strategy's own (Accelerate's save_state of the prepared model and optimizer, or a pipeline's
stage files); everything else is the toolkit's: the schedule (registered for checkpointing by
toolkit.training.optim), each rank's random states, a stream's position, the files that turn the weights back into a
model, the manifest, and the TrainerState (toolkit.checkpoint.trainer_state), written last.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from toolkit.checkpoint.formats import FORMATS, saved_by

EVERY = frozenset(FORMATS)


@dataclass(frozen=True)
class Part:
    name: str
    files: tuple[str, ...]  # glob patterns below the checkpoint folder
    formats: frozenset[str]  # the formats (toolkit.checkpoint.formats.FORMATS) whose checkpoints hold it
    written_by: str
    read_by: str
    always: bool = True  # False: only some runs write it (a streamed run's position)


PARTS: tuple[Part, ...] = (
    Part("weights", ("model.safetensors", "model_*.safetensors"), frozenset({"ddp"}),
         "Accelerate's save_state: the prepared model, whole", "Accelerate's load_state; ddp.full_weights"),
    Part("optimizer", ("optimizer.bin",), frozenset({"ddp"}),
         "Accelerate's save_state: AdamW's state, keyed by parameter order", "Accelerate's load_state; ddp.moments"),
    Part("parameter names", ("optimizer_param_names.json",), frozenset({"ddp"}),
         "save_checkpoint: which parameter each optimizer.bin number is", "ddp.moments (a conversion by name)"),
    Part("sharded weights and optimizer", ("pytorch_model_fsdp_0/*", "optimizer_0/*"), frozenset({"fsdp"}),
         "Accelerate's save_state under FSDP2: torch.distributed.checkpoint's shards", "Accelerate's load_state "
         "(resharded to any world size); fsdp.full_weights, fsdp.moments"),
    Part("ZeRO partitions", ("latest", "pytorch_model/*", "zero_to_fp32.py", "zero_to_torch.py"), frozenset({"deepspeed"}),
         "DeepSpeed's save_checkpoint: each rank's partition of the fp32 masters and Adam state",
         "DeepSpeed's load_checkpoint (same stage and world size); deepspeed.full_weights, deepspeed.moments"),
    Part("pipeline stages", ("pipeline_stage_*.safetensors", "pipeline_stage_*_optimizer.pt"), frozenset({"pipeline"}),
         "pipeline.save_stage: each stage's weights by whole-model name and its optimizer state",
         "pipeline.load_stage (the same cut); pipeline.full_weights, pipeline.moments"),
    Part("schedule", ("custom_checkpoint_0.pkl",), EVERY,
         "Accelerate's save_state: the LR schedule registered for checkpointing", "Accelerate's load_state; a "
         "conversion loads it itself (manager._load_schedule)"),
    Part("random states", ("random_states_*.pkl",), EVERY,
         "Accelerate's save_state: each rank's generators (dropout)", "Accelerate's load_state; a conversion, by rank"),
    Part("stream position", ("stream_*.npz",), EVERY,
         "the trainer's rank_files: each data rank's place in its stream (data.streaming)",
         "checkpoint.resume's rank_files", always=False),
    Part("model files", ("model_files/*",), EVERY,
         "toolkit.export.hf_folder.write_model_files: config, generation config, tokenizer (a LoRA's adapter "
         "config; a GGUF base's base_model.json)", "export, and a resume's check of the model's shape"),
    Part("manifest", ("manifest.json",), EVERY,
         "save_checkpoint, after every rank's files: each file's size and CRC-32", "a resume's integrity check"),
    Part("state", ("trainer_state.json",), EVERY,
         "TrainerState.write, last: its presence marks the checkpoint complete", "Checkpoint.read, once per resume"),
)


def against_parts(folder: Path) -> list[str]:
    """What in checkpoint `folder` departs from PARTS: a file no part of its format names, a part it lacks."""
    format = saved_by(folder)
    if format is None:
        return [f"{folder} holds no strategy's files"]
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    parts = [part for part in PARTS if format in part.formats]
    found = [f"{name}: a file no part of a {format} checkpoint names" for name in sorted(files)
             if not any(fnmatch(name, pattern) for part in parts for pattern in part.files)]
    return found + [f"{part.name} ({', '.join(part.files)}): missing" for part in parts
                    if part.always and not any(fnmatch(name, pattern) for name in files for pattern in part.files)]
