"""A checkpoint's state by parameter name: the one form every strategy can both produce with its own tools and
consume with its own setters. Made once beside a checkpoint that resumes under another strategy or world size
(toolkit.checkpoint.conversion, `step-N.converted/`):

    weights/  exp_avg.safetensors  exp_avg_sq.safetensors  optimizer.json

Why no existing tool does, and each file: docs/internals.md, toolkit/strategy/by_name.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from toolkit.config.errors import UserError
from toolkit.models.parameters import plain_name
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.unpickling import load

VERSION = 1
WEIGHTS = "weights"
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER = "optimizer.json"


def step_value(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


# ---------------------------------------------------------------- reading it (every rank)
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
    def source(self) -> ParallelLayout:
        source = self.meta["source"]
        if "layout" in source:
            return ParallelLayout.from_record(source["layout"])
        return ParallelLayout.from_name(source["strategy"], source["world_size"])  # converted before the record

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


def check_moments(state: ConsolidatedState, module: torch.nn.Module, names: dict[int, list[str]]) -> None:
    """Every parameter this run trains must find its Adam state, or the moments would silently restart."""
    missing = [names[id(p)][0] for p in module.parameters()
               if p.requires_grad and all(state.moments(n) is None for n in names[id(p)])]
    if missing and state.trained:
        raise UserError(
            f"the converted checkpoint {state.folder} has no Adam state for {missing[0]} (and {len(missing) - 1} more), "
            "which this run trains: it was saved with other trainable parameters (another adapter?)"
        )


def load_whole(params: list[torch.nn.Parameter], names: dict[int, list[str]], optimizer: torch.optim.Optimizer,
                  state: ConsolidatedState) -> None:
    """Whole weights in place, and the optimizer's state dict built by name (a parameter's Adam state
    under whichever of its names the saving strategy used)."""
    with torch.no_grad():
        for param in params:
            param.copy_(state.weight(names[id(param)]))
    current = optimizer.state_dict()
    adam, index = {}, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = next((n for n in names[id(param)] if state.moments(n) is not None), None)
            if name is not None:
                adam[index] = {"step": torch.tensor(state.step(name), dtype=torch.float32), **state.moments(name)}
            index += 1
    optimizer.load_state_dict({"state": adam, "param_groups": current["param_groups"]})
