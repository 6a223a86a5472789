"""What a strategy family does its own way, asked through three Protocols by who asks: `Runtime` (the Strategy and
the step), `Files` (the checkpoint: its parts, reading them back by name) and `Plan` (toolkit.planner's arithmetic,
before any launch). A family is one folder of toolkit/strategy/ (single, ddp, fsdp, deepspeed, pipeline) whose
`family.py` holds one object answering all three; toolkit.strategy.families names them. `DataParallel` holds the
defaults of the families that train one whole model per data-parallel rank."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.tensor import DTensor

from toolkit.launch.environment import has_gpu
from toolkit.models import float8
from toolkit.models.loss import backward_scale
from toolkit.models.parameters import parameter_names
from toolkit.parallel_layout import ParallelLayout

# toolkit.strategy.distributed.Strategy, which imports the families: they are handed it, and import nothing of it
Strategy = Any


class Runtime(Protocol):
    """What the Strategy and the training step ask."""

    host_decides: str | None  # why a non-finite step's skip is decided on the host (train.step_sync), or None

    def check_launch(self) -> None: ...
    def accelerator_kwargs(self, multi: bool, timeout) -> dict: ...
    def configure_accelerator(self, accelerator: Accelerator, multi: bool) -> None: ...
    def launched_details(self, accelerator: Accelerator) -> dict: ...
    def configure(self, accelerator: Accelerator, micro_batch: int, max_grad_norm: float) -> list[str]: ...
    def set_aside(self, accelerator: Accelerator) -> contextlib.AbstractContextManager: ...
    def replicated(self, layout: ParallelLayout) -> bool: ...
    def offloads_optimizer(self, strategy: Strategy) -> bool: ...
    def adamw(self, strategy: Strategy) -> Callable[..., torch.optim.Optimizer]: ...
    def check_layers(self, strategy: Strategy, model: torch.nn.Module | Callable[[], torch.nn.Module]) -> None: ...
    def qlora_storage(self, precision: str) -> torch.dtype | None: ...
    def prepare(self, strategy: Strategy, *objects): ...
    def backward_scale(self, strategy: Strategy, global_targets: int) -> float: ...
    def backward(self, accelerator, loss: torch.Tensor) -> None: ...
    def update(self, accelerator, model, optimizer, loss: torch.Tensor, max_grad_norm: float, skip_on_device: bool,
               weight_cast) -> tuple[torch.Tensor | None, str | torch.Tensor | None]: ...
    def master_weights(self, strategy: Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor] | None: ...
    def model_to_save(self, strategy: Strategy, model: torch.nn.Module, state_dict: dict) -> torch.nn.Module: ...
    def check_replicas(self, strategy: Strategy, model: torch.nn.Module) -> list[str]: ...
    def optimization_owned(self, strategy: Strategy) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Part:
    """One part of what a checkpoint holds: the files it is in (glob patterns below the checkpoint folder), what
    writes and what reads it. `always` False: only some runs write it; `weights`: export reads it for the weights
    (a damaged optimizer or RNG state does not stop an export of intact weights)."""

    name: str
    files: tuple[str, ...]
    written_by: str
    read_by: str
    always: bool = True
    weights: bool = False


class Files(Protocol):
    """What a checkpoint asks: `files` is the family's files module (its PARTS, is_mine, layout_from, full_weights,
    moments, load_into), shared by the families that write the same files (single writes DDP's)."""

    files: ModuleType

    def optimizer_names(self, strategy: Strategy) -> list[list[str]] | None: ...
    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool: ...
    def conversion_refused(self, strategy: Strategy) -> str | None: ...


class Plan(Protocol):
    """What toolkit.planner's memory model asks, before any launch. `run` is the planner's view of one launch
    (toolkit.planner.state.Run): its strategy (StrategyFacts), world, precision, micro_batch, local_seq,
    accumulation and param_dtype; the families read those and nothing else of it."""

    foreach_temporaries: bool

    def config_facts(self, path: Path, cfg: dict, hidden_size: int) -> tuple[dict, dict]: ...
    def casts_weights(self, layout: ParallelLayout) -> bool: ...
    def offloads_parameters(self, strategy: Strategy) -> bool: ...
    def state_on_host(self, facts) -> bool: ...
    def planned_parameter_bytes(self, run, bytes_per_weight: int) -> int: ...
    def planned_state(self, run, tensors: list, groups: list[list], stored: Callable, grad_bytes: int,
                      step_bytes: int) -> dict[str, int]: ...
    def planned_buffers(self, run, shapes, tensors: list, head, stage, grads_held: int,
                        dtype_bytes: tuple[int, int]) -> PlannedBuffers: ...
    def step_gradients(self, held: dict[str, int]) -> int: ...


class Family(Runtime, Files, Plan, Protocol):
    name: str  # the layout's family (ParallelLayout.family): single, ddp, fsdp, deepspeed or pipeline


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


class PlannedBuffers(NamedTuple):
    """What a family's communication and gathering keep, in bytes per rank (toolkit.planner.estimate)."""

    forward: int = 0
    backward: int = 0
    static: int = 0  # for the whole step
    end_of_backward: dict[str, int] | None = None  # a moment of its own, where the family has one


class DataParallel:
    """One whole model per data-parallel rank, prepared by Accelerate: the defaults the families override."""

    name = "ddp"
    host_decides = None

    # ------------------------------------------------------------------ the launch's (toolkit.strategy.accelerator)
    def check_launch(self) -> None:
        """Refuses, before any process group, a launch configuration that cannot work."""

    def accelerator_kwargs(self, multi: bool, timeout) -> dict:
        """What the Accelerator is built with: on a CPU machine Accelerate's CPU mode over gloo, with a process group
        only across processes; `timeout` bounds every collective."""
        if has_gpu():
            return {"kwargs_handlers": [InitProcessGroupKwargs(timeout=timeout)]} if multi else {}
        gloo = {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]} if multi else {}
        return {"cpu": True, **gloo}

    def configure_accelerator(self, accelerator: Accelerator, multi: bool) -> None:
        """What Accelerate leaves to set once the Accelerator is built."""

    def launched_details(self, accelerator: Accelerator) -> dict:
        """The ParallelLayout fields only the launched Accelerator knows (ZeRO stage, offload, FSDP version)."""
        return {}

    def configure(self, accelerator: Accelerator, micro_batch: int, max_grad_norm: float) -> list[str]:
        """The launch's own config filled from the recipe; what of the optimizer and schedule it defines itself."""
        return []

    def set_aside(self, accelerator: Accelerator) -> contextlib.AbstractContextManager:
        """What the family registers process-wide that a model built or generated from in one process must not see
        (toolkit.strategy.accelerator.outside_training)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the step's

    def replicated(self, layout: ParallelLayout) -> bool:
        """Whether every rank holds the full parameters rather than shards or stages."""
        return True

    def offloads_optimizer(self, strategy: Strategy) -> bool:
        return False

    def adamw(self, strategy: Strategy) -> Callable[..., torch.optim.Optimizer]:
        return torch.optim.AdamW

    def check_layers(self, strategy: Strategy, model) -> None:
        """Refuses, before prepare, a model the launch's config cannot wrap (FSDP's layer classes)."""

    def qlora_storage(self, precision: str) -> torch.dtype | None:
        """The dtype a 4-bit base's packed bytes are held in (bitsandbytes' quant_storage); None: its uint8. Each rank
        holds them whole here."""
        return None

    def prepare(self, strategy: Strategy, *objects):
        return prepare(strategy.accelerator, *objects)

    def backward_scale(self, strategy: Strategy, global_targets: int) -> float:
        return backward_scale(global_targets, strategy.gradient_ranks, strategy.accumulation)

    def backward(self, accelerator, loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def update(self, accelerator, model, optimizer, loss: torch.Tensor, max_grad_norm: float, skip_on_device: bool,
               weight_cast) -> tuple[torch.Tensor | None, str | torch.Tensor | None]:
        """Collective, at the accumulation boundary (toolkit.training.step.optimizer_step): clip once, agree whether
        any rank's `loss` or the gradients are not finite, and step unless so. (the pre-clipping gradient norm, what
        was not finite: None, "loss" or "grad", or the on-device flags with `skip_on_device`)."""
        if weight_cast is not None:
            weight_cast.release()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
        # the norm is of the reduced gradients (the same on every rank); the losses are each rank's
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
        # fp16: an overflowing gradient is the loss scaler's business (it skips and lowers the scale)
        norm = norm if accelerator.scaler is None else torch.zeros(())
        found = nonfinite_flags(accelerator, loss, norm)
        if skip_on_device:
            getattr(optimizer, "optimizer", optimizer).found_inf = (found.sum() > 0).float()  # the fused kernel skips on it
            optimizer.step()
            nonfinite = found
        else:
            nonfinite = verdict(found.tolist())
            if nonfinite is None:
                optimizer.step()
            elif accelerator.scaler is not None:
                accelerator.scaler.update()  # closes the unscale_ that clipping did, without a step
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, nonfinite

    def master_weights(self, strategy: Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: the fp32 parameters themselves (autocast or FSDP's policy casts copies for compute)."""
        acc = strategy.accelerator
        state_dict = acc.get_state_dict(model)
        if not acc.is_main_process:
            return None
        return {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}

    def model_to_save(self, strategy: Strategy, model: torch.nn.Module, state_dict: dict) -> torch.nn.Module:
        return strategy.accelerator.unwrap_model(model)

    def check_replicas(self, strategy: Strategy, model: torch.nn.Module) -> list[str]:
        """Collective: every rank's parameter digest; replicas must be bit-identical."""
        from accelerate.utils import gather_object

        digests = gather_object([parameter_digest(strategy.accelerator.unwrap_model(model))])
        if self.replicated(strategy.layout) and len(set(digests)) > 1:
            raise RuntimeError(
                f"data-parallel ranks ended with different weights ({digests}); gradients were not "
                "synchronised. Report this with the launch command and accelerate config."
            )
        return digests

    def optimizer_names(self, strategy: Strategy) -> list[list[str]] | None:
        """The parameter names of the optimizer's groups in the order its saved state numbers them, where the
        format does not name them itself (DDP's optimizer.bin); None."""
        return None

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """Whether Accelerate's load_state reads a checkpoint `saved` wrote into a run of `layout` as it is."""
        return saved.files == layout.files

    def conversion_refused(self, strategy: Strategy) -> str | None:
        """Why a checkpoint of another layout cannot be converted into this launch, or None."""
        return None

    def optimization_owned(self, strategy: Strategy) -> tuple[str, ...]:
        """What of the optimizer ("optimizer") and schedule ("scheduler") the launch's own config defines in place of
        the recipe's optim section."""
        return ()

    def cut(self, strategy: Strategy, model: torch.nn.Module, attn_implementation: str) -> torch.nn.Module:
        """The part of `model` this rank trains, once the other model-parallel layouts have split it."""
        return model

    def gathers_float8(self, layout: ParallelLayout) -> bool:
        """Whether fp8's weights are all-gathered in float8 (toolkit.models.float8.convert's fsdp2)."""
        return False

    def described(self, strategy: Strategy) -> str:
        """What the run's first log line adds for this family."""
        return ""

    # ------------------------------------------------------------------ what the memory meter counts
    def steps_in_backward(self, accelerator: Accelerator):
        """The engine whose `step` runs inside the last backward of a step (its gradients measured there), or None."""
        return None

    def partitions(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a parameter holds beside its own (local) tensor."""
        return ()

    def held_gradients(self, model: torch.nn.Module, wrappers: list, masters: list[torch.Tensor]) -> list:
        """Gradients held beside the parameters' own `.grad` (nested lists and dicts of them): `wrappers` are the
        optimizers between Accelerate's and torch's, `masters` what the optimizer updates."""
        return []

    # ------------------------------------- what the planner takes of the family (toolkit.planner), without a launch
    foreach_temporaries = True  # torch's foreach AdamW holds sqrt(v) temporaries at its step

    def config_facts(self, path: Path, cfg: dict, hidden_size: int) -> tuple[dict, dict]:
        """(the ParallelLayout's fields, the planner's StrategyFacts fields) that accelerate config file `path`, read
        into `cfg`, sets for this family, as a launch would take them (toolkit.planner.facts.read_strategy)."""
        return {}, {}

    def casts_weights(self, layout: ParallelLayout) -> bool:
        """Whether the strategy casts the weights to the compute dtype, rather than autocast each matmul's input."""
        return False

    def offloads_parameters(self, strategy: Strategy) -> bool:
        """Whether the launched strategy keeps the parameters on the CPU."""
        return False

    def state_on_host(self, facts) -> bool:
        """Whether the weights, gradients and optimizer state all stay on the host (StrategyFacts `facts`)."""
        return False

    def planned_parameter_bytes(self, run, bytes_per_weight: int) -> int:
        """The bytes of a weight as the family holds it (toolkit.planner.state.Run `run`)."""
        return bytes_per_weight

    def planned_state(self, run, tensors, groups, stored, grad_bytes, step_bytes) -> dict[str, int]:
        """The largest rank's params, grads (at the accumulation boundary), optimizer state and fp32 masters, of
        `tensors` (toolkit.planner.state.Held) in their optimizer `groups`; `stored(t, numel)`: a weight's bytes."""
        train = sum(t.numel for g in groups for t in g)
        return {"params": int(sum(stored(t) for t in tensors)), "grads": train * grad_bytes,
                "optimizer": 8 * train + step_bytes * sum(len(g) for g in groups), "master": 0}

    def planned_buffers(self, run, shapes, tensors, head, stage, grads_held, dtype_bytes) -> PlannedBuffers:
        """The buffers its communication keeps (toolkit.planner.estimate); `dtype_bytes`: the residual stream's and the
        matmul inputs' (toolkit.planner.activations.dtypes)."""
        return PlannedBuffers()

    def step_gradients(self, held: dict[str, int]) -> int:
        """The gradient bytes held at the optimizer step."""
        return held["grads"]


def named_groups(strategy: Strategy) -> list[list[str]] | None:
    """The parameter names of the one prepared optimizer's groups, in their order (None for several models)."""
    models, optimizers, _ = strategy.prepared()
    if len(models) != 1 or len(optimizers) != 1:
        return None
    names = parameter_names(models[0])
    return [[names[id(p)][0] for p in group["params"]] for group in optimizers[0].param_groups]


def held_values(param: torch.Tensor) -> torch.Tensor:
    """The values of a parameter that this rank holds: FSDP2's local shard of a DTensor, or ZeRO-3's
    partition (`ds_tensor`) without its padding. DeepSpeed pads the last partitions of a parameter whose
    size the world does not divide with uninitialised memory, which may read as NaN."""
    if isinstance(param, DTensor):
        return float8.unwrapped(param.to_local())
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    start = param.ds_zero_partition_rank * part.numel()
    return part.narrow(0, 0, max(0, min(part.numel(), param.ds_numel - start)))


def parameter_digest(model: torch.nn.Module) -> str:
    """Exact fingerprint of the parameters held by this rank (bit-level)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        local = held_values(p)
        h.update(name.encode())
        h.update(local.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


DATA_PARALLEL = DataParallel()  # the step of a bare Accelerator (tests, tools)


def nonfinite_flags(accelerator: Accelerator, *values: torch.Tensor) -> torch.Tensor:
    """For each 0-d value, on how many ranks it is NaN or inf: one all-reduce, left on the device."""
    found = (~torch.isfinite(torch.stack([v.to(accelerator.device, torch.float64) for v in values]))).double()
    if accelerator.num_processes > 1:
        found = accelerator.reduce(found, reduction="sum")
    return found


def any_nonfinite(accelerator: Accelerator, *values: torch.Tensor) -> list[bool]:
    """For each 0-d value, whether it is NaN or inf on any rank, read on the host."""
    return [v > 0 for v in nonfinite_flags(accelerator, *values).tolist()]


def verdict(flags: list[float]) -> str | None:
    """The host's reading of optimizer_step's on-device flags: "loss", "grad" or None."""
    return "loss" if flags[0] > 0 else "grad" if flags[1] > 0 else None

