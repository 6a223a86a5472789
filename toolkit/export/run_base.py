"""`--from RUN --base`: the base a fine-tune started from, as export, chat and evaluate take it.

A fine-tune records what loads its base alone in base_model.json (`loads_from`: a hub id, a folder, or for a GGUF base
the float copy the run keeps in its base/), in its adapter/ and in each checkpoint's model files. `--base FOLDER`
keeps its older meaning: the folder a LoRA adapter merges into.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.run.folder import MODEL_FILES, RunDir
from toolkit.run.paths import is_run

RUN_BASE = "\0the run's base"  # --base given without a folder: what argparse's const holds
BASE_HELP = ("with --from RUN alone: the base that run was fine-tuned from; with a FOLDER: the base model folder of a "
             "LoRA adapter, when the adapter does not name it")


def add_base_option(parser) -> None:
    parser.add_argument("--base", nargs="?", const=RUN_BASE, metavar="FOLDER", help=BASE_HELP)


def take_run_base(args) -> None:
    """`--from RUN --base` made `--from` the run's base (in `args`); any other --base left as it is."""
    if args.base != RUN_BASE:
        return
    if getattr(args, "checkpoint", None):
        raise UserError("--base takes the run's base, which has no checkpoints; leave out --checkpoint, or give "
                        "--base FOLDER for the base an adapter merges into")
    args.source, args.base = run_base(Path(args.source)), None


def run_base(run: Path) -> str:
    """The folder the base of the fine-tune in `run` loads from; one line where there is none here."""
    if not is_run(run):
        owner = next((p for p in run.parents if is_run(p)), None)  # its adapter/, final/ or a checkpoint
        give = f"give --from {owner}" if owner is not None else "give --from the run (e.g. runs/ft)"
        what = "does not exist" if not run.exists() else "is not a run folder"
        raise UserError(f"--from {run} --base: {run} {what}; --base alone names a fine-tune's base, {give}")
    from toolkit.models.adapter import BASE_MODEL_FILE  # imports peft: only when a base is asked for
    from toolkit.models.gguf_base import HUB_ID

    folders = RunDir(run)
    if (folders.base / "config.json").is_file():
        return str(folders.base)
    recorded = [folders.adapter / BASE_MODEL_FILE, *(c / MODEL_FILES / BASE_MODEL_FILE
                                                     for c in reversed(folders.complete_checkpoints()))]
    found = next((p for p in recorded if p.is_file()), None)
    if found is None:
        raise UserError(f"--from {run} --base: the run records no base (a pretraining run, or a fine-tune without "
                        "adapter/ or checkpoints); give --from the base's folder")
    saved = json.loads(found.read_text())
    if not saved.get("loads_from") and (saved.get("gguf_file") or not saved.get("path") or
                                        str(saved.get("path")).endswith(".gguf")):
        return _float_copy(run, saved)
    named = saved.get("loads_from") or saved.get("path")
    if named and Path(named).expanduser().is_dir():
        return named
    if not HUB_ID.match(str(named)):
        raise UserError(f"--from {run} --base: its base folder {named} does not exist here; give --from where it is now")
    raise UserError(f"--from {run} --base: its base is the hub id {named}, not a folder here: download it "
                    f"(huggingface-cli download {named} --local-dir DIR) and give --from DIR")


def _float_copy(run: Path, saved: dict) -> str:
    """A GGUF base whose float copy the run did not keep (model.gguf_cache=false): the copy the toolkit's cache holds,
    made now where it holds none (the GGUF dequantised, as the fine-tune did; export and evaluate take a folder)."""
    from toolkit.models.base_model import BaseModelConfig
    from toolkit.models.gguf_base import cache_folder, dequantise, resolve_gguf

    cfg = BaseModelConfig(**{k: v for k, v in saved.items() if k in BaseModelConfig.__dataclass_fields__})
    cfg.gguf_cache, cfg.dtype = True, "float32"
    gguf = resolve_gguf(cfg)
    cached = cache_folder(cfg, gguf) if gguf is not None else None
    if cached is not None and not (cached / "config.json").is_file():
        print(f"--from {run} --base: the run kept no float copy of its GGUF base {gguf.name} (model.gguf_cache=false); "
              f"dequantising it into {cached}", file=sys.stderr, flush=True)
        dequantise(cfg, gguf)
    if cached is None or not (cached / "config.json").is_file():
        raise UserError(f"--from {run} --base: its base is the GGUF {gguf}, whose float copy could not be written into "
                        f"{cfg.resolved_cache_dir()}; free space there, or chat --from {gguf}")
    return str(cached)
