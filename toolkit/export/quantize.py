"""Int8 and int4 weight-only copies of an HF model folder that `from_pretrained` loads back on CPU.

Quantisation goes through transformers' `TorchAoConfig`, so the saved folder carries its `quantization_config`
and loads with plain `AutoModelForCausalLM.from_pretrained(folder)` wherever torchao is installed. int4 is int4
precision at int8 size (torchao's one int4 layout that saves and runs on CPU); embeddings and the output head
stay in the source dtype. Quantisation runs on CPU; the folder runs on the devices in `DEVICES`.
Why these configs, and the perplexities measured: docs/internals.md, toolkit/export/quantize.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from packaging.version import Version

from toolkit.config.errors import UserError, first_line
from toolkit.run.folder import replace_folder

TORCHAO_MIN = "0.16"  # Int8Tensor (int8 weight-only) is safetensors-serialisable from 0.16
INSTALL = "pip install 'llm-toolkit[quant]' (or pip install 'torchao>=0.16')"
INT4_GROUP = 32  # int4 scale/zero per 32 input features: divides LLaMA/Qwen/SmolLM widths
INT8_IN_INT4 = ("v_proj", "down_proj")  # linears kept int8 in the int4 scheme (see module doc)


@dataclass(frozen=True)
class Scheme:
    what: str  # one line for the log and the README
    devices: tuple[str, ...]  # torch device types the saved folder runs on


SCHEMES = {
    "int8": Scheme(
        "int8 weight-only (torchao Int8WeightOnlyConfig: symmetric, one scale per output row)",
        ("cpu", "cuda"),
    ),
    "int4": Scheme(
        f"int4 weight-only (torchao IntxWeightOnlyConfig: asymmetric, groups of {INT4_GROUP}), "
        "v_proj/down_proj int8; int4 values stored one per byte",
        ("cpu", "cuda"),
    ),
}
HF_QUANTS = tuple(SCHEMES)  # ("int8", "int4")
DEVICES = {name: s.devices for name, s in SCHEMES.items()}


def devices(scheme: str) -> tuple[str, ...]:
    """Torch device types a folder quantised with `scheme` loads and generates on."""
    return _scheme(scheme).devices


def check_device(scheme: str, device: str | torch.device) -> None:
    """Raise a UserError if `scheme` cannot run on `device` (e.g. "cuda:0", "mps")."""
    kind = torch.device(device).type
    s = _scheme(scheme)
    if kind not in s.devices:
        raise UserError(
            f"quantization {scheme} runs on {' or '.join(s.devices)}, not on {kind}; "
            f"load it on {s.devices[0]}, or export an unquantised folder for {kind}"
        )


def quantize_folder(model_dir: Path, out_dir: Path, scheme: str) -> tuple[Path, list[str]]:
    """Quantise the HF causal-LM folder `model_dir` into `out_dir`; returns (out_dir, notes).

    `out_dir` gets the safetensors weights (with torchao's tensor metadata), config.json with
    the `quantization_config`, generation_config.json and the tokenizer. It is written to a
    hidden sibling and renamed into place, so it is either complete or absent.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    s = _scheme(scheme)
    check_device(scheme, "cpu")  # where quantisation itself runs
    _require_torchao()
    config = _read_config(model_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise UserError(f"the quantised copy would overwrite its source {model_dir}; give another out_dir")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise UserError(f"{out_dir} exists and is not a model folder; give an empty or new out_dir")

    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    quant_type, int8_fallback = _quant_type(scheme, model_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype="auto", device_map="cpu", quantization_config=TorchAoConfig(quant_type)
            )
        except (OSError, ValueError, RuntimeError, ImportError) as exc:
            raise UserError(
                f"{model_dir} could not be quantised to {scheme} on cpu ({first_line(exc)}); "
                f"{scheme} needs {' or '.join(s.devices)} and a LLaMA-style model with nn.Linear layers"
            ) from None
        quantised, kept = _split_linears(model)
        if not quantised:
            raise UserError(
                f"{model_dir} ({config.get('model_type')}) has no nn.Linear layer that torchao could quantise "
                "(GPT-2 uses Conv1D); export it unquantised or as a GGUF"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"{model_dir} has no usable tokenizer ({first_line(exc)}); save one into that folder"
            ) from None
        from toolkit.export.hf_folder import generate_with_cache

        generate_with_cache(model)
        model.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_folder(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir, _notes(s, model, quantised, kept, int8_fallback, model_dir, out_dir)


def _scheme(scheme: str) -> Scheme:
    if scheme not in SCHEMES:
        raise UserError(f"quantization {scheme!r} is not offered; choose one of {', '.join(HF_QUANTS)}")
    return SCHEMES[scheme]


def _require_torchao() -> None:
    try:
        have = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"int8/int4 export needs torchao, which is not installed; {INSTALL}") from None
    if Version(have) < Version(TORCHAO_MIN):
        raise UserError(f"int8/int4 export needs torchao>={TORCHAO_MIN}, found {have}; {INSTALL}")
    try:
        import torchao.quantization  # noqa: F401  (a torchao built for another torch fails here)
    except (ImportError, OSError, RuntimeError) as exc:
        raise UserError(
            f"torchao {have} does not import with torch {torch.__version__} ({first_line(exc)}); "
            "install the torchao release made for this torch"
        ) from None


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        hint = f"; use {model_dir / 'final'}" if (model_dir / "final" / "config.json").is_file() else ""
        raise UserError(f"{model_dir} has no config.json: give a Hugging Face model folder{hint}")
    config = json.loads(path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UserError(
            f"{model_dir} is already quantised ({method}); quantise the float folder it came from"
        )
    return config


def _quant_type(scheme: str, model_dir: Path):
    """The torchao config for `scheme`, and the linears int4 cannot group (they go int8)."""
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    # set_inductor_config=False: leave torch.compile's global settings alone in this process
    int8 = Int8WeightOnlyConfig(version=2, set_inductor_config=False)  # 2: Int8Tensor, safetensors-savable
    if scheme == "int8":
        return int8, []
    int4 = IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP), mapping_type=MappingType.ASYMMETRIC
    )
    linears = _meta_linears(model_dir)
    ungroupable = [name for name, m in linears if m.in_features % INT4_GROUP]
    leaves = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
    # exact names win over patterns; every linear is named (torchao deprecates a "_default" rule)
    rules = OrderedDict((name, int8) for name in ungroupable)
    for config, group in (
        (int8, [n for n in leaves if n in INT8_IN_INT4]),
        (int4, [n for n in leaves if n not in INT8_IN_INT4]),
    ):
        if group:
            rules[r"re:(.*\.)?(" + "|".join(map(re.escape, group)) + ")"] = config
    return FqnToConfig(rules), ungroupable


def _meta_linears(model_dir: Path) -> list[tuple[str, torch.nn.Linear]]:
    """The model's nn.Linear modules but its output head, built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    head = model.get_output_embeddings()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def _split_linears(model) -> tuple[dict[str, str], list[str]]:
    """({linear name: torchao tensor type}, [linear names left in float])."""
    quantised, kept = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            if type(weight) in (torch.Tensor, torch.nn.Parameter):
                kept.append(name)
            else:
                quantised[name] = type(weight).__name__
    return quantised, kept


def _notes(s: Scheme, model, quantised, kept, int8_fallback, model_dir: Path, out_dir: Path) -> list[str]:
    by_type: dict[str, int] = {}
    for kind in quantised.values():
        by_type[kind] = by_type.get(kind, 0) + 1
    dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    tied = getattr(model.config, "tie_word_embeddings", False)
    float_part = ["the input embedding"] + [
        f"{n} ({'tied to the embedding' if tied else 'output head'})" for n in kept
    ]
    notes = [
        f"quantised {len(quantised)} linear layers to {s.what} through transformers' TorchAoConfig "
        f"({', '.join(f'{n} {k}' for k, n in sorted(by_type.items()))})",
        f"kept in {dtype}: {', '.join(float_part)}: the embedding is a row lookup and the output head is "
        "where weight error shows most in the logits (transformers' torchao default)",
    ]
    if int8_fallback:
        notes.append(
            f"{len(int8_fallback)} linears have an input width that is not a multiple of {INT4_GROUP} "
            f"and went int8 instead of int4 (e.g. {int8_fallback[0]})"
        )
    notes.append(
        f"wrote {out_dir} ({_size(out_dir) / 1e6:.1f} MB of weights, source {_size(model_dir) / 1e6:.1f} MB) as "
        f"safetensors; it loads with AutoModelForCausalLM.from_pretrained on {' or '.join(s.devices)} "
        "where torchao is installed"
    )
    return notes


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
