"""The one rule for reading a checkpoint's pickled files: numbers only.

torch.load with weights_only=False runs whatever code a tampered file names, and DeepSpeed's engine,
its converters and Accelerate's custom-state loader all pass it. Every checkpoint file a resume reads
goes through `load` instead: tensors, numbers, strings, containers and DeepSpeed's three
classes below, nothing else (pickle.UnpicklingError). The two context managers put `load` in
place of the other libraries' calls while they read a checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
from pathlib import Path

import torch

from toolkit.config.errors import UserError

# DeepSpeed's own classes inside its checkpoint files: an enum, the loss scaler's attributes and a
# dataclass of offsets. Allowed by name, they are rebuilt as data; nothing they name runs code.
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def allowed_classes() -> list[type]:
    """DEEPSPEED_CLASSES as classes ([] without DeepSpeed installed: no DeepSpeed file can then be read anyway)."""
    allowed = []
    for name in DEEPSPEED_CLASSES:
        module, _, attr = name.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), attr))
        except ImportError:
            return []
    return allowed


def load(file, map_location="cpu", **kwargs):
    """torch.load of a checkpoint file, numbers only."""
    kwargs["weights_only"] = True
    with torch.serialization.safe_globals(allowed_classes()):
        return torch.load(file, map_location=map_location, **kwargs)


def numbers(file: Path):
    """`load`, with a file that pickles anything else refused in one line (UserError)."""
    try:
        return load(file)
    except pickle.UnpicklingError as exc:
        raise UserError(not_only_numbers(file, exc)) from None


def not_only_numbers(where: str | Path, exc: Exception) -> str:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    what = f" ({found.group(1)})" if found else ""
    return (
        f"{where} holds pickled objects beyond tensors and numbers{what}; the toolkit never unpickles "
        "those (they can run code): resume from a checkpoint the toolkit wrote"
    )


@contextlib.contextmanager
def numbers_only_resume():
    """Accelerate's load_state reading a checkpoint: DeepSpeed's engine files and the registered
    objects (the LR schedule) through `load`. Its random states keep Accelerate's own reader, which
    allows numpy's generator state and nothing beyond it."""
    import accelerate.accelerator as accelerator_module

    def load_custom_state(obj, path: str, index: int = 0) -> None:
        obj.load_state_dict(numbers(Path(path) / f"custom_checkpoint_{index}.pkl"))

    def engine_load(self, path: str, map_location=None):
        return load(path, map_location=map_location)

    try:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    except ImportError:
        TorchCheckpointEngine = None
    real_custom = accelerator_module.load_custom_state
    accelerator_module.load_custom_state = load_custom_state
    if TorchCheckpointEngine is not None:
        real_engine, TorchCheckpointEngine.load = TorchCheckpointEngine.load, engine_load
    try:
        yield
    finally:
        accelerator_module.load_custom_state = real_custom
        if TorchCheckpointEngine is not None:
            TorchCheckpointEngine.load = real_engine


@contextlib.contextmanager
def numbers_only_torch_load():
    """Every torch.load in here through `load`: DeepSpeed's converters (zero_to_fp32, ds_to_universal)
    read with torch.load itself, passing weights_only=False."""
    real = torch.load
    allowed = allowed_classes()

    def numbers_only(f, map_location=None, *args, weights_only=True, **kwargs):
        with torch.serialization.safe_globals(allowed):
            return real(f, map_location, *args, weights_only=True, **kwargs)

    torch.load = numbers_only
    try:
        yield
    finally:
        torch.load = real
