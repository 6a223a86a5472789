"""What the memory estimate is asked about: the strategy an accelerate config (or a live launch) lays the
model out by, and the run (world, batch, sequence, checkpointing, precision)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from toolkit.config.errors import UserError, first_line
from toolkit.config.files import read_yaml
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.families import family_of
from toolkit.strategy.parallelism import AXES, parallel_layout

STRATEGY_SPEED = {"ddp": 1.0, "zero1": 1.02, "zero2": 1.03, "fsdp": 1.05, "zero3": 1.1, "fsdp_cp": 1.1, "fsdp_tp": 1.15,
                  "zero3_sp": 1.15, "fsdp_sp": 1.1, "pipeline": 1.0}  # see rank_key


@dataclass
class StrategyFacts:
    """What decides the memory layout, read from an accelerate config (and its DeepSpeed JSON)."""

    name: str  # the config's file stem: ddp, fsdp, zero1, ...
    layout: ParallelLayout  # of any world: a Run says how many processes
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket: int = 0  # elements
    prefetch_bucket: int = 0  # elements (ZeRO-3)
    persistence_threshold: int = 0  # elements (ZeRO-3): parameters this small are also kept whole
    overlap_comm: bool = False
    reshard_after_forward: bool = True  # FSDP2


def read_strategy(path: str | Path, hidden_size: int) -> StrategyFacts:
    """An accelerate config file -> StrategyFacts; DeepSpeed "auto" sizes as Accelerate fills them. A value of the
    wrong type (a size that is not a number, a section that is not a mapping) is one line naming the file."""
    try:
        return _read_strategy(Path(path), hidden_size)
    except (ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"{path} (or the DeepSpeed config it names) holds a value of the wrong type ({first_line(exc)}); "
                        "compare it with accelerate_configs/ and ds_configs/") from None


def _read_strategy(path: Path, hidden_size: int) -> StrategyFacts:
    cfg = read_yaml(path) or {}
    if not isinstance(cfg, dict):
        raise UserError(f"{path} must hold a mapping of keys (an accelerate config), found {type(cfg).__name__}")
    kind = cfg.get("distributed_type", "NO")
    parallel = cfg.get("parallelism_config") or {}
    if not isinstance(parallel, dict):
        raise UserError(f"{path}: parallelism_config must be a mapping (parallelism_config_tp_size: 2, ...)")
    sizes = {axis: int(parallel.get(f"parallelism_config_{axis}_size", 1)) for axis in AXES}
    # made as a launch makes it: one function decides what the sizes mean and which are refused
    try:
        layout = parallel_layout(kind, sizes)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    details, facts = family_of(layout).config_facts(path, cfg, hidden_size)
    return StrategyFacts(path.stem, replace(layout, **details), **facts)


@dataclass
class Run:
    strategy: StrategyFacts
    world: int
    micro_batch: int
    seq_len: int
    accumulation: int = 1
    checkpointing: Literal["none", "full", "every_k", "selective"] = "none"
    every_k: int = 2
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"  # the compute dtype (autocast or cast weights)
    param_dtype: torch.dtype = torch.float32  # the model's own weights (a fine-tune may load bf16)
    attention: str = "sdpa"  # sdpa | flash_attention_2 | flex_attention | eager
    loss_chunk_tokens: int = 0  # 0 = full logits; > 0 = model.loss=chunked
    packed_documents: bool = True  # sdpa/eager build a (batch, 1, seq, seq) mask from the document positions
    quantized_base: bool = False  # QLoRA: frozen linear weights in 4-bit NF4 with double quantisation
    fused_adam: bool = True  # torch's fused AdamW (CUDA): no temporaries beside the state
    compiled: bool = False  # model.compile: each decoder layer compiled (activations.compiled_bytes_per_token)
    cast_per_step: bool = False  # model.cast_weights: autocast's weight copies made once per step, held through it

    def __post_init__(self):
        if self.world < 1 or self.micro_batch < 1 or self.seq_len < 1 or self.accumulation < 1:
            raise UserError(f"world={self.world}, micro_batch={self.micro_batch}, seq_len={self.seq_len} must be positive")
        group = self.strategy.layout.cp * self.strategy.layout.tp * self.strategy.layout.sp
        if self.world % group:
            raise UserError(f"{self.strategy.name}: cp x tp x sp = {group} ranks do not divide world={self.world}; "
                            f"use a multiple of {group} processes")
        if self.world % self.strategy.layout.pp:
            raise UserError(f"train.pipeline_stages={self.strategy.layout.pp} does not divide world={self.world}; use a "
                            f"multiple of {self.strategy.layout.pp} processes (replicas x stages)")
        if self.strategy.layout.pp > 1 and self.loss_chunk_tokens > 0:
            # the last stage's loss is the schedule's loss_fn of its logits (toolkit.strategy.pipeline.stages)
            raise UserError(f"train.pipeline_stages={self.strategy.layout.pp}: model.loss=chunked does not run in a "
                            "pipeline; use model.loss=full")
        if self.strategy.layout.tp > 1 and self.loss_chunk_tokens > 0:
            # the chunked loss multiplies the hidden states by the head's weight itself, and under tensor
            # parallel that weight is a DTensor: torch refuses the mixed matmul
            raise UserError(f"{self.strategy.name}: model.loss=chunked does not run under tensor parallel; "
                            "use model.loss=full")

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence this rank holds: 1/cp of them under context parallel, 1/sp under
        sequence parallel."""
        return self.seq_len // (self.strategy.layout.cp * self.strategy.layout.sp)

    @property
    def own_attention(self) -> bool:
        """Whether the attention is the toolkit's own sdpa call with enable_gqa (context and sequence
        parallel: k and v never repeated, the block-causal mask always given), not transformers'."""
        return self.strategy.layout.cp > 1 or self.strategy.layout.sp > 1




def rank_key(strategy: str, checkpointing: str, every_k: int, micro_batch: int, offload: bool, stages: int = 1,
             micro_batches: int = 1) -> float:
    """Relative step time, for ranking what fits (a heuristic, not a measurement): recomputation
    costs about one more forward (a third of forward + backward) per checkpointed layer share;
    sharded parameters are gathered every layer (ZeRO-3, FSDP2), context parallel also gathers every
    layer's keys and values, sequence parallel all-to-alls every layer's q, k, v and output, tensor parallel all-reduces activations twice a layer each way (fast
    only inside a node); offload moves the optimizer to the CPU; DeepSpeed's engine adds a little
    per step; a small micro-batch leaves the GPU underused; a pipeline of `stages` idles (stages - 1) /
    (micro_batches + stages - 1) of each step (1F1B's bubble). Selective recomputation redoes only what lies
    between the matmuls and the attention: little arithmetic, but a pass over memory, taken as a tenth of full's."""
    recompute = {"none": 0.0, "full": 1 / 3, "every_k": 1 / (3 * max(1, every_k)), "selective": 1 / 30}[checkpointing]
    bubble = (micro_batches + stages - 1) / micro_batches
    return ((1 + recompute) * STRATEGY_SPEED.get(strategy, 1.1) * (2.0 if offload else 1.0) * (1 + 0.5 / micro_batch)
            * bubble)




def live_facts(strategy) -> StrategyFacts:
    """StrategyFacts of a launched toolkit.strategy.distributed.Strategy (what read_strategy reads
    from its config file), for the sizes of model state."""
    layout = strategy.layout
    return StrategyFacts(layout.name, layout, offload_optimizer=strategy.offloads_optimizer,
                         offload_params=strategy.family.offloads_parameters(strategy))
