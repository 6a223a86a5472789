"""DeepSpeed's launch: its JSON read first (one line per mistake), its "auto" values filled from the recipe, its CPU
accelerator counted once, and Accelerate's refusals said in one line."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from accelerate import Accelerator

from toolkit.config.errors import UserError
from toolkit.config.files import read_json
from toolkit.launch.environment import has_gpu
from toolkit.strategy.sequence_parallel import skip_shared_memory_kernel


def check_deepspeed_config() -> dict | None:
    """Read the launched DeepSpeed JSON ourselves first, so that mistakes are one clear line."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"the accelerate config asks for DeepSpeed, but it cannot be imported ({exc}); "
            "install it with pip install 'llm-toolkit[deepspeed]' or launch with accelerate_configs/ddp.yaml"
        ) from None
    if not has_gpu():
        skip_shared_memory_kernel()
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or path == "none":
        return None  # stage etc. given inline in the accelerate config
    if not Path(path).is_file():
        raise UserError(f"deepspeed_config_file {path} does not exist (paths are relative to where you launch)")
    ds = read_json(path, "a DeepSpeed config")  # a key written twice is refused, not the last one taken
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{path}: zero_optimization must be an object ({{\"stage\": 2, ...}}), found {zero!r:.60}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{path}: zero_optimization.stage={stage!r}; DeepSpeed ZeRO stages are 0, 1, 2 or 3")
    return ds


def count_cpu_devices_once() -> None:
    """DeepSpeed's CPU accelerator counts its devices by running `numactl --hardware` each time it is asked,
    unless LOCAL_SIZE (which its own launcher sets) says: ~36 times a step, each a fork of the whole rank
    (216 forks in 6 tiny ZeRO-3 steps, ~2 CPU-s a rank; the fork happens even where numactl is missing).
    Asked once here and kept in LOCAL_SIZE, which only that count reads: the same number, one fork."""
    if "LOCAL_SIZE" not in os.environ:
        from deepspeed.accelerator import get_accelerator

        os.environ["LOCAL_SIZE"] = str(get_accelerator().device_count())


def ignored_beside_deepspeed_json(exc: ValueError) -> str:
    """Accelerate's 5-line refusal of accelerate-config keys that a deepspeed_config_file overrides
    (mixed_precision among them), as one line naming those the launch set; anything else is re-raised."""
    found = re.search(r"deepspeed_config_file`, the following accelerate config variables will be ignored: \[([^\]]*)\]",
                      str(exc))
    if found is None:
        raise exc
    ignored = {name.strip(" '") for name in found.group(1).split(",")}
    given = [name for name in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if name in ignored]
    return (
        f"the accelerate config sets {', '.join(given or sorted(ignored))} beside deepspeed_config_file, which "
        "decides them: remove them from the accelerate config (precision: train.mixed_precision; the DeepSpeed "
        "JSON's \"auto\" values follow the recipe)"
    )


# torch 2.13 deprecates the collectives DeepSpeed 0.19 calls in every ZeRO step, and transformers'
# catch_warnings blocks reset Python's once-per-place memory, so the same two lines came back ~80 times
# a step (486 lines in 6 steps of pretrain_tiny under zero3.yaml): nothing a user can act on.
DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def configure_deepspeed(accelerator: Accelerator, micro_batch: int, max_grad_norm: float) -> list[str]:
    """Fill DeepSpeed's "auto" values from the recipe; refuse values that contradict it.

    Returns what the DeepSpeed JSON itself takes over (its own optimizer/scheduler), for the log.
    """
    warnings.filterwarnings("ignore", message=DEEPSPEED_DEPRECATIONS, category=FutureWarning)
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "the DeepSpeed config")
    wanted = {
        "train_micro_batch_size_per_gpu": (micro_batch, "train.micro_batch_size"),
        "gradient_accumulation_steps": (accelerator.gradient_accumulation_steps, "the accumulation derived from train.global_batch_size"),
        "train_batch_size": (micro_batch * accelerator.gradient_accumulation_steps * accelerator.num_processes, "train.global_batch_size"),
        "gradient_clipping": (max_grad_norm, "optim.max_grad_norm"),
    }
    problems = []
    for key, (value, origin) in wanted.items():
        current = ds.get(key, "auto")
        if current == "auto":
            ds[key] = value
        elif float(current) != float(value):
            problems.append(f"{source} sets {key}={current} but the recipe has {value} ({origin}); set it to \"auto\"")
    if problems:
        raise UserError("; ".join(problems))
    return [block for block in ("optimizer", "scheduler") if block in ds]
