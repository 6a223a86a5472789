"""The Accelerator for the launched strategy, configured alike on CPU (gloo) and GPU (NCCL).

On a CPU-only machine Accelerate would silently train unsharded or unsynchronised: DDP's ranks would train
apart, DeepSpeed would be dropped, FSDP would do nothing. Each is handled here, so that the same accelerate
config trains the same way on CPU and GPU.
Each quirk, its fix and what was measured: docs/internals.md, toolkit/strategy/accelerator.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from datetime import timedelta

import torch
from accelerate import Accelerator

from toolkit.config.errors import UserError
from toolkit.launch.environment import (
    LAUNCHED_PRECISION,
    has_gpu,
    launched_kind,
    launched_mixed_precision,
)
from toolkit.models.float8 import hardware_refused
from toolkit.strategy.collectives import creating_groups, set_collective_timeout
from toolkit.strategy.deepspeed.launch import ignored_beside_deepspeed_json
from toolkit.strategy.families import FAMILIES
from toolkit.strategy.family import Family


def resolve_mixed_precision(choice: str) -> str:
    """train.mixed_precision, with the launcher's request honoured or refused, never dropped:
    Accelerate takes the Accelerator's argument over the launcher's, so a launch with fp16 trained in
    fp32 and said precision=fp32. A request for what train.mixed_precision=auto leaves open is taken
    (and describe() says where it came from); one that contradicts an explicit choice is refused."""
    launched = launched_mixed_precision()
    source = f"train.mixed_precision={choice}"
    if launched is not None:
        if launched not in ("bf16", "fp16"):
            raise UserError(
                f"{LAUNCHED_PRECISION} is {launched}; the toolkit trains in bf16, fp16, fp8 or fp32 as "
                "train.mixed_precision says: set mixed_precision \"no\" in the accelerate config (and drop "
                "--mixed_precision), then choose with train.mixed_precision (fp8: train.mixed_precision=fp8)"
            )
        if choice not in ("auto", launched):
            raise UserError(
                f"{LAUNCHED_PRECISION} is {launched} (its config file or --mixed_precision) and "
                f"train.mixed_precision={choice}: they contradict each other; keep one (the shipped accelerate configs "
                "say \"no\" so that train.mixed_precision decides)"
            )
        choice, source = launched, f"{LAUNCHED_PRECISION}={launched}"
    if choice == "fp8":  # bf16 autocast around the float8 layers (toolkit.models.float8 converts them)
        if line := hardware_refused(torch.device("cuda" if has_gpu() else "cpu")):
            raise UserError(line)
        return "bf16"
    if choice == "fp16" and not has_gpu():
        raise UserError(f"{source} needs a GPU; this machine has none (use auto or no for fp32, or bf16)")
    if choice != "auto":
        return choice
    if has_gpu() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def launched_family() -> Family:
    """The family whose launch the accelerate config asks for (a pipeline's stages launch as DDP's)."""
    return FAMILIES[launched_kind()]


def build_accelerator(
    mixed_precision: str, accumulation_steps: int, project_dir: str, trackers: list[str] | None = None,
    timeout_s: int = 1800,
) -> Accelerator:
    """The Accelerator for the launched strategy; `timeout_s` bounds every collective (see set_collective_timeout)."""
    family = launched_family()
    family.check_launch()
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    timeout = set_collective_timeout(timeout_s)
    with creating_groups("creating the launch's process group") if multi else contextlib.nullcontext():
        if multi:
            join_restarted_group("nccl" if has_gpu() else "gloo", timeout)
        try:
            accelerator = Accelerator(
                mixed_precision=resolve_mixed_precision(mixed_precision),
                gradient_accumulation_steps=accumulation_steps,
                log_with=trackers or None,
                project_dir=project_dir,
                **family.accelerator_kwargs(multi, timeout),
            )
        except ValueError as exc:
            raise UserError(ignored_beside_deepspeed_json(exc)) from None
    family.configure_accelerator(accelerator, multi)
    return accelerator


def join_restarted_group(backend: str, timeout: timedelta) -> None:
    """After an elastic restart (`--max_restarts`), the process group on its own key prefix.

    torchrun hands the restarted ranks the store its agent kept from the first attempt, keys and
    all (TORCHELASTIC_USE_AGENT_STORE), and init_process_group adds no per-attempt prefix: the new
    ranks read their dead predecessors' addresses from it and fail to connect ("Connection
    refused" in gloo's connectFullMesh, torch 2.13). Under a prefix named after the attempt they
    meet only each other. Accelerate then finds the group initialised and keeps it."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or torch.distributed.is_initialized():
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent_store, timeout=timeout,
    )
    torch.distributed.init_process_group(
        backend, store=torch.distributed.PrefixStore(f"llm-toolkit/attempt-{attempt}", store),
        rank=rank, world_size=world, timeout=timeout,
    )


