"""The strategy: one place that turns an `accelerate launch` into a correctly configured run.

`Strategy.launch(...)` is built once per run, from the accelerate config file the user launched
with (DDP, FSDP, DeepSpeed ZeRO-1/2/3) and the recipe's batch sizes. It holds every fact about
how this launch trains (world size, accumulation, backend, ZeRO stage, offload, which blocks a
DeepSpeed JSON owns, FSDP version), and the rest of the toolkit asks it: nothing outside this
package reads WORLD_SIZE/RANK, imports deepspeed or branches on the distributed type. Accelerate's quirks on CPU-only machines are handled here, each with the
reason, so that the same file trains the same way on CPU (gloo) and GPU (NCCL), and never
silently trains unsharded or unsynchronised:

- DDP: without `cpu=True`, Accelerate on a CPU machine treats a multi-process launch as a
  single process: the model is not wrapped in DDP and ranks silently train apart (measured:
  losses diverge). So with no GPU we force `cpu=True`, and name gloo (`cpu=True` alone picks
  MPI when torch was built with it).
- DeepSpeed: `cpu=True` makes Accelerate drop DeepSpeed altogether, and without a backend it
  reports a single process. So on CPU we leave `cpu` off, pass gloo, and DeepSpeed runs on its
  CPU accelerator (DS_ACCELERATOR=cpu, set when the toolkit is imported, before DeepSpeed is).
- FSDP: Accelerate applies FSDP only on GPU-like devices; on CPU the config would do nothing.
  torch's FSDP2 `fully_shard` does shard and train on CPU over gloo, so after creating the
  Accelerator on CPU we set its distributed type to FSDP and give it the plugin from the
  launch environment; `prepare` then takes Accelerate's own FSDP2 path. A launch of one process
  gets it too (over a gloo group of one), as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from toolkit.config import UserError, read_json
from toolkit.launch.environment import (
    LAUNCHED_PRECISION,
    has_gpu,
    launched_mixed_precision,
    launched_strategy,
    world_size,
)
from toolkit.launch.rank_process import within
from toolkit.models.loss import backward_scale
from toolkit.strategy.context_parallel import ContextParallel, sequence_problem
from toolkit.strategy.context_parallel import problems as context_parallel_problems
from toolkit.strategy.pipeline_parallel import Pipeline
from toolkit.strategy.sequence_parallel import SequenceParallel, skip_shared_memory_kernel
from toolkit.strategy.sequence_parallel import problems as sequence_parallel_problems
from toolkit.strategy.sequence_parallel import sequence_problem as sequence_parallel_problem
from toolkit.strategy.tensor_parallel import expert_ranks, split
from toolkit.strategy.tensor_parallel import sequence_problem as tensor_parallel_sequence_problem

T = TypeVar("T")

DATA_PARALLEL = {
    DistributedType.NO: "single process",
    DistributedType.MULTI_CPU: "DDP",
    DistributedType.MULTI_GPU: "DDP",
}


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
                f"{LAUNCHED_PRECISION} is {launched}; the toolkit trains in bf16, fp16 or fp32: set mixed_precision "
                "\"no\" in the accelerate config (and drop --mixed_precision), then choose with train.mixed_precision"
            )
        if choice not in ("auto", launched):
            raise UserError(
                f"{LAUNCHED_PRECISION} is {launched} (its config file or --mixed_precision) and "
                f"train.mixed_precision={choice}: they contradict each other; keep one (the shipped accelerate configs "
                "say \"no\" so that train.mixed_precision decides)"
            )
        choice, source = launched, f"{LAUNCHED_PRECISION}={launched}"
    if choice == "fp16" and not has_gpu():
        raise UserError(f"{source} needs a GPU; this machine has none (use auto or no for fp32, or bf16)")
    if choice != "auto":
        return choice
    if has_gpu() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def check_deepspeed_config() -> dict | None:
    """Read the launched DeepSpeed JSON ourselves first, so that mistakes are one clear line."""
    if launched_strategy() != "deepspeed":
        return None
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
    ds = read_json(path)  # a key written twice is refused, not the last one taken
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{path}: zero_optimization.stage={stage!r}; DeepSpeed ZeRO stages are 0, 1, 2 or 3")
    return ds


_LIVE_UNTIL_EXIT: list = []


def prepare(accelerator: Accelerator, *objects):
    """`accelerator.prepare`, with what it returns kept alive until the process exits.

    Freeing a DDP model drops its Reducer and with it the gloo process group, while the main
    thread holds the GIL: that can deadlock (see exit_process). Accelerate keeps only the
    unwrapped module of a DDP model, so without this the wrapper dies when the function holding
    it returns, before exit_process can skip destructors.
    """
    prepared = accelerator.prepare(*objects)
    _LIVE_UNTIL_EXIT.append(prepared)
    return prepared


_COLLECTIVE_TIMEOUT_S: int | None = None


def set_collective_timeout(seconds: int) -> timedelta:
    """How long any collective may wait before it fails, for the default group and all later ones.

    The launch's process group gets it through Accelerate; groups that DeepSpeed and FSDP create
    later with `new_group` take torch's per-backend default instead (30 min for gloo, 10 for
    NCCL), read from module globals of distributed_c10d: those are set here too. A run whose
    ranks fall out of step then stops with an error (see toolkit.training.entry) rather than sleeping.
    """
    import torch.distributed.distributed_c10d as c10d

    global _COLLECTIVE_TIMEOUT_S
    _COLLECTIVE_TIMEOUT_S = seconds
    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    # Each step of a group's creation has its own timeout; the whole is bounded here too (see
    # rank_process.within), in each module callers find new_group in: DeepSpeed's comm looks it up
    # in torch.distributed, FSDP2's device mesh imported it into its own module.
    import torch.distributed.device_mesh as device_mesh

    for module in (torch.distributed, c10d, device_mesh):
        if hasattr(module, "new_group") and not hasattr(module.new_group, "bounded"):
            module.new_group = _bounded_new_group(module.new_group)
    return timeout


def _bounded_new_group(new_group: Callable) -> Callable:
    @functools.wraps(new_group)
    def bounded(*args, **kwargs):
        with creating_groups("creating a process group (new_group)"):
            return new_group(*args, **kwargs)

    bounded.bounded = True
    return bounded


def creating_groups(what: str):
    """A process group's creation, ended with the collective-timeout line and exit code 4 once it
    waits past train.collective_timeout_s (with a little room, so that torch's own timeout, where
    it fires, is the one reported)."""
    seconds = _COLLECTIVE_TIMEOUT_S or 1800
    return within(seconds * 1.05 + 5, what, _group_never_formed)


def _group_never_formed(what: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    print(
        f"error: [rank {rank}] waited {_COLLECTIVE_TIMEOUT_S} s (train.collective_timeout_s) {what} for ranks "
        "that never joined: a rank is stuck elsewhere or died, or an earlier launch's ranks share the rendezvous; "
        "see the other ranks' errors",
        file=sys.stderr, flush=True,
    )
    os._exit(4)  # the main thread is blocked in C++: only ending the process stops it


def build_accelerator(
    mixed_precision: str, accumulation_steps: int, project_dir: str, trackers: list[str] | None = None,
    timeout_s: int = 1800,
) -> Accelerator:
    """The Accelerator for the launched strategy; `timeout_s` bounds every collective (see set_collective_timeout)."""
    strategy = launched_strategy()
    check_deepspeed_config()
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # FSDP2 under a launcher (torchrun's MASTER_ADDR), even of one process: on a GPU Accelerate
    # applies FSDP to one process too, and a checkpoint must move between FSDP2 at any world size
    fsdp_on_cpu = strategy == "fsdp" and not has_gpu() and (multi or "MASTER_ADDR" in os.environ)
    timeout = set_collective_timeout(timeout_s)
    kwargs: dict = {}
    if not has_gpu():
        if strategy == "deepspeed":
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
        else:
            kwargs["cpu"] = True
            if multi or fsdp_on_cpu:  # one plain process: no process group at all
                kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
    elif multi:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(timeout=timeout)]
    with creating_groups("creating the launch's process group") if multi else contextlib.nullcontext():
        if multi:
            join_restarted_group("nccl" if has_gpu() else "gloo", timeout)
        try:
            accelerator = Accelerator(
                mixed_precision=resolve_mixed_precision(mixed_precision),
                gradient_accumulation_steps=accumulation_steps,
                log_with=trackers or None,
                project_dir=project_dir,
                **kwargs,
            )
        except ValueError as exc:
            raise UserError(ignored_beside_deepspeed_json(exc)) from None
    if accelerator.distributed_type == DistributedType.FSDP:
        reduce_gradients_in_fp32(accelerator.state.fsdp_plugin)
    if fsdp_on_cpu:
        from accelerate.state import PartialState
        from accelerate.utils import FullyShardedDataParallelPlugin

        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator


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


# torch 2.13 deprecates the collectives DeepSpeed 0.19 calls in every ZeRO step, and transformers'
# catch_warnings blocks reset Python's once-per-place memory, so the same two lines came back ~80 times
# a step (486 lines in 6 steps of pretrain_tiny under zero3.yaml): nothing a user can act on.
DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def configure_deepspeed(accelerator: Accelerator, micro_batch: int, max_grad_norm: float) -> list[str]:
    """Fill DeepSpeed's "auto" values from the recipe; refuse values that contradict it.

    Returns what the DeepSpeed JSON itself takes over (its own optimizer/scheduler), for the log.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return []
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
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    try:
        yield
    finally:
        os.environ.update(saved_env)
        if deepspeed:
            accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


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


