"""Resuming under another strategy or world size: a checkpoint as one state by parameter name.

A checkpoint holds what its strategy's `save_state` wrote for its world size: DDP one whole model
and an optimizer.bin keyed by integer ids, FSDP2 DCP shards, DeepSpeed ZeRO flat partitions, one
file per rank. To resume it under another strategy or world size it is converted once into the
state by parameter name, kept beside it (`step-N.converted/`, toolkit.run_dir.converted_state):

    weights/                 the full fp32 weights (formats.gather_full_weights: DDP's safetensors as
                             they are, FSDP's DCP files through dcp_to_torch_save, DeepSpeed's zero_to_fp32)
    exp_avg.safetensors      Adam's first and second moments of every trained parameter, by name
    exp_avg_sq.safetensors
    optimizer.json           Adam's step by name, and the checkpoint it was made from

Why this form: it is the only one every strategy can both produce with its own tools and consume
with its own setters. The two resharding tools that exist each cover one family:
torch.distributed.checkpoint reshards FSDP2/DTensor state (it reads neither DeepSpeed's partitions
nor DDP's id-keyed optimizer.bin), and DeepSpeed's universal checkpoint loads only into DeepSpeed.
Both serve here as readers:
- DDP / one process: optimizer.bin (torch's optimizer state dict), its ids named by the list the
  toolkit records at save time (formats.OPTIMIZER_NAMES); an older checkpoint without that list is
  refused rather than matched by guessing.
- FSDP2: optimizer_0/, the DCP save of `get_optimizer_state_dict` (keyed by name), read into one
  process with torch.distributed.checkpoint.format_utils.dcp_to_torch_save.
- DeepSpeed ZeRO-1/2/3: deepspeed.checkpoint.ds_to_universal (each parameter's fp32, exp_avg,
  exp_avg_sq, step; checked on CPU with DeepSpeed 0.19.8: all three stages, fp32 and bf16, and LoRA
  under ZeRO-2 and ZeRO-3).
Every file is read by torch's weights_only unpickler (DeepSpeed's own three classes allowed by name),
even where DeepSpeed's tools ask for weights_only=False. The LR schedule (custom_checkpoint_0.pkl)
and trainer_state.json hold no strategy and are read as they are.

The conversion runs in one process (the main rank, no launcher) while the others wait, leaves
the checkpoint untouched, and is reused by a later resume of the same checkpoint. Every rank then
loads it with its strategy's own setters (toolkit.checkpoint.loading).

Not convertible, in one line (UserError): a DeepSpeed JSON with its own optimizer or scheduler on
either side (that state is DeepSpeed's, not the recipe's AdamW and schedule), DeepSpeed without
ZeRO (stage 0: ds_to_universal reads ZeRO partitions only), a DDP checkpoint older than the names.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import tempfile
from argparse import Namespace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from toolkit.checkpoint.formats import (
    PIPELINE_OPTIMIZER,
    SavedLayout,
    deepspeed_config,
    deepspeed_tag_folder,
    gather_full_weights,
    pipeline_stage_files,
    read_optimizer_names,
    saved_by,
    saved_layout,
)
from toolkit.checkpoint.unpickling import load, not_only_numbers, numbers_only_torch_load
from toolkit.config import UserError
from toolkit.manifest import crc32
from toolkit.run_dir import STATE_FILE, converted_state

VERSION = 1
WEIGHTS = "weights"
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER = "optimizer.json"
# wrappers that torch.distributed.checkpoint leaves out of a parameter's name (torch.compile,
# activation checkpointing, FSDP1): the names are compared without them
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


# ---------------------------------------------------------------- conversion (one process)
def convert(folder: Path, into: Path) -> None:
    """Write checkpoint `folder`'s state by parameter name into the new folder `into`."""
    saved = saved_layout(folder)
    kind = saved_by(folder)
    if saved is None or kind is None:
        raise UserError(f"checkpoint {folder} holds no strategy's files; it cannot be converted")
    _check_convertible(folder, kind, saved)
    into.mkdir(parents=True)
    if kind == "deepspeed" and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's tools, not its engine: no device needed
    log = io.StringIO()  # what DeepSpeed's converters print, shown only if they fail
    try:
        with (
            numbers_only_torch_load(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log),
            tempfile.TemporaryDirectory(dir=into) as scratch,
        ):
            if kind == "ddp":
                moments, steps = _ddp_moments(folder)
            elif kind == "fsdp":
                moments, steps = _fsdp_moments(folder, Path(scratch))
            elif kind == "pipeline":
                moments, steps = _pipeline_moments(folder)
            else:
                moments, steps = _deepspeed_moments(folder, Path(scratch))
            (into / WEIGHTS).mkdir()
            gather_full_weights(kind, folder, into / WEIGHTS)
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
        "source": {"folder": str(folder), "strategy": saved.strategy, "world_size": saved.world_size,
                   "state_crc32": crc32(folder / STATE_FILE)},
        "steps": steps,
    }, indent=1))


