"""DeepSpeed ZeRO-1/2/3: `save_state` writes `latest` and a tag folder of per-rank files
(`*model_states.pt`, `zero_pp_rank_*_optim_states.pt`: flat partitions that fit only the stage and world
size that wrote them). Read back whole with DeepSpeed's own tools (`zero_to_fp32` for the fp32 masters,
`ds_to_universal` for each parameter's Adam state; checked on CPU with DeepSpeed 0.19.8: all three
stages, fp32 and bf16, and LoRA under ZeRO-2 and ZeRO-3), and loaded into a DeepSpeed run with its setters."""

from __future__ import annotations

import contextlib
import io
import os
from argparse import Namespace
from pathlib import Path

import torch

from toolkit.models.parameters import parameter_names
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.by_name import MOMENTS, ConsolidatedState, check_moments, step_value
from toolkit.strategy.family import Part, Strategy
from toolkit.strategy.unpickling import load

# what its save writes (the parts every family's checkpoint holds: toolkit.checkpoint.contents); the fp32 weights
# are gathered from the optimizer's partitions, so export reads them all
PARTS = (
    Part("ZeRO partitions", ("latest", "pytorch_model/*", "zero_to_fp32.py", "zero_to_torch.py"),
         "DeepSpeed's save_checkpoint: each rank's partition of the fp32 masters and Adam state",
         "DeepSpeed's load_checkpoint (same stage and world size); full_weights, moments", weights=True),
)

def tag_folder(folder: Path) -> Path:
    """The folder of a DeepSpeed save that holds its rank files (named in `latest`)."""
    if (folder / "latest").is_file():
        return folder / (folder / "latest").read_text().strip()
    found = sorted(folder.glob("*/*model_states.pt"))
    return found[0].parent if found else folder


def config(folder: Path) -> dict:
    """The DeepSpeed config a DeepSpeed checkpoint was trained with (kept in its model states files)."""
    files = sorted(tag_folder(folder).glob("*model_states.pt"))
    if not files:
        return {}
    # mmap: the file holds the module's weights too, which are not read
    return load(files[0], mmap=True).get("ds_config", {})


def is_mine(folder: Path) -> bool:
    return (folder / "latest").is_file() and any(folder.glob("*/zero_pp_rank_*")) or any(folder.glob("*/*model_states.pt"))


def layout_from(folder: Path, world: int) -> ParallelLayout:
    return ParallelLayout("deepspeed", world, zero_stage=int(config(folder).get("zero_optimization", {}).get("stage", 0)))


def full_weights(folder: Path, into: Path) -> None:
    _tools_without_device()
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    # lazy inside: each shard is gathered from the partitions when it is written. As torch
    # files: its safetensors writer refuses tied weights (embeddings shared with lm_head). Its prints and
    # its bar ("Processing zero checkpoint", "Parsing checkpoint created by deepspeed==", "Detected checkpoint of
    # type ...", "Reconstructed ... fp32 state dict", "Saving checkpoint shards") are not the export's: a failure
    # raises, with its own message
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(into), max_shard_size="1GB", safe_serialization=False)


def moments(folder: Path, scratch: Path) -> tuple[dict, dict]:
    _tools_without_device()
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = scratch / "universal"
    args = Namespace(
        input_folder=str(tag_folder(folder)), output_folder=str(out),
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
    zero3_step = step_value(group_state[0]["step"]) if 0 in group_state else None
    shapes = _shapes(folder)  # ZeRO-3's universal tensors are flat
    moments, steps = {}, {}
    for param in sorted(p for p in zero.iterdir() if p.is_dir()):
        if not (param / "exp_avg.pt").is_file():
            continue  # a frozen parameter: no Adam state
        moments[param.name] = {
            key: _universal_tensor(param / f"{key}.pt").reshape(shapes[param.name]) for key in MOMENTS
        }
        step = param / "step.pt"
        steps[param.name] = step_value(load(step)) if step.is_file() else zero3_step
    return moments, steps


def _shapes(folder: Path) -> dict[str, torch.Size]:
    """The trained parameters' shapes, as DeepSpeed records them in its model states files."""
    first = sorted(tag_folder(folder).glob("*model_states.pt"))[0]
    saved = load(first, mmap=True)
    return {name: shape for group in saved["param_shapes"] for name, shape in group.items()}


def _universal_tensor(path: Path) -> torch.Tensor:
    value = load(path)
    return value["param"] if isinstance(value, dict) else value  # ZeRO-1/2: {"param", "cat_dim"}; ZeRO-3: the tensor


def load_into(strategy: Strategy, state: ConsolidatedState) -> None:
    """DeepSpeed ZeRO-1/2/3: fp32 masters and their Adam state through DeepSpeed's setters, and the
    module's copy from the same values; the engine's step counters where the checkpoint left them."""
    import deepspeed

    engine = strategy.accelerator.deepspeed_engine_wrapped.engine
    module = engine.module
    names = parameter_names(module)
    check_moments(state, module, names)
    steps = [state.step(names[id(p)][0]) for p in module.parameters() if state.moments(names[id(p)][0]) is not None]
    _create_adam_state(engine.optimizer, max(steps, default=0.0))
    for param in module.parameters():
        name = names[id(param)][0]
        value = state.weight(names[id(param)])
        found = state.moments(name) if param.requires_grad else None
        if found is not None:
            _set_master(param, value)
            for key in MOMENTS:
                _set_master(param, found[key], key)
        # the module's own copy: whole under ZeRO-1/2 (16-bit in mixed precision), a partition under
        # ZeRO-3, rebuilt from rank 0's values on leaving the context
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype).view_as(param.data))
    step = int(max(steps, default=0.0))
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    engine.micro_steps = step * engine.gradient_accumulation_steps()


