"""FSDP2: `save_state` writes torch.distributed.checkpoint (DCP) shards, `pytorch_model_fsdp_0/` and
`optimizer_0/` (keyed by parameter name), which DCP reshards on load to any world size. Read back whole in
one process with torch's `dcp_to_torch_save`, and loaded into an FSDP2 run with DCP's full-state setters
(each rank keeps its shard)."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.parameters import parameter_names, plain_name
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState, check_moments, step_value
from toolkit.strategy.family import Part, Strategy
from toolkit.strategy.unpickling import load

# what its save writes (the parts every family's checkpoint holds: toolkit.checkpoint.contents)
PARTS = (
    Part("sharded weights", ("pytorch_model_fsdp_*/*",), "Accelerate's save_state under FSDP2: torch.distributed."
         "checkpoint's shards", "Accelerate's load_state (resharded to any world size); full_weights", weights=True),
    Part("sharded optimizer", ("optimizer_*/*",), "Accelerate's save_state under FSDP2: the Adam state's shards",
         "Accelerate's load_state; moments"),
)

def model_dir(folder: Path) -> Path | None:
    found = sorted(folder.glob("pytorch_model_fsdp_*"))
    return found[0] if found else None


def is_mine(folder: Path) -> bool:
    return model_dir(folder) is not None


def layout_from(folder: Path, world: int) -> ParallelLayout:
    return ParallelLayout("fsdp", world)  # Accelerate's FSDP version here (its DCP files do not say)


def full_weights(folder: Path, into: Path) -> None:
    """torch's own DCP reader, in this process alone, into one model.safetensors."""
    # torch's own DCP reader, in this process alone. Accelerate's merge_fsdp_weights wraps the
    # same call but ends in a barrier of every rank: a main process converting a checkpoint by
    # itself inside a launched run (toolkit.checkpoint.conversion) would wait there for ever.
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = into / "dcp_model.pt"
    dcp_to_torch_save(str(model_dir(folder)), str(whole))
    state = load(whole, mmap=True)
    state = state["model"] if set(state) == {"model"} else state  # Accelerate saves {"model": ...}
    save_file({k: v.contiguous() for k, v in state.items()}, into / "model.safetensors", metadata={"format": "pt"})
    del state
    whole.unlink()


def moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = scratch / "optimizer.pt"
    dcp_to_torch_save(str(folder / "optimizer_0"), str(whole))  # Accelerate saves {"optimizer": state dict}
    saved = load(whole, mmap=True)["optimizer"]
    moments = {plain_name(name): {key: state[key] for key in MOMENTS} for name, state in saved["state"].items()}
    steps = {plain_name(name): step_value(state["step"]) for name, state in saved["state"].items()}
    return moments, steps


def load_into(strategy: Strategy, state: ConsolidatedState) -> None:
    """FSDP2: full tensors in, each rank keeps its shard (torch.distributed.checkpoint's setters)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    (module,), (optimizer,), _ = strategy.prepared()
    names = parameter_names(module)
    check_moments(state, module, names)
    weights = {}
    for param in module.parameters():
        value = state.weight(names[id(param)])
        weights.update({plain_name(name): value for name in names[id(param)]})
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    adam, groups = {}, []
    for group in optimizer.param_groups:
        group_names = [plain_name(names[id(p)][0]) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
        for name in group_names:
            found = state.moments(name)
            if found is not None:
                adam[name] = {"step": torch.tensor(state.step(name), dtype=torch.float32), **found}
    set_optimizer_state_dict(module, optimizer, {"state": adam, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))
