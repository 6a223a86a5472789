"""A checkpoint of another model is refused in one line: the shapes its saved config (and adapter config)
builds against this run's model's, before anything loads, and a mismatch that still reaches a loader translated."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from toolkit.config.errors import UserError
from toolkit.run.folder import MODEL_FILES


def check_same_model(folder: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose model_files/ config (and adapter config) give other parameter
    shapes than `model`'s; nothing to compare for a checkpoint without them or a model without a config."""
    files = folder / MODEL_FILES
    lora = hasattr(model, "peft_config")
    base = model.get_base_model() if lora else model
    if not (files / "config.json").is_file() or not isinstance(getattr(base, "config", None), PretrainedConfig):
        return
    saved_adapter = None
    if (files / "adapter_config.json").is_file():
        from peft import PeftConfig

        saved_adapter = PeftConfig.from_pretrained(str(files))
    saved = _shapes(AutoConfig.from_pretrained(files), saved_adapter)
    live = _shapes(base.config, model.peft_config["default"] if lora else None)
    found = _first_mismatch(saved, live)
    if found is not None:
        raise UserError(different_model(folder, found))


def _shapes(config: PretrainedConfig, adapter) -> dict[str, list[int]]:
    """Parameter name -> shape of the model a config (and adapter config) builds; on the meta
    device, so nothing is allocated whatever the model's size."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):  # QLoRA: compare the float architecture
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if adapter is not None:
            from peft import get_peft_model

            adapter = copy.deepcopy(adapter)
            adapter.base_model_name_or_path = None  # a meta copy: peft would warn that its base was renamed
            model = get_peft_model(model, adapter)
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _first_mismatch(saved: dict[str, list[int]], live: dict[str, list[int]]) -> tuple[str, str, str] | None:
    """(parameter, its shape in the checkpoint, in this model), in the live model's order."""
    for name, shape in live.items():
        if name not in saved:
            return name, "absent", str(shape)
        if saved[name] != shape:
            return name, str(saved[name]), str(shape)
    extra = next((name for name in saved if name not in live), None)
    return None if extra is None else (extra, str(saved[extra]), "absent")


_SIZE = re.compile(
    r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)
_MISSING = re.compile(r'Missing key\(s\) in state_dict: "([^"]+)"')
_UNEXPECTED = re.compile(r'Unexpected key\(s\) in state_dict: "([^"]+)"')


def first_mismatch_in(error: str) -> tuple[str, str, str] | None:
    """The first parameter that torch's load_state_dict refused, from its error text."""
    if m := _SIZE.search(error):
        return m.group(1), m.group(2), m.group(3)
    if m := _MISSING.search(error):
        return m.group(1), "absent", "present"
    if m := _UNEXPECTED.search(error):
        return m.group(1), "present", "absent"
    return None


def different_model(folder: Path, found: tuple[str, str, str]) -> str:
    name, saved, live = found
    return (
        f"checkpoint {folder} holds a different model: {name} is {saved} there and {live} in this run; "
        "resume with the model settings it was saved with, or start a new output_dir"
    )