# Launch variables with which transformers' from_pretrained loads weights on rank 0 only (the
# other ranks' stay on the meta device, to be filled by FSDP's sync_module_states at prepare).
FSDP_LOADING_ENV = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


@contextlib.contextmanager
def outside_training(accelerator: Accelerator):
    """Build, load and generate in here as in a new single process, whatever the strategy.

    Training leaves process-wide state that transformers reads, and only some ranks may be in
    here (rank 0 generating samples, reloading what it wrote):
    - Accelerate registers its DeepSpeed config with transformers (a module-global reference)
      even with zero3_init_flag off. While it is set under ZeRO-3, `from_config` and
      `from_pretrained` build the model inside `deepspeed.zero.Init`: partitioned (with another
      random init than every other strategy gets) and checked against the training batch sizes
      ("train_batch_size is not equal to micro_batch_per_gpu * ..."); and `generate` syncs every
      decoding step with the other ranks, an all-reduce that hangs when one rank generates alone.
    - FSDP with cpu_ram_efficient_loading: `from_pretrained` fills the weights on rank 0 only.

    So the reference and those variables are set aside in here and restored on the way out.
    Building a model whole costs host RAM for the full model once; `prepare` shards it right after.
    """
    saved_env = {k: os.environ.pop(k) for k in FSDP_LOADING_ENV if k in os.environ}
    try:
        with launched_family().set_aside(accelerator):
            yield
    finally:
        os.environ.update(saved_env)


def keep_freed_memory() -> bool:
    """CPU runs: keep freed memory in the process for the next step (glibc only; False elsewhere).

    torch's CPU tensors come from malloc. By default glibc hands memory at the top of the heap
    back to the OS on free and maps large blocks afresh, so every step faults the same pages in
    again, zero-filled; how often depends on the process's heap history, not on the loop. Measured
    with bench/step_overhead.py (tiny config, 1 thread): 16-31k minor page faults per step in the
    recipe against 8-12k in the bare loop, +10 % step time; with trimming off, none on either side
    and 0.0 % overhead. The cost: a CPU process's resident memory stays at its peak. CUDA memory
    has its own caching allocator and is not affected.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's <malloc.h>
    never = 2**31 - 1
    return bool(
        libc.mallopt(m_trim_threshold, never)
        and libc.mallopt(m_top_pad, 64 << 20)
        and libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest: blocks up to 32 MB reuse the heap
    )


def release_freed_memory(device: torch.device) -> bool:
    """CPU runs, glibc only: hand the heap's free pages back to the OS (malloc_trim); False elsewhere.

    What keep_freed_memory keeps for the next step is kept after the last one too: the held-out evaluation
    after training, the merge and the saves then grew the README's SmolLM2 LoRA to 5.50 GB against its steps'
    5.29 (docs/benchmarks.md, "CPU: resident memory of the README's LoRA fine-tune by allocator"). Called before each evaluation: the next training step
    faults its pages back in once (~1 s a GB), against 1.6-1.8x every step's CPU time when trimmed between
    micro-batches (the peak of a step falls from 5.3 to 4.1 GB that way).
    """
    if device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True
