"""The Strategy: what this launch is (its ParallelLayout, accumulation, the blocks a DeepSpeed JSON owns),
built once per run by `Strategy.launch`, and the strategy-specific operations the trainer and recipes ask
of it (docs/architecture.md, "Where a strategy quirk goes")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from accelerate import Accelerator

from toolkit.config.combinations import PIPELINE_LAYOUT
from toolkit.config.errors import UserError
from toolkit.launch.environment import (
    LAUNCHED_PRECISION,
    gpu_short,
    launched_mixed_precision,
    world_size,
)
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.accelerator import (
    build_accelerator,
    keep_freed_memory,
    outside_training,
)
from toolkit.strategy.context_parallel import ContextParallel, sequence_problem
from toolkit.strategy.context_parallel import problems as context_parallel_problems
from toolkit.strategy.families import family_of
from toolkit.strategy.family import Family
from toolkit.strategy.parallelism import (
    accumulation_steps,
    check_pipeline_launch,
    device_mesh,
    launched_sizes,
    model_parallel_sizes,
    parallel_layout,
)
from toolkit.strategy.sequence_parallel import SequenceParallel
from toolkit.strategy.sequence_parallel import problems as sequence_parallel_problems
from toolkit.strategy.sequence_parallel import sequence_problem as sequence_parallel_problem
from toolkit.strategy.tensor_parallel import expert_ranks, split
from toolkit.strategy.tensor_parallel import sequence_problem as tensor_parallel_sequence_problem

T = TypeVar("T")

def launched_layout(accelerator: Accelerator, sizes: dict[str, int], world: int, stages: int = 1) -> ParallelLayout:
    """This launch's ParallelLayout: the strategy kind, ZeRO stage, offload and FSDP version as the
    Accelerator took them from the accelerate config (and its DeepSpeed JSON)."""
    layout = parallel_layout(accelerator.distributed_type, sizes, world, stages)
    return replace(layout, **family_of(layout).launched_details(accelerator))


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
    layout: ParallelLayout  # its ep is known once the model is: apply_model_parallel replaces it then
    accumulation: int
    ds_owned: tuple[str, ...]  # "optimizer"/"scheduler" blocks a user's DeepSpeed JSON defines
    context: ContextParallel | None = None  # sequences split over groups of ranks (parallelism_config_cp_size)
    sequence: SequenceParallel | None = None  # sequences split over groups of ranks (parallelism_config_sp_size)
    pipeline: Any = None  # this rank's stage (toolkit.strategy.pipeline.stages.Pipeline), once its family cut the model
    mesh: Any = None  # the launch's one device mesh (parallelism.device_mesh); None without model parallel
    notes: list[str] = field(default_factory=list)  # for the recipe's log, once the model is split
    float8: bool = False  # train.mixed_precision=fp8: bf16 autocast, its large linear layers in float8

    @classmethod
    def launch(
        cls, *, mixed_precision: str, global_batch: int, micro_batch: int, max_grad_norm: float, project_dir: str,
        trackers: list[str] | None, timeout_s: int, pipeline_stages: int = 1,
    ) -> Strategy:
        """Collective: every rank. Batch sizes that do not divide fail before any process group exists."""
        if short := gpu_short():
            raise UserError(short)
        world = world_size()
        sizes = launched_sizes(world)
        cp, tp, sp = model_parallel_sizes(sizes)
        check_pipeline_launch(pipeline_stages, world, cp * tp * sp, mixed_precision)
        accumulation = accumulation_steps(global_batch, micro_batch, world // (cp * tp * sp * pipeline_stages))
        accelerator = build_accelerator(mixed_precision, accumulation, project_dir, trackers, timeout_s)
        layout = launched_layout(accelerator, sizes, world, pipeline_stages)
        if line := PIPELINE_LAYOUT.refused(None, layout, mixed_precision):
            raise UserError(line)
        if accelerator.device.type == "cpu":
            keep_freed_memory()
        owned = family_of(layout).configure(accelerator, micro_batch, max_grad_norm)
        mesh = device_mesh(layout, accelerator.device.type)
        context = ContextParallel(cp, accelerator.device, mesh) if cp > 1 else None
        sequence = SequenceParallel(sp, accelerator.device, mesh) if sp > 1 else None
        return cls(accelerator, layout, accumulation, tuple(owned), context, sequence, mesh=mesh,
                   float8=mixed_precision == "fp8")

    # ----------------------------------------------------------------- facts
    @property
    def family(self) -> Family:
        """What this launch's strategy family does its own way (toolkit.strategy.families)."""
        return family_of(self.layout)

    @property
    def is_replicated(self) -> bool:
        """Whether every rank holds the full parameters (DDP, ZeRO-1/2) rather than shards or stages."""
        return self.family.replicated(self.layout)

    @property
    def offloads_optimizer(self) -> bool:
        """DeepSpeed optimizer offload on a GPU machine (on a CPU machine there is nothing to offload)."""
        return self.family.offloads_optimizer(self)

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(ranks that read different data, this rank's index among them): a context-, tensor- or
        sequence-parallel group, and the stages of a pipeline, read the same blocks."""
        return self.layout.dp, self.rank // self.layout.model_parallel

    @property
    def gradient_ranks(self) -> int:
        """Ranks the data-parallel wrapper averages gradients over: all of them, but the ranks of a
        tensor-parallel group hold different slices of one model (FSDP2 averages over its dp axis)."""
        return self.layout.world // self.layout.tp

    @property
    def loss_copies(self) -> int:
        """How many ranks compute each token's loss: the ranks of a tensor-parallel group compute the
        same one, so a sum over all ranks counts it tp times."""
        return self.layout.tp

    def backward_scale(self, global_targets: int) -> float:
        """Factor turning a micro-batch's token loss sum into its share of the global per-token mean
        (toolkit.models.loss.backward_scale); a pipeline sums its micro-batches' and replicas' gradients
        as they are."""
        return self.family.backward_scale(self, global_targets)

    def split_sequences(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch -> this rank's share of its sequences (the batch itself without context or
        sequence parallel)."""
        if self.sequence is not None:
            return self.sequence.split(batch)
        return batch if self.context is None else self.context.split(batch)

    def check_sequence_length(self, seq_len: int) -> None:
        """Refuses, before any data is prepared, blocks that context, sequence or tensor parallel cannot split evenly."""
        problem = None if self.context is None else sequence_problem(self.layout.cp, seq_len)
        if self.sequence is not None:
            problem = sequence_parallel_problem(self.layout.sp, seq_len)
        problem = tensor_parallel_sequence_problem(self.layout.tp, seq_len) or problem
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
            found = context_parallel_problems(model.config, self.layout.cp, seq_len, attn_implementation)
            if found:
                raise UserError(found[0])
            self.context.apply(model)
        if self.sequence is not None:
            found = sequence_parallel_problems(model.config, self.layout.sp, seq_len, attn_implementation)
            if found:
                raise UserError(found[0])
            self.sequence.apply(model)
        if self.layout.tp > 1:
            model = split(model, self.layout.tp, self.layout.world // self.layout.tp, attn_implementation, self.mesh)
            self.layout = replace(self.layout, ep=expert_ranks(model))
            whole = model.tp_whole_between_layers
            self.notes.append(f"tensor_parallel={self.layout.tp}: " + ("Megatron sequence parallel, hidden states split by sequence "
                       "between layers" if whole is None else f"hidden states whole between layers ({whole})"))
            # it arrives sharded: Accelerate's FSDP2 takes it as it is, and must not look for decoder
            # layers to wrap (sharded layers are FSDP subclasses that its lookup by class name misses)
            self.accelerator.state.fsdp_plugin.auto_wrap_policy = None
        return self.family.cut(self, model, attn_implementation)

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
        """The line every run logs first: what is actually in force, not what was asked for."""
        acc = self.accelerator
        precision = {"no": "fp32"}.get(str(acc.mixed_precision), str(acc.mixed_precision))
        if self.float8:
            precision = "fp8 (float8 linear layers, bf16 elsewhere)"
        if launched_mixed_precision() is not None:  # taken from the launcher, not train.mixed_precision
            precision += f" ({LAUNCHED_PRECISION})"
        line = (f"strategy={self.layout.accelerate_name} world_size={acc.num_processes} backend={acc.state.backend or 'none'} "
                f"precision={precision} device={acc.device} grad_accum={acc.gradient_accumulation_steps}")
        if self.context is not None:
            line += f" context_parallel={self.layout.cp} (data_parallel={self.data_ranks[0]})"
        if self.sequence is not None:
            line += f" sequence_parallel={self.layout.sp} (data_parallel={self.data_ranks[0]})"
        if self.layout.tp > 1:
            experts = f" expert_parallel={self.layout.ep}" if self.layout.ep > 1 else ""
            line += f" tensor_parallel={self.layout.tp}{experts} (data_parallel={self.data_ranks[0]})"
        return line + self.family.described(self)

    def print(self, *args) -> None:
        self.accelerator.print(*args)

    # ------------------------------------------------------- model and optimizer
    def check_fsdp_layers(self, model: torch.nn.Module | Callable[[], torch.nn.Module]) -> None:
        """A config naming a layer class the model does not have would fail deep inside prepare; check it first.
        `model` may be a function building it (the pretraining recipe builds a memory-free meta copy, and only
        under FSDP: under ZeRO-3 a model constructed while DeepSpeed's config is registered would go through
        zero.Init)."""
        self.family.check_layers(self, model)

    def outside_training(self):
        return outside_training(self.accelerator)

    def adamw(self) -> type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer]:
        """The AdamW class to build (DeepSpeed's own where it offloads the optimizer)."""
        return self.family.adamw(self)

    def placeholder_optimizer(self, params: list, lr: float, weight_decay: float):
        """Stands in for the optimizer a user's DeepSpeed JSON defines (DeepSpeed builds the real one)."""
        from accelerate.utils import DummyOptim

        return DummyOptim(params, lr=lr, weight_decay=weight_decay)

    def placeholder_scheduler(self, optimizer, max_steps: int, warmup_steps: int):
        from accelerate.utils import DummyScheduler

        return DummyScheduler(optimizer, total_num_steps=max_steps, warmup_num_steps=warmup_steps)

    def prepare(self, *objects):
        return self.family.prepare(self, *objects)

    def master_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The trained weights in float32, the same under every strategy: on the main process, None elsewhere.
        Collective. Mixed precision keeps fp32 master weights, but where depends on the strategy (its backend)."""
        return self.family.master_weights(self, model)

    def model_to_save(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Main process: the model whose save_pretrained writes `state_dict` (master_weights) as one folder."""
        return self.family.model_to_save(self, model, state_dict)

    def check_replicas_in_sync(self, model: torch.nn.Module) -> list[str]:
        """Collective: every rank's parameter digest; data-parallel replicas (of each pipeline stage) must be
        bit-identical."""
        return self.family.check_replicas(self, model)

    def device_map(self) -> dict[str, int | str]:
        """Where a quantised (QLoRA) base loads: this rank's own GPU, or the CPU (bitsandbytes' CPU kernels)."""
        return {"": self.accelerator.local_process_index if self.accelerator.device.type == "cuda" else "cpu"}

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
        if self.layout.world > 1:
            broadcast_object_list(verdict)
        if verdict[1] is not None:
            raise UserError(verdict[1])
        return verdict[0]