def _set_master(param, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of a parameter's fp32 master (`key` None) or of its Adam state `key`.

    ZeRO-3 through the local setter, with this rank's slice: DeepSpeed 0.19.8's full setter
    (safe_set_full_fp32_param / safe_set_full_optimizer_state) reads past the end of a parameter
    whose size the world size does not divide, where the last rank's partition is padded (measured:
    a 512 x 64 embedding on 3 ranks). The slice is padded with zeros as DeepSpeed pads it."""
    from deepspeed import comm
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if not hasattr(param, "ds_id"):  # ZeRO-1/2
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    size = param.ds_tensor.numel()
    start = comm.get_rank(group=param.ds_process_group) * size
    piece = value.flatten()[start:start + size]
    local = torch.zeros(size, dtype=torch.float32)
    local[:piece.numel()] = piece
    if key is None:
        safe_set_local_fp32_param(param, local)
    else:
        safe_set_local_optimizer_state(param, local, key)


def _create_adam_state(zero, step: float) -> None:
    """DeepSpeed's ZeRO optimizers create the torch optimizer's state on their first step, and only
    then link each parameter to its slice of it: made here, zero-filled, holding the step."""
    inner = zero.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3: outside step, its groups are empty
    if flats is None:
        flats = [p for group in inner.param_groups for p in group["params"]]
    cpu_adam = type(inner).__name__ == "DeepSpeedCPUAdam"  # counts its step in a plain int
    for flat in flats:
        inner.state[flat] = {
            "step": int(step) if cpu_adam else torch.tensor(step, dtype=torch.float32),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2: fragments of that state
    if link is not None:
        link()


def missing_partition(folder: Path, saved: ParallelLayout) -> str | None:
    """The first ZeRO optimizer partition of a rank that a checkpoint written under `saved` (ZeRO-1/2/3) lacks, said
    in one line (DeepSpeed would fail deep inside with a ValueError that names no rank); None for any other layout."""
    if saved.files not in ("zero1", "zero2", "zero3"):
        return None
    tag = tag_folder(folder)
    for rank in range(saved.world):
        if not any(tag.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt")):
            return (f"{tag}/*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt is missing (the optimizer state of rank "
                    f"{rank} of {saved.world})")
    return None


def refuses_conversion(folder: Path, saved: ParallelLayout) -> str | None:
    """Why checkpoint `folder`, written under `saved`, cannot be converted for another layout (the rest of the
    sentence that names the checkpoint), or None."""
    owned = [block for block in ("optimizer", "scheduler") if block in config(folder)]
    if owned:
        return (f" was trained with the {' and '.join(owned)} its DeepSpeed JSON defines, whose state is "
                "DeepSpeed's own: it cannot be converted for another strategy or world size; resume it under "
                f"{saved.describe()} with the same DeepSpeed JSON")
    if saved.files == "zero0":
        return (": DeepSpeed without ZeRO (stage 0) keeps no per-parameter state that DeepSpeed's converter reads; "
                f"resume it under {saved.describe()}")
    return None


def _tools_without_device() -> None:
    """DeepSpeed's converters, not its engine: no device needed."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
