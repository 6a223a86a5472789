"""The parallel layout a launch asks for: how many ranks split a model (context, tensor, sequence parallel,
pipeline stages) and how many micro-batches each data-parallel rank accumulates, checked before any process
group exists."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from toolkit.config.combinations import FP16_IN_A_PIPELINE, PIPELINE_LAYOUT
from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout


def accumulation_steps(global_batch: int, micro_batch: int, world: int) -> int:
    """Micro-batches per rank per optimizer step, so that every strategy sees the same global batch."""
    per_step = micro_batch * world
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch_size={global_batch} is not divisible by "
            f"train.micro_batch_size={micro_batch} x {world} process(es) = {per_step}; "
            f"use a multiple of {per_step} or change train.micro_batch_size"
        )
    return global_batch // per_step


AXES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # an accelerate config's parallelism_config sizes

# The axes of a launch's device mesh, outermost first: the one glossary of them (ParallelLayout holds their degrees).
MESH_AXES = {
    "dp": "data parallel: the ranks that read different batches (DDP's replicas, FSDP2's and ZeRO's shards)",
    "pp": "pipeline parallel: stages of consecutive layers (train.pipeline_stages)",
    "cp": "context parallel: chunks of every sequence; attention gathers the other chunks' keys and values",
    "sp": "sequence parallel (Ulysses): chunks of every sequence; attention trades them for heads (all-to-all)",
    "tp": "tensor parallel: slices of every layer's weights (Megatron); a mixture's experts spread over them (ep)",
}


def device_mesh(layout: ParallelLayout, device_type: str):
    """Collective: the launch's one device mesh, dp and each model-parallel axis of `layout` above 1, outermost
    first (rank = dp index x the model-parallel ranks + the index within them); None where every model-parallel
    degree is 1 (DDP, FSDP2 and ZeRO use the default process group). Every applier takes its axis of it
    (toolkit.strategy's context_parallel, sequence_parallel, tensor_parallel and pipeline_parallel)."""
    axes = [(axis, getattr(layout, axis)) for axis in MESH_AXES if axis != "dp" and getattr(layout, axis) > 1]
    if not axes:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*axes, strict=True)
    return init_device_mesh(device_type, (layout.world // math.prod(sizes), *sizes), mesh_dim_names=("dp", *names))


def launched_sizes(world: int) -> dict[str, int]:
    """The sizes by axis (AXES) an accelerate config's parallelism_config asks for, checked against the
    launch; its other axes are refused in one line until they are built. Accelerate is then told nothing
    of it: its ParallelismConfig refuses CPU processes, its context parallel (torch's ring attention) and
    its sequence parallel (DeepSpeed's registration) drop the attention mask, so that packed documents
    would see each other, and its FSDP2 + TP branch imports a class transformers 5.23 no longer has."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return {}
    size = {k: int(os.environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1")) for k in AXES}
    cp, tp, sp = model_parallel_sizes(size)
    model = cp * tp * sp
    if min(cp, tp, sp, size["dp_shard"]) < 1 or size["dp_shard"] * model != world:
        axes = [axis for axis in ("cp", "tp", "sp") if size[axis] > 1]
        axis = axes[0] if axes else "tp"
        fix = (f"set parallelism_config_dp_shard_size to {world // model}" if world % model == 0 and world >= model
               else f"launch a multiple of {model} processes (--num_processes {model * max(1, size['dp_shard'])})")
        raise UserError(
            f"accelerate config: parallelism_config_dp_shard_size={size['dp_shard']} x parallelism_config_{axis}_size="
            f"{model} must equal the {world} processes launched; {fix}"
        )
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    return size


def parallel_layout(distributed_type: str, sizes: Mapping[str, int], world: int = 0, stages: int = 1) -> ParallelLayout:
    """The one way a ParallelLayout is made: from an accelerate config's distributed_type (a launch's
    Accelerator has the same) and parallelism_config sizes, for a launch (whose world is known) and for
    the planner (an accelerate config file alone) alike."""
    cp, tp, sp = model_parallel_sizes(sizes)
    kind = {"NO": "single", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(getattr(distributed_type, "value", distributed_type), "ddp")
    return ParallelLayout(kind, world, tp=tp, cp=cp, sp=sp, pp=stages)


def model_parallel_sizes(size: dict[str, int]) -> tuple[int, int, int]:
    """(cp, tp, sp) of a parallelism_config's sizes by axis (AXES: what a launch reads from its environment,
    and recipes/plan.py from the accelerate config file); the axes not built yet refused in one line."""
    if size.get("dp_replicate", 1) > 1:
        raise UserError(
            f"accelerate config: parallelism_config_dp_replicate_size={size['dp_replicate']} is not supported yet; use "
            "parallelism_config_dp_shard_size with parallelism_config_cp_size (accelerate_configs/fsdp_cp.yaml), "
            "parallelism_config_tp_size (accelerate_configs/fsdp_tp.yaml) or parallelism_config_sp_size "
            "(accelerate_configs/zero3_sp.yaml)"
        )
    axes = [axis for axis in ("cp", "tp", "sp") if size.get(axis, 1) > 1]
    if len(axes) > 1:
        first, second = axes[:2]
        raise UserError(
            f"accelerate config: parallelism_config_{first}_size={size[first]} with parallelism_config_{second}_size="
            f"{size[second]} is not supported yet; use one of them"
        )
    return size.get("cp", 1), size.get("tp", 1), size.get("sp", 1)


def check_pipeline_launch(stages: int, world: int, model_parallel: int, mixed_precision: str = "no") -> None:
    """Refuses, before any process group exists, a pipeline the launch cannot hold."""
    if stages == 1:
        return
    layout = ParallelLayout("ddp", world, pp=stages, tp=model_parallel)  # (which of cp, tp or sp: all refused alike)
    for rule in (FP16_IN_A_PIPELINE, PIPELINE_LAYOUT):
        if line := rule.refused(None, layout, mixed_precision):
            raise UserError(line)
    if world % stages:
        raise UserError(f"train.pipeline_stages={stages} does not divide the {world} processes launched; launch a "
                        f"multiple of {stages} processes (replicas x stages)")
