"""What each strategy's `save_state` leaves in a checkpoint folder, and how its full weights are
gathered back into one model by the tools that strategy ships (never by hand).

- DDP / one process: `model.safetensors` (or shards with an index): already whole.
- FSDP: a sharded (DCP) state dict in `pytorch_model_fsdp_0/`: torch's `dcp_to_torch_save` (what
  Accelerate's `merge_fsdp_weights` wraps, without its barrier of every rank).
- DeepSpeed ZeRO-1/2/3: `latest` plus `*/zero_pp_rank_*` / `*/*model_states.pt`: DeepSpeed's
  `zero_to_fp32`, which rebuilds the fp32 master weights from the optimizer partitions.

Every strategy also writes one `random_states_<rank>.pkl` per process, and DDP / one process
`optimizer.bin`, whose Adam state is keyed by integer ids; the toolkit records beside it which
parameter each id is (OPTIMIZER_NAMES), so that the state can move to another strategy.

`saved_layout` says which strategy and world size wrote a checkpoint: recorded in its
trainer_state.json, or, for checkpoints older than that record, read from its files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from toolkit.checkpoint.unpickling import load
from toolkit.config import UserError
from toolkit.run_dir import TrainerState, is_complete

SavedBy = Literal["ddp", "fsdp", "deepspeed", "pipeline"]
PIPELINE_STAGE = "pipeline_stage_{}.safetensors"  # a pipeline stage's weights, by their whole-model names
PIPELINE_OPTIMIZER = "pipeline_stage_{}_optimizer.pt"  # its optimizer state and the names of its parameters
OPTIMIZER_NAMES = "optimizer_param_names.json"  # DDP / one process: the parameter names of optimizer.bin's ids


@dataclass(frozen=True)
class SavedLayout:
    """Which strategy's files a checkpoint holds, and for how many processes (0 = not known)."""

    strategy: str  # a Strategy.name: "single process", "DDP", "FSDP2", "DeepSpeed ZeRO-2", ...
    world_size: int

    @property
    def layout(self) -> str:
        return layout_of(self.strategy)

    def describe(self) -> str:
        if self.strategy == "single process":
            return "one process"
        processes = f" on {self.world_size} process{'es' if self.world_size != 1 else ''}" if self.world_size else ""
        return f"{self.strategy}{processes}"


def layout_of(strategy: str) -> str:
    """The file layout a strategy's save_state writes: ddp (DDP and one process alike), fsdp1,
    fsdp2, zero0..zero3 (offload changes nothing in the files), or pipeline."""
    zero = re.match(r"DeepSpeed ZeRO-(\d)", strategy)
    if zero:
        return f"zero{zero.group(1)}"
    if strategy.startswith("pipeline"):
        return "pipeline"  # each stage's weights and optimizer state (save_pipeline_stage)
    if strategy.startswith("FSDP"):
        return "fsdp1" if strategy == "FSDP1" else "fsdp2"
    return "ddp"


def saved_layout(folder: Path) -> SavedLayout | None:
    """The strategy and world size that wrote checkpoint `folder`; None if its files are no strategy's."""
    if is_complete(folder):
        state = TrainerState.read(folder)
        if state.strategy:
            return SavedLayout(state.strategy, state.world_size)
    kind = saved_by(folder)
    if kind is None:
        return None
    world = len(list(folder.glob("random_states_*.pkl")))
    if kind == "ddp":
        return SavedLayout("single process" if world == 1 else "DDP", world)
    if kind == "fsdp":
        return SavedLayout("FSDP2", world)  # Accelerate's FSDP version here (its DCP files do not say)
    stage = deepspeed_config(folder).get("zero_optimization", {}).get("stage", 0)
    return SavedLayout(f"DeepSpeed ZeRO-{stage}", world)


def deepspeed_tag_folder(folder: Path) -> Path:
    """The folder of a DeepSpeed save that holds its rank files (named in `latest`)."""
    if (folder / "latest").is_file():
        return folder / (folder / "latest").read_text().strip()
    found = sorted(folder.glob("*/*model_states.pt"))
    return found[0].parent if found else folder


def deepspeed_config(folder: Path) -> dict:
    """The DeepSpeed config a DeepSpeed checkpoint was trained with (kept in its model states files)."""
    files = sorted(deepspeed_tag_folder(folder).glob("*model_states.pt"))
    if not files:
        return {}
    # mmap: the file holds the module's weights too, which are not read
    return load(files[0], mmap=True).get("ds_config", {})


def read_optimizer_names(folder: Path) -> list[list[str]] | None:
    """DDP / one process: the parameter names of optimizer.bin's ids, group by group; None if not recorded."""
    path = folder / OPTIMIZER_NAMES
    return json.loads(path.read_text())["groups"] if path.is_file() else None


