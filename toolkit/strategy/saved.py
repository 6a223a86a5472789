"""What each strategy's `save_state` leaves in a checkpoint folder, and how its full weights are
gathered back into one model by the tools that strategy ships (never by hand).

- DDP / one process: `model.safetensors` (or shards with an index): already whole.
- FSDP: a sharded (DCP) state dict in `pytorch_model_fsdp_0/`: Accelerate's `merge_fsdp_weights`.
- DeepSpeed ZeRO-1/2/3: `latest` plus `*/zero_pp_rank_*` / `*/*model_states.pt`: DeepSpeed's
  `zero_to_fp32`, which rebuilds the fp32 master weights from the optimizer partitions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

SavedBy = Literal["ddp", "fsdp", "deepspeed"]


def saved_by(folder: Path) -> SavedBy | None:
    """Which strategy's save_state wrote `folder`, from the files it holds; None if none matches."""
    if (folder / "latest").is_file() and any(folder.glob("*/zero_pp_rank_*")) or any(folder.glob("*/*model_states.pt")):
        return "deepspeed"
    if _fsdp_model_dir(folder) is not None:
        return "fsdp"
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
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(_fsdp_model_dir(folder)), str(into), safe_serialization=True)
    elif kind == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        # lazy inside: each shard is gathered from the partitions when it is written. As torch
        # files: its safetensors writer refuses tied weights (embeddings shared with lm_head)
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(into), max_shard_size="1GB", safe_serialization=False)
    else:
        raise ValueError(f"not a checkpoint kind: {kind}")
    return into


def _fsdp_model_dir(folder: Path) -> Path | None:
    found = sorted(folder.glob("pytorch_model_fsdp_*"))
    return found[0] if found else None