def check_fsdp_layers(accelerator: Accelerator, model: torch.nn.Module | Callable[[], torch.nn.Module]) -> None:
    """An FSDP config naming a layer class the model does not have would fail deep inside
    prepare; check it first. `model` may be a function building it (the pretraining recipe
    builds a memory-free meta copy, and only under FSDP: under ZeRO-3 a model constructed
    while DeepSpeed's config is registered would go through zero.Init)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    if not isinstance(model, torch.nn.Module):
        model = model()
    named = accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap or []
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in named if n not in present]
    if missing:
        layers = getattr(model, "_no_split_modules", None) or sorted(present)
        raise UserError(
            f"the FSDP config wraps {', '.join(missing)}, which this {type(model).__name__} does not have; "
            f"its decoder layer class is {', '.join(layers)} (or leave fsdp_transformer_layer_cls_to_wrap out)"
        )


def master_weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The trained weights in float32, the same under every strategy: on the main process, None elsewhere.

    Collective. Mixed precision keeps fp32 master weights, but where depends on the strategy:
    DDP and FSDP2 train the fp32 parameters themselves (autocast or FSDP's mixed-precision policy
    casts copies for compute), while DeepSpeed's bf16/fp16 modes turn the parameters into 16-bit
    copies and keep the fp32 masters partitioned in its optimizer, and Accelerate's
    `get_state_dict` returns those 16-bit copies. So under DeepSpeed each trained parameter's
    master is assembled (`safe_get_full_fp32_param`), and a frozen one (a LoRA's base), which has
    no master, is gathered as it is.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        state_dict = accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return None
        return {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = accelerator.unwrap_model(model)
    params = dict(module.named_parameters(remove_duplicate=False))  # tied names map to one parameter
    out = {}
    for name, value in module.state_dict().items():  # under ZeRO-3 the values are empty partitions
        param = params.get(name)
        if param is None:  # a buffer: whole on every rank
            full = value
        else:
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None:
                with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                    full = param.detach().clone()
        if accelerator.is_main_process:
            out[name] = full.float().cpu() if full.is_floating_point() else full.cpu()
    return out if accelerator.is_main_process else None


def offloads_optimizer_to_cpu(accelerator: Accelerator) -> bool:
    """DeepSpeed optimizer offload on a GPU machine (on a CPU machine there is nothing to offload)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not has_gpu():
        return False
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    return zero.get("offload_optimizer", {}).get("device", "none") == "cpu"


