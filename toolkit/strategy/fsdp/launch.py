"""FSDP2's launch: gradients reduced in fp32 under mixed precision, and FSDP itself on a CPU machine, where
Accelerate would silently train unsharded."""

from __future__ import annotations

import dataclasses

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


def reduce_gradients_in_fp32(fsdp_plugin) -> None:
    """FSDP2 under bf16/fp16: parameters gathered in the low precision, gradients reduced in fp32.

    Accelerate's policy reduces in the low precision too; DDP and ZeRO reduce the fp32 gradients
    that autocast leaves on fp32 weights, so an 8-rank FSDP2 average would be the one rounded to
    bf16 (8 significant bits) at every step. fp32 reduction is torchtitan's default as well; it
    doubles the reduce-scatter's bytes, small next to a step's compute.
    """
    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    if dataclasses.is_dataclass(policy) and getattr(policy, "reduce_dtype", None) in (torch.bfloat16, torch.float16):
        fsdp_plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def shard_on_cpu(accelerator: Accelerator) -> None:
    """Accelerate applies FSDP on a GPU only: on a CPU machine its plugin is set here, so that a launch under
    fsdp.yaml shards there too."""
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