def _check_convertible(folder: Path, kind: str, saved: SavedLayout) -> None:
    where = f"checkpoint {folder} ({saved.describe()})"
    if not (folder / "custom_checkpoint_0.pkl").is_file():
        raise UserError(f"{where} holds no LR schedule of the recipe's (custom_checkpoint_0.pkl), so it cannot be "
                        f"converted for another strategy or world size; resume it under {saved.describe()}")
    if kind != "deepspeed":
        return
    owned = [block for block in ("optimizer", "scheduler") if block in deepspeed_config(folder)]
    if owned:
        raise UserError(
            f"{where} was trained with the {' and '.join(owned)} its DeepSpeed JSON defines, whose state is "
            "DeepSpeed's own: it cannot be converted for another strategy or world size; resume it under "
            f"{saved.describe()} with the same DeepSpeed JSON"
        )
    if saved.layout == "zero0":
        raise UserError(f"{where}: DeepSpeed without ZeRO (stage 0) keeps no per-parameter state that DeepSpeed's "
                        f"converter reads; resume it under {saved.describe()}")


def _step(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _ddp_moments(folder: Path) -> tuple[dict, dict]:
    names = read_optimizer_names(folder)
    if names is None:
        raise UserError(
            f"checkpoint {folder} was saved before the toolkit recorded which parameter each of optimizer.bin's "
            "entries belongs to, so its Adam state cannot be moved to another strategy; resume it under DDP or one "
            "process (any number of processes)"
        )
    saved = load(folder / "optimizer.bin", mmap=True)
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise UserError(f"checkpoint {folder}: optimizer.bin and its parameter names disagree (another save's files)")
    moments, steps = {}, {}
    for group, group_names in zip(groups, names, strict=True):
        for index, name in zip(group["params"], group_names, strict=True):
            state = saved["state"].get(index)
            if state:  # no state: never stepped (no gradient yet)
                moments[name] = {key: state[key] for key in MOMENTS}
                steps[name] = _step(state["step"])
    return moments, steps


def _pipeline_moments(folder: Path) -> tuple[dict, dict]:
    """Each stage's optimizer state, by the whole-model names saved beside it."""
    moments, steps = {}, {}
    for stage in range(len(pipeline_stage_files(folder))):
        saved = load(folder / PIPELINE_OPTIMIZER.format(stage))
        optimizer = saved["optimizer"]
        for group, names in zip(optimizer["param_groups"], saved["parameter_names"], strict=True):
            for index, name in zip(group["params"], names, strict=True):
                state = optimizer["state"].get(index)
                if state:
                    moments[name] = {key: state[key] for key in MOMENTS}
                    steps[name] = _step(state["step"])
    return moments, steps


def _fsdp_moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = scratch / "optimizer.pt"
    dcp_to_torch_save(str(folder / "optimizer_0"), str(whole))  # Accelerate saves {"optimizer": state dict}
    saved = load(whole, mmap=True)["optimizer"]
    moments = {plain_name(name): {key: state[key] for key in MOMENTS} for name, state in saved["state"].items()}
    steps = {plain_name(name): _step(state["step"]) for name, state in saved["state"].items()}
    return moments, steps


def _deepspeed_moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = scratch / "universal"
    args = Namespace(
        input_folder=str(deepspeed_tag_folder(folder)), output_folder=str(out),
        num_extract_workers=1, num_merge_workers=1,  # no worker processes inside a training rank
        keep_temp_folder=False, strict=True,
        inject_missing_state=True,  # Accelerate's engines record no universal-checkpoint info; ZeRO needs none
    )
    ds_to_universal(args)
    zero = out / "zero"
    # ZeRO-1/2 write each parameter's step; ZeRO-3 one step for all, in its optimizer state (DeepSpeed's
    # own universal loader reads it from there the same way)
    common = load(zero / "optimizer_state.pt")
    group_state = common.get("optimizer_state_dict", {}).get("state", {})
    zero3_step = _step(group_state[0]["step"]) if 0 in group_state else None
    shapes = _deepspeed_shapes(folder)  # ZeRO-3's universal tensors are flat
    moments, steps = {}, {}
    for param in sorted(p for p in zero.iterdir() if p.is_dir()):
        if not (param / "exp_avg.pt").is_file():
            continue  # a frozen parameter: no Adam state
        moments[param.name] = {
            key: _universal_tensor(param / f"{key}.pt").reshape(shapes[param.name]) for key in MOMENTS
        }
        step = param / "step.pt"
        steps[param.name] = _step(load(step)) if step.is_file() else zero3_step
    return moments, steps


def _deepspeed_shapes(folder: Path) -> dict[str, torch.Size]:
    """The trained parameters' shapes, as DeepSpeed records them in its model states files."""
    first = sorted(deepspeed_tag_folder(folder).glob("*model_states.pt"))[0]
    saved = load(first, mmap=True)
    return {name: shape for group in saved["param_shapes"] for name, shape in group.items()}


def _universal_tensor(path: Path) -> torch.Tensor:
    value = load(path)
    return value["param"] if isinstance(value, dict) else value  # ZeRO-1/2: {"param", "cat_dim"}; ZeRO-3: the tensor


def cached_conversion(folder: Path) -> tuple[Path, bool]:
    """(checkpoint `folder` converted, whether it was already): made beside it, or reused when it was
    made from this very checkpoint (its state file's CRC), in one rename so that a crash leaves none."""
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
        convert(folder, partial)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else exc.strerror or str(exc)
        raise UserError(f"checkpoint {folder} could not be converted into {target} ({why}); copy the checkpoint "
                        "into a writable folder with room for its weights and Adam state") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(target)
    return target, False


# ---------------------------------------------------------------- reading it (every rank)
def plain_name(name: str) -> str:
    """A parameter's name without the wrappers torch.distributed.checkpoint leaves out of it."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


class ConsolidatedState:
    """A converted checkpoint, read a tensor at a time (nothing is loaded whole)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / OPTIMIZER).read_text())
        self._weights: dict[str, object] = {}
        for f in sorted((folder / WEIGHTS).glob("*.safetensors")):
            handle = safe_open(str(f), "pt")
            self._weights.update({plain_name(k): handle for k in handle.keys()})
        for f in sorted((folder / WEIGHTS).glob("pytorch_model*.bin")):
            shard = load(f, mmap=True)
            self._weights.update({plain_name(k): shard for k in shard})
        self._moments = {key: safe_open(str(folder / f"{key}.safetensors"), "pt") for key in MOMENTS}

    @property
    def source(self) -> SavedLayout:
        return SavedLayout(self.meta["source"]["strategy"], self.meta["source"]["world_size"])

    def weight(self, names: list[str]) -> torch.Tensor:
        """The full fp32 value of the parameter known by `names` (tied parameters have several)."""
        for name in map(plain_name, names):
            holder = self._weights.get(name)
            if holder is not None:
                value = holder.get_tensor(name) if hasattr(holder, "get_tensor") else holder[name]
                return value.float()
        raise UserError(f"the converted checkpoint {self.folder} has no weight for {names[0]}: it holds another model")

    def moments(self, name: str) -> dict[str, torch.Tensor] | None:
        name = plain_name(name)
        if name not in self.meta["steps"]:
            return None
        return {key: self._moments[key].get_tensor(name) for key in MOMENTS}

    def step(self, name: str) -> float:
        return self.meta["steps"][plain_name(name)]

    @property
    def trained(self) -> int:
        return len(self.meta["steps"])