def zero_stage(accelerator: Accelerator) -> int | None:
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def strategy_name(accelerator: Accelerator) -> str:
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        offload = [k.split("_")[1] for k in ("offload_optimizer", "offload_param") if ds.get(k, {}).get("device", "none") != "none"]
        return f"DeepSpeed ZeRO-{zero_stage(accelerator)}" + (f" (offload {'+'.join(offload)})" if offload else "")
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    return DATA_PARALLEL.get(accelerator.distributed_type, str(accelerator.distributed_type).split(".")[-1])


def is_replicated(accelerator: Accelerator) -> bool:
    """Whether every rank holds the full parameters (DDP, ZeRO-1/2) rather than shards."""
    if accelerator.distributed_type in DATA_PARALLEL:
        return True
    return accelerator.distributed_type == DistributedType.DEEPSPEED and (zero_stage(accelerator) or 0) < 3


def describe(accelerator: Accelerator) -> str:
    """The line every run logs first: what is actually in force, not what was asked for."""
    backend = accelerator.state.backend or "none"
    precision = {"no": "fp32"}.get(str(accelerator.mixed_precision), str(accelerator.mixed_precision))
    if launched_mixed_precision() is not None:  # taken from the launcher, not train.mixed_precision
        precision += f" ({LAUNCHED_PRECISION})"
    return (
        f"strategy={strategy_name(accelerator)} world_size={accelerator.num_processes} backend={backend} "
        f"precision={precision} device={accelerator.device} "
        f"grad_accum={accelerator.gradient_accumulation_steps}"
    )


