"""What a rank knows from its launcher before any process group exists: the strategy and precision the
accelerate config asked for, how many processes, whether this is rank 0, whether a GPU is there.

Read from the variables `accelerate launch` (torchrun) sets for each rank; a plain `python` run has
none of them and is one process of DDP's file layout.
"""

from __future__ import annotations

import os

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def launched_kind() -> str:
    """What the accelerate config asked for, read from the launcher's environment."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return "ddp"


LAUNCHED_PRECISION = "the accelerate launch's mixed_precision"


def launched_mixed_precision() -> str | None:
    """The precision `accelerate launch` asked for (its config file's mixed_precision, or
    --mixed_precision), None for "no" or no launcher. The shipped configs say "no": the recipe decides."""
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return None if value == "no" else value


def world_size() -> int:
    """Processes in this launch, before any process group exists (the launcher's environment)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes of this launch on this machine: they share its memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpu_short() -> str | None:
    """Why this launch cannot give each of this machine's ranks a GPU of its own (plain `accelerate launch` of a
    shipped config's 8 processes on fewer GPUs: the surplus ranks would fail one by one, each with CUDA's "invalid
    device ordinal"), or None. recipes/launch.sh says the same before any rank starts."""
    if not has_gpu() or os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true":
        return None
    here = local_world_size()
    return gpus_short(here, torch.cuda.device_count(), max(1, world_size() // here))


def gpus_short(here: int, gpus: int, machines: int, where: str = "") -> str | None:
    """The line for `here` ranks on a machine of `gpus` GPUs, of a launch over `machines` machines (`where`: what
    asked for them), or None where each rank has a GPU."""
    if here <= gpus:
        return None
    return (f"{here} processes on a machine with {gpus} GPU{'s' * (gpus > 1)}{f' ({where})' if where else ''}: "
            f"one GPU a process; use --num_processes {gpus * machines}")


def is_launch_main() -> bool:
    """Rank 0 of the launch."""
    return int(os.environ.get("RANK", "0")) == 0


# what a launcher tells each rank: who it is among how many
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_WORLD_SIZE")


def run_alone() -> None:
    """Forget the launch: from here this process is one process on its own (the launcher's variables gone), for a
    library that would otherwise form a process group over ranks that do not take part (recipes/evaluate.py on CPU)."""
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)


def alone_environment() -> dict[str, str]:
    """A rank's environment for a process of one that it starts (eval.harness_tasks' scoring): without the launch,
    its rendezvous and Accelerate's strategy (a ZeRO config would make the child's Accelerator a DeepSpeed one)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES
            and not k.startswith(("ACCELERATE_", "FSDP_", "TORCHELASTIC_", "MASTER_", "LLM_TOOLKIT_LAUNCHER"))}
