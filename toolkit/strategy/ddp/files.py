"""DDP and one process: `save_state` writes the whole model (`model.safetensors`, or shards with an index)
and `optimizer.bin`, torch's optimizer state keyed by integer ids; the toolkit writes beside it which
parameter each id is (OPTIMIZER_NAMES), so that the state can move to another strategy. Read back by
parameter name, and loaded into a DDP or one-process run (on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.models.parameters import parameter_names
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState, check_moments, load_whole, step_value
from toolkit.strategy.family import Part, Strategy
from toolkit.strategy.unpickling import load

OPTIMIZER_NAMES = "optimizer_param_names.json"  # DDP / one process: the parameter names of optimizer.bin's ids


# what its save writes (the parts every family's checkpoint holds: toolkit.checkpoint.contents)
PARTS = (
    Part("weights", ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin"),
         "Accelerate's save_state: the prepared model, whole", "Accelerate's load_state; full_weights", weights=True),
    Part("optimizer", ("optimizer.bin",), "Accelerate's save_state: AdamW's state, keyed by parameter order",
         "Accelerate's load_state; moments"),
    Part("parameter names", (OPTIMIZER_NAMES,), "the checkpointer: which parameter each optimizer.bin number is",
         "moments (a conversion by name)"),
)

def is_mine(folder: Path) -> bool:
    return any(folder.glob("model*.safetensors")) or (folder / "pytorch_model.bin").is_file()


def layout_from(folder: Path, world: int) -> ParallelLayout:
    return ParallelLayout("single" if world == 1 else "ddp", world)


def full_weights(folder: Path, into: Path) -> None:
    """Already whole: the files linked into `into`."""
    for f in [*folder.glob("model*.safetensors"), *folder.glob("model.safetensors.index.json"),
              *folder.glob("pytorch_model*.bin")]:
        (into / f.name).symlink_to(f.resolve())


def read_optimizer_names(folder: Path) -> list[list[str]] | None:
    """DDP / one process: the parameter names of optimizer.bin's ids, group by group; None if not recorded."""
    path = folder / OPTIMIZER_NAMES
    return json.loads(path.read_text())["groups"] if path.is_file() else None


def moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
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
                steps[name] = step_value(state["step"])
    return moments, steps


def load_into(strategy: Strategy, state: ConsolidatedState) -> None:
    """DDP or one process: the whole model and the optimizer state dict, on every rank."""
    (module,), (optimizer,), _ = strategy.prepared()
    names = parameter_names(module)
    check_moments(state, module, names)
    load_whole(list(module.parameters()), names, optimizer, state)