def collective_failure(exc: BaseException, step: int | None = None) -> str | None:
    """One line for an error raised inside a collective (timed out, or a peer gone); None for any other error.

    Names this rank, the collective, where the recipe was (innermost frame in recipes/ or
    toolkit/) and the step, so that a run whose ranks fell out of step says what it waited for.
    """
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = _TIMED_OUT.search(detail) is not None
    peer_lost = _PEER_LOST.search(detail) is not None
    # judged by what the error says, not by where it was raised: a bug inside FSDP or DDP code
    # must keep its traceback
    if not (timed_out or peer_lost or isinstance(exc, torch.distributed.DistError)):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    comm = [f for f in frames if _COMM_FILES.search(f.filename.replace(os.sep, "/"))]
    ops = [f.name for f in comm if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    ddp = [f.name for f in comm if f.filename.endswith("parallel/distributed.py")]
    op = ops[-1] if ops else f"DDP's {ddp[-1].strip('_')}" if ddp else "a collective"
    ours = [f for f in frames if _is_ours(f.filename)]
    where = f" in {_relative(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})" if ours else ""
    at_step = f" after step {step}" if step is not None else ""
    rank = int(os.environ.get("RANK", "0"))
    if timed_out:
        limit = f" {_COLLECTIVE_TIMEOUT_S} s (train.collective_timeout_s)" if _COLLECTIVE_TIMEOUT_S else ""
        what = (
            f"waited{limit} in {op}{where}{at_step} for ranks that never joined: the ranks fell out of step "
            "(one skipped this collective or is stuck elsewhere); see the other ranks' errors"
        )
    elif peer_lost:
        what = f"{op}{where}{at_step} failed because another rank stopped or lost its connection; see that rank's error"
    else:
        what = f"{op}{where}{at_step} failed in the communication backend"
    return f"[rank {rank}] {what} ({_short(detail)})"


def _is_ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_relative_to(_PACKAGE_ROOT / "toolkit") or path.is_relative_to(_PACKAGE_ROOT / "recipes")


def _relative(filename: str) -> str:
    return str(Path(filename).resolve().relative_to(_PACKAGE_ROOT))


def _short(detail: str) -> str:
    detail = re.sub(r"^\[[^\]]*\]\s*", "", detail)  # gloo's "[/path/to/pair.cc:553]" prefix
    return detail if len(detail) <= 160 else detail[:157] + "..."


_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Where collectives are entered (torch's c10d, DDP, DeepSpeed's comm) and what their failures say
# (gloo: "Timed out waiting 20000ms for recv operation", "Connection closed by peer"; NCCL's
# watchdog: "Watchdog caught collective operation timeout").
_COMM_FILES = re.compile(r"torch/distributed/|torch/nn/parallel/distributed\.py|deepspeed/comm/")
_TIMED_OUT = re.compile(r"[Tt]imed out|operation timeout|Timeout")
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|[Bb]roken pipe")


def parameter_digest(model: torch.nn.Module) -> str:
    """Exact fingerprint of the parameters held by this rank (bit-level)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        # FSDP2 holds DTensors, ZeRO-3 keeps this rank's partition in `ds_tensor`
        local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
        h.update(name.encode())
        h.update(local.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def check_replicas_in_sync(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Gather every rank's parameter digest; data-parallel replicas must be bit-identical."""
    from accelerate.utils import gather_object

    digests = gather_object([parameter_digest(accelerator.unwrap_model(model))])
    if is_replicated(accelerator) and len(set(digests)) > 1:
        raise RuntimeError(
            f"data-parallel ranks ended with different weights ({digests}); gradients were not "
            "synchronised. Report this with the launch command and accelerate config."
        )
    return digests


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


def parallelism_sizes(world: int) -> tuple[int, int, int]:
    """(cp, tp, sp): the context-, tensor- and sequence-parallel sizes an accelerate config's
    parallelism_config asks for, checked against the launch; its other axes are refused in one line
    until they are built. Accelerate is then told nothing of it: its ParallelismConfig refuses CPU
    processes, its context parallel (torch's ring attention) and its sequence parallel (DeepSpeed's
    registration) drop the attention mask, so that packed documents would see each other, and its
    FSDP2 + TP branch imports a class transformers 5.23 no longer has."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1, 1, 1
    size = {k: int(os.environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1")) for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    if size["dp_replicate"] > 1:
        raise UserError(
            f"accelerate config: parallelism_config_dp_replicate_size={size['dp_replicate']} is not supported yet; use "
            "parallelism_config_dp_shard_size with parallelism_config_cp_size (accelerate_configs/fsdp_cp.yaml), "
            "parallelism_config_tp_size (accelerate_configs/fsdp_tp.yaml) or parallelism_config_sp_size "
            "(accelerate_configs/zero3_sp.yaml)"
        )
    axes = [axis for axis in ("cp", "tp", "sp") if size[axis] > 1]
    if len(axes) > 1:
        first, second = axes[:2]
        raise UserError(
            f"accelerate config: parallelism_config_{first}_size={size[first]} with parallelism_config_{second}_size="
            f"{size[second]} is not supported yet; use one of them"
        )
    cp, tp, sp = size["cp"], size["tp"], size["sp"]
    model = cp * tp * sp
    if min(cp, tp, sp, size["dp_shard"]) < 1 or size["dp_shard"] * model != world:
        axis = axes[0] if axes else "tp"
        fix = (f"set parallelism_config_dp_shard_size to {world // model}" if world % model == 0 and world >= model
               else f"launch a multiple of {model} processes (--num_processes {model * max(1, size['dp_shard'])})")
        raise UserError(
            f"accelerate config: parallelism_config_dp_shard_size={size['dp_shard']} x parallelism_config_{axis}_size="
            f"{model} must equal the {world} processes launched; {fix}"
        )
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    return cp, tp, sp


def check_pipeline_launch(stages: int, world: int, model_parallel: int, mixed_precision: str = "no") -> None:
    """Refuses, before any process group exists, a pipeline the launch cannot hold."""
    if stages == 1:
        return
    if mixed_precision == "fp16":
        raise UserError(f"train.pipeline_stages={stages} with train.mixed_precision=fp16 is not supported (the schedule "
                        "runs the backward itself, without fp16's loss scaling); use bf16")
    if model_parallel > 1:
        raise UserError(f"train.pipeline_stages={stages} with an accelerate parallelism_config (cp, tp or sp) is not "
                        "supported yet; use accelerate_configs/ddp.yaml")
    if world % stages:
        raise UserError(f"train.pipeline_stages={stages} does not divide the {world} processes launched; launch a "
                        f"multiple of {stages} processes (replicas x stages)")


def check_whole(model: torch.nn.Module) -> None:
    """Generation in one process needs every weight here, not a ZeRO-3 partition or FSDP shard."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "to_local"):  # ZeRO-3 parameter / FSDP2 DTensor
            raise RuntimeError(
                f"cannot generate from a sharded model in one process ({name} is a ZeRO-3/FSDP shard); "
                "generate before prepare or from the saved folder (toolkit.training.samples.sample_folder)"
            )


@dataclass
class Strategy:
    """How this launch trains, and the strategy-specific operations the trainer and recipes need.

    Build it with `Strategy.launch`; `accelerator` is the configured Accelerator, for the
    strategy-neutral calls (accumulate, backward, reduce, save_state)."""

    accelerator: Accelerator
    world_size: int
    accumulation: int
    ds_owned: tuple[str, ...]  # "optimizer"/"scheduler" blocks a user's DeepSpeed JSON defines
    context: ContextParallel | None = None  # sequences split over groups of ranks (parallelism_config_cp_size)
    tp: int = 1  # ranks each layer is split over (parallelism_config_tp_size)
    ep: int = 1  # ranks a mixture of experts' experts are spread over: tp for an MoE (known once the model is)
    stages: int = 1  # pipeline stages the decoder layers are cut into (train.pipeline_stages)
    pipeline: Pipeline | None = None  # this rank's stage, once apply_model_parallel has cut the model
    sequence: SequenceParallel | None = None  # sequences split over groups of ranks (parallelism_config_sp_size)
    optimizer: torch.optim.Optimizer | None = None  # a pipeline's: its stage's state is saved by each stage
    notes: list[str] = dataclasses.field(default_factory=list)  # for the recipe's log, once the model is split

    @classmethod
    def launch(
        cls, *, mixed_precision: str, global_batch: int, micro_batch: int, max_grad_norm: float, project_dir: str,
        trackers: list[str] | None, timeout_s: int, pipeline_stages: int = 1,
    ) -> Strategy:
        """Collective: every rank. Batch sizes that do not divide fail before any process group exists."""
        world = world_size()
        cp, tp, sp = parallelism_sizes(world)
        check_pipeline_launch(pipeline_stages, world, cp * tp * sp, mixed_precision)
        accumulation = accumulation_steps(global_batch, micro_batch, world // (cp * tp * sp * pipeline_stages))
        accelerator = build_accelerator(mixed_precision, accumulation, project_dir, trackers, timeout_s)
        if pipeline_stages > 1 and accelerator.distributed_type not in DATA_PARALLEL:
            raise UserError(
                f"train.pipeline_stages={pipeline_stages} runs under accelerate_configs/ddp.yaml (the pipelines side "
                f"by side average their gradients themselves), not under {strategy_name(accelerator)}"
            )
        if accelerator.device.type == "cpu":
            keep_freed_memory()
        owned = configure_deepspeed(accelerator, micro_batch, max_grad_norm)
        context = ContextParallel(cp, accelerator.device) if cp > 1 else None
        sequence = SequenceParallel(sp, accelerator.device) if sp > 1 else None
        return cls(accelerator, world, accumulation, tuple(owned), context, tp=tp, stages=pipeline_stages,
                   sequence=sequence)

    # ----------------------------------------------------------------- facts
    @property
    def kind(self) -> str:
        """single, ddp, fsdp or deepspeed."""
        t = self.accelerator.distributed_type
        if t == DistributedType.DEEPSPEED:
            return "deepspeed"
        if t == DistributedType.FSDP:
            return "fsdp"
        return "single" if t == DistributedType.NO else "ddp"

    @property
    def name(self) -> str:
        if self.stages > 1:
            return f"pipeline of {self.stages} stages"
        return strategy_name(self.accelerator)

    @property
    def zero_stage(self) -> int | None:
        return zero_stage(self.accelerator)

    @property
    def is_replicated(self) -> bool:
        return self.stages == 1 and is_replicated(self.accelerator)

    @property
    def offloads_optimizer(self) -> bool:
        return offloads_optimizer_to_cpu(self.accelerator)

    @property
    def cp(self) -> int:
        """Ranks each sequence is split over (1 without context parallel)."""
        return 1 if self.context is None else self.context.cp

    @property
    def sp(self) -> int:
        """Ranks each sequence is split over by sequence parallel (1 without it)."""
        return 1 if self.sequence is None else self.sequence.sp

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(ranks that read different data, this rank's index among them): a context-, tensor- or
        sequence-parallel group, and the stages of a pipeline, read the same blocks."""
        group = self.cp * self.tp * self.sp * self.stages
        return self.world_size // group, self.rank // group

    @property
    def gradient_ranks(self) -> int:
        """Ranks the data-parallel wrapper averages gradients over: all of them, but the ranks of a
        tensor-parallel group hold different slices of one model (FSDP2 averages over its dp axis)."""
        return self.world_size // self.tp

    @property
    def loss_copies(self) -> int:
        """How many ranks compute each token's loss: the ranks of a tensor-parallel group compute the
        same one, so a sum over all ranks counts it tp times."""
        return self.tp

    def backward_scale(self, global_targets: int) -> float:
        """Factor turning a micro-batch's token loss sum into its share of the global per-token mean
        (toolkit.models.loss.backward_scale); a pipeline sums its micro-batches' and replicas' gradients
        as they are."""
        if self.pipeline is not None:
            return 1.0 / max(1, global_targets)
        return backward_scale(global_targets, self.gradient_ranks, self.accumulation)

    def split_sequences(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch -> this rank's share of its sequences (the batch itself without context or
        sequence parallel)."""
        if self.sequence is not None:
            return self.sequence.split(batch)
        return batch if self.context is None else self.context.split(batch)

    def check_sequence_length(self, seq_len: int) -> None:
        """Refuses, before any data is prepared, blocks that context, sequence or tensor parallel cannot split evenly."""
        problem = None if self.context is None else sequence_problem(self.cp, seq_len)
        if self.sequence is not None:
            problem = sequence_parallel_problem(self.sp, seq_len)
        problem = tensor_parallel_sequence_problem(self.tp, seq_len) or problem
        if problem:
            raise UserError(problem)

    def apply_model_parallel(self, model: torch.nn.Module, seq_len: int, attn_implementation: str) -> torch.nn.Module:
        """`model` as this launch's model parallelism needs it, before its optimizer is built: under
        context parallel its attention gathers the group's keys and values; under tensor parallel its
        layers are split over the tp ranks and sharded over the dp groups, and a mixture of experts'
        experts spread whole over the same tp ranks (expert parallel). What cannot be split is refused
        in one line. A dense model's tp split shards the sequence between layers too (Megatron's sequence
        parallel, tensor_parallel.sequence_layout)."""
        if self.context is not None:
            found = context_parallel_problems(model.config, self.cp, seq_len, attn_implementation)
            if found:
                raise UserError(found[0])
            self.context.apply(model)
        if self.sequence is not None:
            found = sequence_parallel_problems(model.config, self.sp, seq_len, attn_implementation)
            if found:
                raise UserError(found[0])
            self.sequence.apply(model)
        if self.tp > 1:
            if hasattr(model, "peft_config"):
                raise UserError(
                    "tensor parallel trains a whole model, not a LoRA adapter, yet; use fsdp.yaml or the zero configs"
                )
            model = split(model, self.tp, self.world_size // self.tp, attn_implementation)
            self.ep = expert_ranks(model)
            whole = model.tp_whole_between_layers
            self.notes.append(f"tensor_parallel={self.tp}: " + ("Megatron sequence parallel, hidden states split by sequence "
                       "between layers" if whole is None else f"hidden states whole between layers ({whole})"))
            # it arrives sharded: Accelerate's FSDP2 takes it as it is, and must not look for decoder
            # layers to wrap (sharded layers are FSDP subclasses that its lookup by class name misses)
            self.accelerator.state.fsdp_plugin.auto_wrap_policy = None
        if self.stages > 1:
            from toolkit.strategy.pipeline_parallel import problems as pipeline_problems

            found = pipeline_problems(model, self.stages)
            if found:
                raise UserError(found[0])
            self.pipeline = Pipeline(model, self.stages, self.accumulation, attn_implementation, self.device,
                                     self.accelerator.autocast)
            model = self.pipeline.module
        return model

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def describe(self) -> str:
        line = describe(self.accelerator)
        if self.context is not None:
            line += f" context_parallel={self.cp} (data_parallel={self.data_ranks[0]})"
        if self.sequence is not None:
            line += f" sequence_parallel={self.sp} (data_parallel={self.data_ranks[0]})"
        if self.tp > 1:
            experts = f" expert_parallel={self.ep}" if self.ep > 1 else ""
            line += f" tensor_parallel={self.tp}{experts} (data_parallel={self.data_ranks[0]})"
        if self.stages > 1:
            line += f" pipeline_stages={self.stages} (data_parallel={self.data_ranks[0]})"
        return line

    def print(self, *args) -> None:
        self.accelerator.print(*args)

    # ------------------------------------------------------- model and optimizer
    def check_fsdp_layers(self, model: torch.nn.Module | Callable[[], torch.nn.Module]) -> None:
        check_fsdp_layers(self.accelerator, model)

    def outside_training(self):
        return outside_training(self.accelerator)

    def adamw(self) -> type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer]:
        """The AdamW class to build: DeepSpeed refuses a torch optimizer for state it offloads to
        the CPU (it would be slow) and brings its own CPU AdamW, the same update."""
        if not self.offloads_optimizer:
            return torch.optim.AdamW
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return lambda groups, **kw: DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)

    def placeholder_optimizer(self, params: list, lr: float, weight_decay: float):
        """Stands in for the optimizer a user's DeepSpeed JSON defines (DeepSpeed builds the real one)."""
        from accelerate.utils import DummyOptim

        return DummyOptim(params, lr=lr, weight_decay=weight_decay)

    def placeholder_scheduler(self, optimizer, max_steps: int, warmup_steps: int):
        from accelerate.utils import DummyScheduler

        return DummyScheduler(optimizer, total_num_steps=max_steps, warmup_num_steps=warmup_steps)

    def prepare(self, *objects):
        if self.pipeline is None:
            return prepare(self.accelerator, *objects)
        # a stage is not wrapped (DDP would average it with the other stages); its optimizer is kept
        # to save with the stage
        self.optimizer = next((o for o in objects if isinstance(o, torch.optim.Optimizer)), None)
        return objects if len(objects) > 1 else objects[0]

    def master_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        if self.pipeline is not None:
            return self.pipeline.gathered_state_dict()
        return master_weights(self.accelerator, model)

    def model_to_save(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Main process: the model whose save_pretrained writes `state_dict` (master_weights) as one folder."""
        if self.pipeline is not None:
            return self.pipeline.whole_model(state_dict)
        return self.accelerator.unwrap_model(model)

    def check_replicas_in_sync(self, model: torch.nn.Module) -> list[str]:
        if self.pipeline is None:
            return check_replicas_in_sync(self.accelerator, model)
        from accelerate.utils import gather_object

        digests = gather_object([parameter_digest(model)])
        for stage in range(self.stages):
            if len(set(digests[stage::self.stages])) > 1:
                raise RuntimeError(f"the replicas of pipeline stage {stage} ended with different weights ({digests}); "
                                   "gradients were not synchronised. Report this with the launch command")
        return digests

    def device_map(self) -> dict[str, int]:
        """Where a quantised (QLoRA) base loads: this rank's own GPU."""
        return {"": self.accelerator.local_process_index}

    def prepared(self) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer], list]:
        """(models, optimizers, registered objects) as `prepare` and register_for_checkpointing handed them
        to Accelerate, unwrapped: the modules, the torch optimizers, the LR schedule. Accelerate keeps them
        in private lists only; they are read here alone, so that a change of its internals breaks one place."""
        acc = self.accelerator
        return ([acc.unwrap_model(m) for m in acc._models], [getattr(o, "optimizer", o) for o in acc._optimizers],
                list(acc._custom_objects))

    def on_main(self, compute: Callable[[], T]) -> T:
        """Collective: `compute()` run by the main process alone while the others wait, its value (or
        its UserError, raised) on every rank. The value must pickle."""
        from accelerate.utils import broadcast_object_list

        verdict: list = [None, None]  # [value, error line]
        if self.is_main:
            try:
                verdict[0] = compute()
            except UserError as exc:
                verdict[1] = str(exc)
        if self.world_size > 1:
            broadcast_object_list(verdict)
        if verdict[1] is not None:
            raise UserError(verdict[1])
        return verdict[0]
