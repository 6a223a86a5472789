"""Resuming under another strategy or world size: a checkpoint converted once into its state by parameter name
(toolkit.strategy.by_name), by the main process alone (no launcher), while the others wait; the checkpoint is
left untouched, and the conversion reused by a later resume of it. Every file is read by the weights-only
unpickler (toolkit.strategy.unpickling), even where DeepSpeed's tools ask for weights_only=False. Every rank
then loads it with its strategy's own setters (each format's `load_into`). Not convertible, in one line
(UserError): a DeepSpeed JSON with its own optimizer or scheduler on either side (that state is DeepSpeed's,
not the recipe's AdamW and schedule), DeepSpeed without ZeRO (stage 0: ds_to_universal reads ZeRO partitions
only), a DDP checkpoint older than the names.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from toolkit.checkpoint.formats import Checkpoint, gather_full_weights, saved_by
from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import STATE_FILE, converted_state
from toolkit.run.manifest import crc32
from toolkit.run.writes import failed_write
from toolkit.strategy.by_name import MOMENTS, OPTIMIZER, VERSION, WEIGHTS
from toolkit.strategy.families import FILES
from toolkit.strategy.unpickling import not_only_numbers, numbers_only_torch_load


def convert(checkpoint: Checkpoint, into: Path) -> None:
    """Write the checkpoint's state by parameter name into the new folder `into`."""
    folder, saved = checkpoint.folder, checkpoint.layout
    format = saved_by(folder)
    if saved is None or format is None:
        raise UserError(f"checkpoint {folder} holds no strategy's files; it cannot be converted")
    _check_convertible(folder, format, saved)
    into.mkdir(parents=True)
    log = io.StringIO()  # what DeepSpeed's converters print, shown only if they fail
    try:
        with (
            numbers_only_torch_load(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log),
            tempfile.TemporaryDirectory(dir=into) as scratch,
        ):
            moments, steps = FILES[format].moments(folder, Path(scratch))
            (into / WEIGHTS).mkdir()
            gather_full_weights(format, folder, into / WEIGHTS)
    except (UserError, OSError):
        raise
    except pickle.UnpicklingError as exc:
        raise UserError(not_only_numbers(f"checkpoint {folder}", exc)) from None
    except Exception as exc:
        raise RuntimeError(f"converting {folder} failed: {exc}\n--- its tools printed:\n{log.getvalue()[-3000:]}") from exc
    for key in MOMENTS:
        save_file({name: m[key].float().contiguous() for name, m in moments.items()}, into / f"{key}.safetensors")
    (into / OPTIMIZER).write_text(json.dumps({
        "version": VERSION,
        "source": {"folder": str(folder), "layout": saved.record(), "state_crc32": crc32(folder / STATE_FILE)},
        "steps": steps,
    }, indent=1))


def _check_convertible(folder: Path, format: str, saved: ParallelLayout) -> None:
    where = f"checkpoint {folder} ({saved.describe()})"
    if not (folder / "custom_checkpoint_0.pkl").is_file():
        raise UserError(f"{where} holds no LR schedule of the recipe's (custom_checkpoint_0.pkl), so it cannot be "
                        f"converted for another strategy or world size; resume it under {saved.describe()}")
    refuses = getattr(FILES[format], "refuses_conversion", None)
    if refuses is not None and (why := refuses(folder, saved)):
        raise UserError(f"{where}{why}")


def cached_conversion(checkpoint: Checkpoint) -> tuple[Path, bool]:
    """(the checkpoint converted, whether it was already): made beside it, or reused when it was made from
    this very checkpoint (its state file's CRC), in one rename so that a crash leaves none."""
    folder = checkpoint.folder
    target = converted_state(folder)
    source = crc32(folder / STATE_FILE)
    if target.is_dir():
        try:
            made = json.loads((target / OPTIMIZER).read_text())
            if made["version"] == VERSION and made["source"]["state_crc32"] == source:
                return target, True
        except (OSError, ValueError, KeyError, TypeError):
            pass
        shutil.rmtree(target)
    partial = target.with_name(target.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        convert(checkpoint, partial)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        cause = failed_write(exc)  # whatever the writer raised (toolkit.run.writes): an OSError, a SafetensorError...
        if cause is None:
            raise
        if isinstance(exc, OSError) and exc.strerror and exc.filename:
            cause = f"{exc.strerror}: {exc.filename}"
        raise UserError(f"checkpoint {folder} could not be converted into {target} ({cause}); copy the checkpoint "
                        "into a writable folder with room for its weights and Adam state") from None
    partial.rename(target)
    return target, False