def saved_by(folder: Path) -> SavedBy | None:
    """Which strategy's save_state wrote `folder`, from the files it holds; None if none matches."""
    if (folder / "latest").is_file() and any(folder.glob("*/zero_pp_rank_*")) or any(folder.glob("*/*model_states.pt")):
        return "deepspeed"
    if _fsdp_model_dir(folder) is not None:
        return "fsdp"
    if (folder / PIPELINE_STAGE.format(0)).is_file():
        return "pipeline"
    if any(folder.glob("model*.safetensors")) or (folder / "pytorch_model.bin").is_file():
        return "ddp"
    return None


def gather_full_weights(kind: SavedBy, folder: Path, into: Path) -> Path:
    """Write the checkpoint's full float32 weights into `into`, a shard at a time, so that the
    whole model is never held twice."""
    if kind == "ddp":  # already whole: link the files
        for f in [*folder.glob("model*.safetensors"), *folder.glob("model.safetensors.index.json"),
                  *folder.glob("pytorch_model*.bin")]:
            (into / f.name).symlink_to(f.resolve())
    elif kind == "fsdp":
        # torch's own DCP reader, in this process alone. Accelerate's merge_fsdp_weights wraps the
        # same call but ends in a barrier of every rank: a main process converting a checkpoint by
        # itself inside a launched run (toolkit.checkpoint.by_name) would wait there for ever.
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = into / "dcp_model.pt"
        dcp_to_torch_save(str(_fsdp_model_dir(folder)), str(whole))
        state = load(whole, mmap=True)
        state = state["model"] if set(state) == {"model"} else state  # Accelerate saves {"model": ...}
        save_file({k: v.contiguous() for k, v in state.items()}, into / "model.safetensors", metadata={"format": "pt"})
        del state
        whole.unlink()
    elif kind == "pipeline":  # each stage's weights under their whole-model names: one file of them all
        from safetensors.torch import load_file, save_file

        whole = {}
        for f in pipeline_stage_files(folder):
            whole.update(load_file(str(f)))
        save_file({k: v.float().contiguous() for k, v in whole.items()}, into / "model.safetensors", metadata={"format": "pt"})
    elif kind == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        # lazy inside: each shard is gathered from the partitions when it is written. As torch
        # files: its safetensors writer refuses tied weights (embeddings shared with lm_head)
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(into), max_shard_size="1GB", safe_serialization=False)
    else:
        raise ValueError(f"not a checkpoint kind: {kind}")
    return into


def save_pipeline_stage(pipeline, folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """A pipeline stage's weights (by their whole-model names) and its optimizer's state, written by
    the first replica's rank of each stage; the other replicas hold the same."""
    if pipeline.replica != 0:
        return
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    weights, state = folder / PIPELINE_STAGE.format(pipeline.index), folder / PIPELINE_OPTIMIZER.format(pipeline.index)
    folder.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in pipeline.named_parameters()}
    # the optimizer numbers its parameters: their names beside it, to move the state elsewhere
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    try:
        save_file({n: p.detach().contiguous().cpu() for n, p in pipeline.named_parameters()}, str(weights))
    except SafetensorError as exc:  # a full disk, as the checkpoint's other writes report it
        raise OSError(f"{weights}: {exc}") from exc
    torch.save({"optimizer": optimizer.state_dict(), "parameter_names": groups}, state)


def load_pipeline_stage(pipeline, folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """This rank's stage's weights and optimizer state from a checkpoint of the same pipeline."""
    from safetensors.torch import load_file

    weights, state = folder / PIPELINE_STAGE.format(pipeline.index), folder / PIPELINE_OPTIMIZER.format(pipeline.index)
    if not weights.exists() or not state.exists():
        raise UserError(f"checkpoint {folder} has no {weights.name}: it was not written by a pipeline of "
                        f"{pipeline.stages} stages; resume it with the train.pipeline_stages it was trained with")
    saved = load_file(str(weights))
    mine = dict(pipeline.named_parameters())
    if sorted(saved) != sorted(mine):
        raise UserError(f"checkpoint {folder}: {weights.name} holds other weights than this stage "
                        "(another model or another cut); resume with the config it was trained with")
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(saved[name])
    optimizer.load_state_dict(load(state, map_location=p.device)["optimizer"])


def pipeline_stage_files(folder: Path) -> list[Path]:
    """A pipeline checkpoint's stage weight files, stage 0 first."""
    files, stage = [], 0
    while (folder / PIPELINE_STAGE.format(stage)).is_file():
        files.append(folder / PIPELINE_STAGE.format(stage))
        stage += 1
    return files


def _fsdp_model_dir(folder: Path) -> Path | None:
    found = sorted(folder.glob("pytorch_model_fsdp_*"))
    return found[0] if found else None
