"""Per-GPU memory of a training run, estimated from the model's shapes before anything is allocated.

    model = meta model (no weights); facts = read_strategy("accelerate_configs/zero3.yaml", hidden)
    est = estimate(model, Run(facts, world=8, micro_batch=8, seq_len=2048, checkpointing="full", ...))
    est.peak_bytes, est.parts          # what the largest rank allocates at its peak, and why

docs/memory.md gives every formula. In short, a rank holds:

- model state, tensor by tensor, as each strategy lays it out: DDP whole; FSDP2 a dim-0 shard of
  every parameter; ZeRO-1/2 flat groups padded to 2 x world elements and cut into world parts
  (optimizer state, fp32 masters; ZeRO-2 also gradients); ZeRO-3 each parameter cut into
  ceil(numel / world) elements, small ones (stage3_param_persistence_threshold) also kept whole.
  These are exact: tests compare them with the bytes of the live tensors at 2 and 3 ranks.
  Tensor parallel (fsdp_tp.yaml) first cuts each tensor as transformers' plan does, then FSDP2
  shards the slice over the world / tp data-parallel groups; context parallel (fsdp_cp.yaml) is
  FSDP2 over every rank, as fsdp.yaml; sequence parallel (zero3_sp.yaml) is ZeRO-3 over every rank,
  as zero3.yaml. A pipeline (train.pipeline_stages=p under ddp.yaml) holds on
  each rank its stage's tensors whole, as DDP would (a tied embedding/head on the first and the last).
- activations saved for backward, per token and decoder layer, from the shapes (hidden h, MLP i,
  query and key/value widths, heads) and the dtypes: the residual stream (fp32 under autocast
  with fp32 weights, the compute dtype when the strategy casts the weights), the compute dtype
  of matmuls, and which tensors autograd keeps (counted on CPU with saved_tensors_hooks in a test).
  Checkpointed layers keep only their input; backward recomputes one layer at a time. Tensor
  parallel divides a layer's attention and MLP activations by tp; under sdpa or eager attention a
  dense model's residual stream, norms, checkpointed inputs and final norm are 1/tp too (Megatron's
  sequence parallel: attention and MLP keep their gathered whole-sequence input), under flex or flash
  attention and for a mixture of experts they stay whole (transformers' plan; its experts get 1/tp of
  the routed copies, balanced routing assumed); context parallel
  keeps seq_len / cp tokens per rank, and each layer the whole sequence's gathered keys and values;
  sequence parallel keeps seq_len / sp tokens per rank, and each layer's attention the whole
  sequence for heads / sp of the heads, under one block-causal mask of the whole sequence that all
  the layers share. A pipeline stage keeps those of its own layers for each
  micro-batch in flight (1F1B: min(p - stage, micro-batches)).
- logits and loss buffers: the full path's (tokens x vocab) fp32 copies, or the chunked loss's
  one chunk plus its hidden and weight gradients.
- communication and gathering buffers: DDP's reducer buckets (a second copy of the gradients),
  ZeRO's reduce bucket, ZeRO-3's gathered layer and prefetch bucket, FSDP2's unsharded layer(s); a
  pipeline stage's receive buffers, one per micro-batch of the step (torch allocates them up front).

The peak is the largest of three moments of a step: the end of a forward (everything saved, the
loss computed), the backward of the last layer (its activations recomputed, gradients arriving)
and the optimizer step. With gradient accumulation the gradients of earlier micro-batches are
held through every later forward. `reserve_bytes` (CUDA context and allocator slack) is kept
apart: `peak_bytes` is comparable with `torch.cuda.max_memory_allocated`. A pipeline's estimate is
its largest stage's (`Estimate.stage` says which).

Modelled decoders: LLaMA-style (llama, mistral, qwen2, qwen3: RMSNorm, rotary attention with
grouped KV heads, Qwen3's per-head q/k norms, SwiGLU MLP) and Qwen3-MoE and Mixtral (the same attention, in every
layer a router and top-k experts run by transformers' grouped_mm, and the router loss the toolkit
adds), under fsdp_tp.yaml their experts spread over the tp ranks (expert parallel, ep = tp) with the
routing assumed balanced (moe_bytes_per_token). Compilation is not modelled: the eager estimate is an
upper bound of a compiled layer's saved activations.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from toolkit.config import UserError, read_json, read_yaml
from toolkit.models.router import expert_count
from toolkit.strategy.tensor_parallel import SEQUENCE_ATTENTION

LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
MIXTURES = ("qwen3_moe", "mixtral")  # LLaMA-style attention, every layer's MLP a mixture of experts (transformers' grouped_mm experts)
STRATEGY_SPEED = {"ddp": 1.0, "zero1": 1.02, "zero2": 1.03, "fsdp": 1.05, "zero3": 1.1, "fsdp_cp": 1.1, "fsdp_tp": 1.15,
                  "zero3_sp": 1.15, "fsdp_sp": 1.1, "pipeline": 1.0}  # see rank_key
CUDA_CONTEXT = 600 * 2**20  # what a CUDA context and its kernels take outside the allocator (H100: ~500-700 MiB)
ALLOCATOR_SLACK = 0.05  # cached-but-free blocks the caching allocator keeps beside the allocated peak


@dataclass
class StrategyFacts:
    """What decides the memory layout, read from an accelerate config (and its DeepSpeed JSON)."""

    name: str  # the config's file stem: ddp, fsdp, zero1, ...
    kind: Literal["ddp", "fsdp", "deepspeed"]
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket: int = 0  # elements
    prefetch_bucket: int = 0  # elements (ZeRO-3)
    persistence_threshold: int = 0  # elements (ZeRO-3): parameters this small are also kept whole
    overlap_comm: bool = False
    reshard_after_forward: bool = True  # FSDP2
    cp: int = 1  # ranks each sequence is split over (parallelism_config_cp_size)
    tp: int = 1  # ranks each layer is split over (parallelism_config_tp_size)
    sp: int = 1  # ranks each sequence is split over by sequence parallel, attention by heads (parallelism_config_sp_size)
    stages: int = 1  # pipeline stages, one per rank (train.pipeline_stages under ddp.yaml)


def read_strategy(path: str | Path, hidden_size: int) -> StrategyFacts:
    """An accelerate config file -> StrategyFacts; DeepSpeed "auto" sizes as Accelerate fills them."""
    path = Path(path)
    cfg = read_yaml(path) or {}
    kind = cfg.get("distributed_type", "NO")
    parallel = cfg.get("parallelism_config") or {}
    sp = int(parallel.get("parallelism_config_sp_size", 1))
    if kind == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        if str(fsdp.get("fsdp_version", 1)) != "2":
            raise UserError(f"{path}: the planner models FSDP2 (fsdp_version: 2)")
        return StrategyFacts(
            path.stem, "fsdp", offload_params=bool(fsdp.get("fsdp_offload_params", False)),
            reshard_after_forward=bool(fsdp.get("fsdp_reshard_after_forward", True)),
            cp=int(parallel.get("parallelism_config_cp_size", 1)), tp=int(parallel.get("parallelism_config_tp_size", 1)),
            sp=sp,
        )
    if kind == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        file = ds.get("deepspeed_config_file")
        if not file:
            raise UserError(f"{path}: the planner needs a deepspeed_config_file")
        json_path = Path(file) if Path(file).is_absolute() else path.parent.parent / file
        zero = read_json(json_path).get("zero_optimization", {})
        h2 = hidden_size * hidden_size

        def size(key: str, auto: float, default: float) -> int:
            """A DeepSpeed size: Accelerate's fill for "auto", DeepSpeed's default when absent."""
            value = zero.get(key, default)
            return int(auto if value == "auto" else value)

        def offloaded(key: str) -> bool:
            return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

        return StrategyFacts(
            path.stem, "deepspeed", zero_stage=int(zero.get("stage", 0)),
            offload_optimizer=offloaded("offload_optimizer"), offload_params=offloaded("offload_param"),
            reduce_bucket=size("reduce_bucket_size", h2, 5e8),
            prefetch_bucket=size("stage3_prefetch_bucket_size", 0.9 * h2, 5e7),
            persistence_threshold=size("stage3_param_persistence_threshold", 10 * hidden_size, 1e5),
            overlap_comm=bool(zero.get("overlap_comm", False)), sp=sp,
        )
    return StrategyFacts(path.stem, "ddp")


@dataclass
class Run:
    strategy: StrategyFacts
    world: int
    micro_batch: int
    seq_len: int
    accumulation: int = 1
    checkpointing: Literal["none", "full", "every_k"] = "none"
    every_k: int = 2
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"  # the compute dtype (autocast or cast weights)
    param_dtype: torch.dtype = torch.float32  # the model's own weights (a fine-tune may load bf16)
    attention: str = "sdpa"  # sdpa | flash_attention_2 | flex_attention | eager
    loss_chunk_tokens: int = 0  # 0 = full logits; > 0 = model.loss=chunked
    packed_documents: bool = True  # sdpa/eager build a (batch, 1, seq, seq) mask from the document positions
    quantized_base: bool = False  # QLoRA: frozen linear weights in 4-bit NF4 with double quantisation
    fused_adam: bool = True  # torch's fused AdamW (CUDA): no temporaries beside the state

    def __post_init__(self):
        if self.world < 1 or self.micro_batch < 1 or self.seq_len < 1 or self.accumulation < 1:
            raise UserError(f"world={self.world}, micro_batch={self.micro_batch}, seq_len={self.seq_len} must be positive")
        group = self.strategy.cp * self.strategy.tp * self.strategy.sp
        if self.world % group:
            raise UserError(f"{self.strategy.name}: cp x tp x sp = {group} ranks do not divide world={self.world}; "
                            f"use a multiple of {group} processes")
        if self.world % self.strategy.stages:
            raise UserError(f"train.pipeline_stages={self.strategy.stages} does not divide world={self.world}; use a "
                            f"multiple of {self.strategy.stages} processes (replicas x stages)")
        if self.strategy.stages > 1 and self.loss_chunk_tokens > 0:
            # the last stage's loss is the schedule's loss_fn of its logits (toolkit.strategy.pipeline_parallel)
            raise UserError(f"train.pipeline_stages={self.strategy.stages}: model.loss=chunked does not run in a "
                            "pipeline; use model.loss=full")
        if self.strategy.tp > 1 and self.loss_chunk_tokens > 0:
            # the chunked loss multiplies the hidden states by the head's weight itself, and under tensor
            # parallel that weight is a DTensor: torch refuses the mixed matmul
            raise UserError(f"{self.strategy.name}: model.loss=chunked does not run under tensor parallel; "
                            "use model.loss=full")

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence this rank holds: 1/cp of them under context parallel, 1/sp under
        sequence parallel."""
        return self.seq_len // (self.strategy.cp * self.strategy.sp)

    @property
    def own_attention(self) -> bool:
        """Whether the attention is the toolkit's own sdpa call with enable_gqa (context and sequence
        parallel: k and v never repeated, the block-causal mask always given), not transformers'."""
        return self.strategy.cp > 1 or self.strategy.sp > 1


@dataclass
class Estimate:
    parts: dict[str, int]  # params, grads, optimizer, master, activations, logits_loss, buffers: at the peak
    peak_bytes: int
    moment: str  # which moment of the step is the peak
    reserve_bytes: int
    held: dict[str, int] = field(default_factory=dict)  # model state of the largest rank, as held_bytes measures it
    stage: int | None = None  # a pipeline's largest stage (whose rank this estimate is)


# ---------------------------------------------------------------------------- model state
@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool  # QLoRA's 4-bit base weight
    tp_dim: int | None = None  # the dimension tensor parallel cuts (transformers' plan); None: whole on every rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tp_slice(self, tp: int) -> tuple[int, ...]:
        """This tensor's shape on the first rank of a tensor-parallel group (DTensor's Shard gives the
        first ranks ceil(size / tp))."""
        if tp == 1 or self.tp_dim is None:
            return self.shape
        return tuple(math.ceil(n / tp) if d == self.tp_dim else n for d, n in enumerate(self.shape))


def model_tensors(model: torch.nn.Module, quantized_base: bool = False) -> list[_Tensor]:
    """Every parameter once (tied weights once, under the embedding's name), in the optimizer's order:
    decay (matrices) first; each with the dimension the model's tensor-parallel plan cuts. A mixture of
    experts is split by its expert-parallel plan over the same ranks (toolkit.strategy.tensor_parallel:
    ep = tp), which cuts the expert weights by experts (dim 0; measured on 2 gloo processes)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    config = getattr(model, "config", None)
    ep_plan = getattr(config, "base_model_ep_plan", None) if config is not None and expert_count(config) else None
    if ep_plan:
        prefix = getattr(model, "base_model_prefix", "model")
        plan.update({f"{prefix}.{key}": "experts" for key, style in ep_plan.items() if style == "grouped_gemm"})
    out = []
    for name, p in model.named_parameters():
        linear_in_layer = p.ndim == 2 and ".layers." in name and "lora_" not in name
        out.append(_Tensor(
            name, tuple(p.shape), p.requires_grad, quantized_base and linear_in_layer and not p.requires_grad,
            _tp_dim(plan, name, p.ndim),
        ))
    return out


def _tp_dim(plan: dict[str, str], name: str, ndim: int) -> int | None:
    """The dimension of parameter `name` that transformers' plan cuts (its styles in
    transformers.distributed.tensor_parallel): colwise (and the head's colwise_gather_output) the
    output features, which is dim 0 of a weight and of a bias; rowwise the input features of the
    weight, its bias whole; embedding_rowwise the vocabulary rows. Anything else (norms, Qwen3's
    per-head q/k norms) is whole on every rank."""
    module, _, param = name.rpartition(".")
    style = plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", module))
    if plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", name)) == "experts":  # the experts' 3-D weights are named whole
        return 0
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise", "experts"):
        return 0
    if style == "rowwise" and param == "weight":
        return ndim - 1
    return None


def _groups(tensors: list[_Tensor]) -> list[list[_Tensor]]:
    """toolkit.training.optim's parameter groups: trainable matrices (decay), then vectors."""
    trainable = [t for t in tensors if t.trainable]
    return [g for g in ([t for t in trainable if len(t.shape) >= 2], [t for t in trainable if len(t.shape) < 2]) if g]


@dataclass
class Stage:
    """What one rank runs: the whole model, or stage `index` of a pipeline of `stages`."""

    index: int
    stages: int
    layers: range  # the decoder layers it runs, by their index in the whole model
    in_flight: int  # micro-batches whose activations it keeps at once

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def pipeline_stages(layers: int, stages: int, micro_batches: int) -> list[Stage]:
    """toolkit.strategy.pipeline_parallel's cut (layer_ranges), each stage with the micro-batches torch's
    Schedule1F1B keeps alive on it: stage s runs p - s forwards before its first backward, then one
    forward per backward, so min(p - s, m) micro-batches' activations at most (the first stage the most)."""
    from toolkit.strategy.pipeline_parallel import layer_ranges

    return [Stage(i, stages, r, min(stages - i, micro_batches)) for i, r in enumerate(layer_ranges(layers, stages))]


def stage_tensors(model: torch.nn.Module, tensors: list[_Tensor], stage: Stage) -> list[_Tensor]:
    """The tensors of model_tensors() that `stage` holds: its decoder layers, the input embedding on the
    first stage, everything else (final norm, head) on the last; a tied embedding/head is a copy on the
    first and on the last stage (Pipeline sums their gradients), so both count it."""
    if stage.stages == 1:
        return tensors
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {id(m): n for n, m in base.named_modules()}
    layers_prefix = names[id(base.get_decoder().layers)] + "."
    embedding = names[id(base.get_input_embeddings())] + ".weight"
    output = base.get_output_embeddings()
    tied = output is not None and output.weight is base.get_input_embeddings().weight
    held = []
    for t in tensors:
        name = t.name.removeprefix("base_model.model.")
        if name.startswith(layers_prefix):
            mine = int(name[len(layers_prefix):].split(".", 1)[0]) in stage.layers
        elif name == embedding:
            mine = stage.first or (tied and stage.last)
        else:
            mine = stage.last
        if mine:
            held.append(t)
    return held


def state_bytes(tensors: list[_Tensor], run: Run) -> dict[str, int]:
    """The largest rank's params, grads (at the accumulation boundary), optimizer state and fp32
    master weights, in the terms of toolkit.strategy.sharding.held_bytes."""
    s, w = run.strategy, run.world
    pb = torch.finfo(run.param_dtype).bits // 8
    if s.kind == "deepspeed" and run.precision != "fp32":
        pb = 2  # DeepSpeed's bf16/fp16 mode turns the module's weights to 16 bits; fp32 masters apart
    gb = pb  # gradients come in the weights' dtype
    step = 4  # torch AdamW's step: one fp32 scalar per state-holding tensor
    groups = _groups(tensors)

    def stored(t: _Tensor, numel: int | None = None) -> float:
        n = t.numel if numel is None else numel
        return n * 0.516 if t.quantized else n * (2 if run.quantized_base and not t.trainable else pb)

    if s.kind == "ddp" or (s.kind == "deepspeed" and s.zero_stage == 0):
        train = sum(t.numel for g in groups for t in g)
        n_state = sum(len(g) for g in groups)
        return {
            "params": int(sum(stored(t) for t in tensors)),
            "grads": train * gb,
            "optimizer": 8 * train + step * n_state,
            "master": 0,
        }
    if s.kind == "fsdp":
        # tensor parallel: FSDP2 shards each rank's slice over the data-parallel groups (the 2-D
        # mesh dp x tp); context parallel: over every rank (Accelerate's FSDP2, as fsdp.yaml)
        dp = w // s.tp

        def shard(t: _Tensor) -> int:  # rank 0 holds the first ceil(dim0 / dp) rows of its slice
            shape = t.tp_slice(s.tp)
            rows = min(math.ceil(shape[0] / dp), shape[0]) if shape else 1
            return math.prod(shape) // max(1, shape[0]) * rows if shape else 1

        train = [t for g in groups for t in g]
        return {
            "params": int(sum(stored(t, shard(t)) for t in tensors)),
            "grads": sum(shard(t) for t in train) * gb,
            "optimizer": sum(8 * shard(t) + step for t in train),
            "master": 0,
        }
    if s.zero_stage in (1, 2):
        # stage_1_and_2.py: each group flattened, padded to a multiple of 2 x world, cut in world parts
        parts = [math.ceil(sum(t.numel for t in g) / (2 * w)) * 2 for g in groups]
        part = sum(parts)
        full_grads = sum(t.numel for g in groups for t in g) * gb
        return {
            "params": int(sum(stored(t) for t in tensors)),
            "grads": part * gb,  # measured at the boundary: ZeRO-1 has reduced them into its partition too
            "optimizer": 0 if s.offload_optimizer else 8 * part + step * len(parts),
            "master": 0 if s.offload_optimizer else 4 * part,
            "grads_peak": full_grads if s.zero_stage == 1 else part * gb,
        }
    # ZeRO-3: every parameter partitioned; the small ones (persistence threshold) also whole
    def part3(t: _Tensor) -> int:
        return math.ceil(t.numel / w)

    train = [t for g in groups for t in g]
    persisted = sum(stored(t) for t in tensors if t.numel <= s.persistence_threshold)
    partitions = sum(stored(t, part3(t)) for t in tensors)
    master = sum(part3(t) for t in train)
    return {
        "params": 0 if s.offload_params else int(partitions + persisted),
        "grads": master * gb,
        "optimizer": 0 if s.offload_optimizer else 8 * master + step * len(groups),
        "master": 0 if s.offload_optimizer else 4 * master,
    }


# ---------------------------------------------------------------------------- activations
@dataclass
class Shapes:
    """A LLaMA-style decoder's sizes (what its saved activations depend on)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_params: int  # one decoder layer's parameters (what FSDP2 / ZeRO-3 gather at once)
    experts: int = 0  # a mixture of experts' experts per layer (0: a dense SwiGLU MLP)
    top_k: int = 0  # experts each token is routed to
    expert_params: int = 0  # one layer's expert weights (autocast casts none of them: grouped_mm runs in their dtype)
    norm_topk: bool = False  # the router renormalises its top-k weights (norm_topk_prob)
    qk_norm: bool = False  # RMSNorm on each head's query and key (Qwen3's q_norm, k_norm)
    fp32_routing: bool = False  # the router's top-k weights stay fp32 (Mixtral), not cast to its logits' dtype
    lora: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # adapted linear -> (in, rank, out)
    lora_dropout: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shapes:
        config = getattr(model, "config", None)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", config)
        model_type = getattr(config, "model_type", None)
        if model_type not in LLAMA_STYLE + MIXTURES:
            raise UserError(
                f"the memory planner models LLaMA-style decoders ({', '.join(LLAMA_STYLE)}) and mixtures of "
                f"experts ({', '.join(MIXTURES)}); model_type {model_type!r} is not modelled yet"
            )
        heads = config.num_attention_heads
        layer = base.model.layers[0]
        moe = {}
        if model_type in MIXTURES:
            if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
                raise UserError(f"the memory planner models {model_type} with a mixture of experts in every layer; "
                                "model.config.mlp_only_layers / decoder_sparse_step give dense layers too")
            if getattr(config, "experts_implementation", None) not in (None, "grouped_mm"):
                raise UserError(f"the memory planner models transformers' grouped_mm experts; "
                                f"model.config.experts_implementation={config.experts_implementation!r} is not modelled")
            experts = layer.mlp.experts
            moe = dict(experts=expert_count(config), top_k=config.num_experts_per_tok,
                       expert_params=sum(p.numel() for p in experts.parameters()),
                       norm_topk=bool(getattr(config, "norm_topk_prob", True)),  # Mixtral always renormalises
                       fp32_routing=model_type == "mixtral")
        lora, dropout = {}, False
        for name, module in layer.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a = module.lora_A["default"]
                lora[name.rsplit(".", 1)[-1]] = (a.in_features, a.out_features, module.base_layer.out_features)
                drop = module.lora_dropout["default"]
                dropout = dropout or isinstance(drop, torch.nn.Dropout)
        return cls(
            hidden=config.hidden_size, layers=config.num_hidden_layers,
            intermediate=getattr(config, "moe_intermediate_size", config.intermediate_size),
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
            layer_params=sum(p.numel() for p in layer.parameters()), lora=lora, lora_dropout=dropout, **moe,
            qk_norm=hasattr(layer.self_attn, "q_norm"),
        )


def dtypes(run: Run) -> tuple[int, int, bool]:
    """(bytes of the residual stream, bytes of matmul inputs, whether autocast casts each input).

    Autocast over fp32 weights (DDP, a single GPU) keeps an fp32 residual stream and casts every
    matmul's input on its own; FSDP2 (param_dtype) and DeepSpeed (bf16 mode) cast the weights
    instead, so the whole stream is in the compute dtype. Tensor parallel is autocast over fp32
    weights too: transformers' FSDP2 has no MixedPrecisionPolicy (DistributedConfig's
    fsdp_mixed_precision is off) and Accelerate takes that model as it is."""
    if run.precision == "fp32":
        return 4, 4, False
    cast_by_fsdp = run.strategy.kind == "fsdp" and run.strategy.tp == 1
    weights_cast = cast_by_fsdp or run.strategy.kind == "deepspeed" or run.param_dtype != torch.float32
    return (2, 2, False) if weights_cast else (4, 2, True)


def layer_bytes_per_token(shapes: Shapes, run: Run) -> float:
    """Bytes one decoder layer saves for backward per token (sequence-length terms folded in).

    RMSNorm: its fp32 input, 1/rms, the normalised x in the stream's dtype, and the output the
    projections read (one copy per projection under autocast). Attention (sdpa, flash, flex):
    q, k, v, out and the log-sum-exp, k and v repeated to every query head when sdpa gets the
    packed documents' mask; eager also the (heads x seq) probabilities in fp32 and in
    the compute dtype, and k, v repeated to every query head. SwiGLU: gate, silu(gate), up and
    their product. LoRA: the rank-r activations (and the dropout's copy of the input).

    Tensor parallel: each rank has 1/tp of the heads and of the MLP's width, so attention and MLP
    terms fall by tp; the projections' inputs are the whole sequence on every rank (under Megatron's
    sequence parallel the all-gathered input, which autocast casts once per projection, or which the
    projections share uncast). The norms' own tensors are per token of the residual stream: whole under
    transformers' plan, 1/tp under sequence parallel, which layer_bytes applies
    (norm_core_bytes_per_token). Context parallel's keys and values are layer_bytes's.

    Sequence parallel (per token of the rank's seq_len / sp): sdpa keeps q, k, v and its output for
    the whole sequence and heads / sp of the heads, which is q (and its output) per local token; k and
    v are max(kv_heads, sp) x head_dim per local token (each rank gets kv_heads / sp heads, or one
    replicated head when sp exceeds them), never repeated to the query heads (enable_gqa). The
    all-to-all back gives o_proj an input of its own (c·q), beside sdpa's output."""
    h, r, tp = shapes.hidden, run, run.strategy.tp
    i, heads = shapes.intermediate // tp, shapes.heads // tp
    q, kv = heads * shapes.head_dim, shapes.kv_heads // tp * shapes.head_dim
    rb, cb, casts = dtypes(r)
    lora = shapes.lora

    def norm(consumers: int) -> float:
        kept_output = consumers * cb * h if casts else (rb * h if consumers else 0)
        return 4 * h + 4 + rb * h + kept_output

    k = v = kv
    if run.attention == "sdpa" and run.packed_documents and not run.own_attention:
        # given a mask, transformers repeats k and v to every query head (use_gqa_in_sdpa); not context
        # parallel's attention. With one key/value head on the rank (kv_heads = tp) repeat_kv's reshape
        # is a view of it (stride 0 over the heads): v stays kv wide, k too unless autocast casts its
        # fp32 rotary output, which copies it out at q width (measured, tp 2)
        k = v = q
        if shapes.kv_heads // tp == 1:
            k, v = (q if casts else kv), kv
    attention = cb * (2 * q + k + v) + 4 * heads
    if run.strategy.sp > 1:  # the gathered k and v, and o_proj's input apart from sdpa's output
        attention = cb * (3 * q + 2 * max(shapes.kv_heads, run.strategy.sp) * shapes.head_dim) + 4 * heads
    elif run.attention == "eager" and run.strategy.cp == 1:  # context parallel runs its own sdpa attention
        attention = cb * 4 * q + (4 + cb) * heads * run.seq_len
    if shapes.qk_norm:  # per head: the fp32 input, 1/rms, the output in the projections' dtype (before any all-to-all)
        local_kv = shapes.kv_heads // tp
        attention += (4 + cb) * (heads + local_kv) * shapes.head_dim + 4 * (heads + local_kv)
    if shapes.experts:
        return norm(3) + attention + norm(0 if casts else 1) + moe_bytes_per_token(shapes, run)
    mlp = 4 * cb * i
    if not lora:
        return norm(3) + attention + norm(2) + mlp
    # LoRA: a frozen projection keeps no input (there is no weight gradient); its adapter keeps
    # the input (or the dropout's copy and mask) and its rank-r activation
    adapters = sum(cb * rank + ((cb + 1) * d_in if shapes.lora_dropout else 0) for d_in, rank, _ in lora.values())
    own = [n for n in lora if not shapes.lora_dropout]
    return (
        norm(sum(n in own for n in ("q_proj", "k_proj", "v_proj"))) + attention
        + norm(sum(n in own for n in ("gate_proj", "up_proj"))) + mlp + adapters
    )


def moe_bytes_per_token(shapes: Shapes, run: Run) -> float:
    """What a mixture-of-experts MLP (transformers' Qwen3-MoE block, grouped_mm experts) saves per token,
    measured on CPU. The router: its fp32 softmax (4 x experts), the top-k indices (8 x k), with
    norm_topk_prob the top-k weights and their sum (4k + 4); under autocast its input's cast (c·h).
    Per routed copy of a token (k of them): the gathered input (h), gate_up's output (2i), silu's
    output (i), the product (i) and down's output (h), in the dtype the experts run in, which is the
    weights' (grouped_mm is not autocast: fp32 under autocast over fp32 weights), the routing weight
    in the router's dtype (fp32 for Mixtral), and three int64 index vectors (sort permutation, sorted ids,
    token ids). Qwen3-MoE's and Mixtral's blocks (the same grouped_mm experts) measured alike.

    Expert parallel (fsdp_tp.yaml: ep = tp, transformers' AllToAllEP; measured on 2 gloo processes,
    model_parallel_memory_probe.py): the router runs on every token of the batch the tp ranks share and
    keeps the same as above for all of them. Each rank then sends the k routed copies of its 1/tp of the
    tokens to the ranks of their experts and keeps, per copy sent: the gather's int64 index (8), the
    int64 order the results come back in (8), the returned expert output (x·h) and its routing weight.
    Its experts run on the copies they receive, top-1 with unit weights, and keep per copy received:
    the gathered input (x·h), gate_up's output (2i), silu's (i), the product (i), the unit weight (x),
    the sentinel mask of the rows routed off the rank (1 byte) and two int64 indices (gather, inverse
    order); down's output is not kept (the unit weights need no gradient). A rank receives the copies
    routed to its num_experts / ep experts: k / ep per token with balanced routing, which the estimate
    assumes; imbalance makes a rank receive, and hold, more (up to min(k, experts / ep) per token when
    every token picks its experts)."""
    h, i, k = shapes.hidden, shapes.intermediate, shapes.top_k
    rb, cb, casts = dtypes(run)
    xb = rb  # the experts' dtype: the weights' (the residual stream's under autocast, cb when cast)
    weight = 4 if shapes.fp32_routing else cb  # a routing weight
    router = 4 * shapes.experts + 8 * k + ((4 * k + 4) if shapes.norm_topk else 0) + (cb * h if casts else 0)
    ep = run.strategy.tp  # expert parallel spreads the experts over the tp ranks
    if ep == 1:
        return router + k * (xb * (2 * h + 4 * i) + 24 + weight)
    sent = 8 + 8 + xb * h + weight
    received = xb * (h + 4 * i) + xb + 1 + 8 + 8
    return router + k * (sent + received) / ep


def gathered_kv_bytes(shapes: Shapes, run: Run) -> int:
    """Context parallel: the keys and values of the whole sequence that each layer all-gathers from
    its group and sdpa keeps for backward (0 without context parallel)."""
    if run.strategy.cp == 1:
        return 0
    return 2 * dtypes(run)[1] * shapes.kv_heads * shapes.head_dim * run.micro_batch * run.seq_len


def layer_bytes(shapes: Shapes, run: Run) -> int:
    """Bytes one decoder layer saves for backward on a rank, for one micro-batch: its seq_len / cp (or
    / sp) tokens, and under context parallel the gathered keys and values in place of its own. sdpa
    given a boolean mask (packed documents; context parallel's rows of it) converts it to the compute
    dtype in every layer and keeps that copy for backward (measured on CPU; torch's
    convert_boolean_attn_mask runs before any kernel is chosen). Sequence parallel's whole-sequence
    mask is made once per forward in the compute dtype and every layer keeps that same tensor:
    sequence_mask_bytes, counted once by activation_bytes, not here."""
    tokens = run.micro_batch * run.local_seq
    cb = dtypes(run)[1]
    own_kv = 2 * cb * shapes.kv_heads * shapes.head_dim * tokens if run.strategy.cp > 1 else 0
    masked = run.strategy.cp > 1 or (run.packed_documents and run.attention == "sdpa" and not run.own_attention)
    mask = cb * run.micro_batch * run.local_seq * run.seq_len if masked else 0
    offsets = 4 * shapes.experts // run.strategy.tp  # grouped_mm's int32 offsets, one per expert of the rank
    # tensor parallel's sequence parallel: the two norms keep their own tensors for the rank's part only
    norms_apart = 2 * norm_core_bytes_per_token(shapes, run) * (tokens - stream_tokens(shapes, run))
    return (round(layer_bytes_per_token(shapes, run) * tokens) - norms_apart - own_kv + gathered_kv_bytes(shapes, run)
            + mask + offsets)


def tp_sequence_parallel(shapes: Shapes, run: Run) -> bool:
    """Whether tensor parallel also shards the sequence between the layers (Megatron's sequence
    parallel, toolkit.strategy.tensor_parallel.sequence_layout): a dense model under sdpa or eager
    attention. A mixture of experts, or flex/flash attention, keeps transformers' plan."""
    return run.strategy.tp > 1 and not shapes.experts and run.attention in SEQUENCE_ATTENTION


def stream_tokens(shapes: Shapes, run: Run) -> int:
    """Tokens of the residual stream a rank holds between the layers, for one micro-batch: its seq_len
    / cp (or / sp) of each sequence, and under tensor parallel's sequence parallel the first rank's
    ceil(seq_len / tp) (DTensor's Shard(1))."""
    if tp_sequence_parallel(shapes, run):
        return run.micro_batch * math.ceil(run.seq_len / run.strategy.tp)
    return run.micro_batch * run.local_seq


def norm_core_bytes_per_token(shapes: Shapes, run: Run) -> int:
    """What an RMSNorm keeps of its own per token: its fp32 input, 1/rms and the normalised x in the
    stream's dtype (the output the projections read is theirs: layer_bytes_per_token's norm)."""
    return 4 * shapes.hidden + 4 + dtypes(run)[0] * shapes.hidden


def sequence_mask_bytes(run: Run) -> int:
    """Sequence parallel's block-causal mask of the whole sequence (micro-batch x 1 x seq x seq), additive
    in the compute dtype: made once per forward (SequenceParallel.mask) and given to every layer's sdpa,
    which keeps that one tensor (measured: two layers keep one storage); the strategy holds it until the
    next forward makes another, so through the backward and the optimizer step too. 0 without sequence
    parallel."""
    if run.strategy.sp == 1:
        return 0
    return dtypes(run)[1] * run.micro_batch * run.seq_len * run.seq_len


def router_loss_bytes(shapes: Shapes, run: Run, layers: int) -> int:
    """A mixture of experts' router loss (toolkit.models.router.RouterLoss, in every training step) over
    `layers` MoE layers: each router's logits (tokens x experts, the compute dtype) are recorded through
    the forward; the loss (transformers' load_balancing_loss_func) keeps for backward a softmax of each,
    as large, and drops the logits (its top-k indices die with their unused values); measured on CPU.
    Within the loss call both are alive for a moment (2x this), not counted. Checkpointing keeps them
    all the same (the routers' forwards are recorded, not their recomputation)."""
    if not shapes.experts:
        return 0
    tokens = run.micro_batch * run.local_seq
    return layers * tokens * dtypes(run)[1] * shapes.experts + 4 * shapes.experts


def activation_bytes(shapes: Shapes, run: Run, layers: range | None = None) -> dict[str, int]:
    """Saved activations of one micro-batch in `layers` (every decoder layer by default), split into
    what stays until backward and what backward adds."""
    tokens = run.micro_batch * run.local_seq
    rb, cb, casts = dtypes(run)
    per_layer = layer_bytes(shapes, run)
    layers = range(shapes.layers) if layers is None else layers
    # transformers checkpoints layer i when i % k == 0 (every_n_layers), numbered in the whole model
    every = {"none": 0, "full": 1, "every_k": max(1, run.every_k)}[run.checkpointing]
    ckpt = sum(i % every == 0 for i in layers) if every else 0
    kept = len(layers) - ckpt
    stream = stream_tokens(shapes, run)  # a checkpointed layer's input is the rank's part of the stream
    saved = kept * per_layer + ckpt * rb * shapes.hidden * stream
    # rotary cos/sin (shared by the layers), the token ids, the packed-document mask of sdpa/eager;
    # context parallel passes every rank its rows of the block-causal mask (micro-batch x seq/cp x seq);
    # sequence parallel its whole-sequence mask in the compute dtype, one for all the layers
    shared = 2 * run.local_seq * shapes.head_dim * rb + 8 * tokens + sequence_mask_bytes(run)
    shared += router_loss_bytes(shapes, run, len(layers))
    if run.strategy.sp == 1 and (run.strategy.cp > 1 or (run.packed_documents and run.attention in ("sdpa", "eager"))):
        shared += run.micro_batch * run.local_seq * run.seq_len
    # autocast's weight copies, saved by the matmuls (under tensor parallel each rank's slice, a router
    # whole; the norms' weights, whole on every rank, are ~1e-4 of a layer). grouped_mm's experts are not cast
    router = shapes.experts * shapes.hidden
    layer_params = (shapes.layer_params - shapes.expert_params - router) // run.strategy.tp + router
    casts_kept = cb * layer_params * kept if casts else 0
    recompute = per_layer + (cb * layer_params if casts else 0) if ckpt else 0
    # the gradient arriving at a layer and the MLP's intermediate gradients while backward runs through
    # it; under context parallel also the gathered keys' and values' gradients, until reduce-scattered
    inner = 2 * cb * shapes.intermediate // run.strategy.tp
    if shapes.experts:  # not measured: per routed copy the gradients of gate_up's output, the product and the input
        # (expert parallel: of the copies the rank's experts receive, k / tp per token when balanced)
        inner = dtypes(run)[0] * shapes.top_k * (3 * shapes.intermediate + shapes.hidden) / run.strategy.tp
    if run.strategy.sp > 1:
        # or, in the attention's backward, sdpa's gradients of q, k, v (whole sequence, heads / sp) beside
        # the all-to-all's outputs (this rank's tokens, every head), whichever the larger
        inner = max(inner, 2 * cb * (shapes.heads + 2 * max(shapes.kv_heads, run.strategy.sp)) * shapes.head_dim)
    transient = stream * 2 * rb * shapes.hidden + tokens * inner + gathered_kv_bytes(shapes, run)
    return {"saved": int(saved + shared + casts_kept), "recompute": int(recompute), "transient": int(transient)}


def loss_bytes(shapes: Shapes, run: Run, head_trainable: bool) -> dict[str, int]:
    """The output head and the loss: at the end of the forward, and what stays for backward."""
    tokens = run.micro_batch * run.local_seq
    rb, cb, casts = dtypes(run)
    h, v, tp = shapes.hidden, shapes.vocab, run.strategy.tp
    final_norm = stream_tokens(shapes, run) * norm_core_bytes_per_token(shapes, run)  # 1/tp under sequence parallel
    if run.loss_chunk_tokens <= 0:
        # logits in the compute dtype, their fp32 copy and log-softmax (saved); backward: two fp32 gradients.
        # Tensor parallel: the head is colwise_gather_output, so every rank all-gathers the whole logits
        # (its own 1/tp slice beside them while it does) and computes the same loss. Under sequence
        # parallel the head gathers the sequence first, and its cast input is the whole sequence's too
        head_input = tokens * (cb if casts else rb) * h  # the head's matmul keeps its input (autocast's cast of it)
        forward = tokens * v * (cb + 4 + 4) + (tokens * v * cb // tp if tp > 1 else 0)
        return {"forward": final_norm + head_input + forward, "kept": final_norm + head_input + tokens * v * 4,
                "backward": tokens * v * 12}
    chunk = min(run.loss_chunk_tokens, tokens)
    kept = tokens * h * rb + (4 * v * h if head_trainable else 0)  # d(loss)/d(hidden) and the head's fp32 gradient
    weight_cast = cb * v * h if casts else 0
    return {"forward": final_norm + kept + weight_cast + chunk * v * (2 * cb + 4), "kept": final_norm + kept, "backward": 0}


# ---------------------------------------------------------------------------- the estimate
def estimate(model: torch.nn.Module, run: Run) -> Estimate:
    """Per-GPU peak of one training step of `model` (built on the meta device) under `run`; a
    pipeline's largest stage's."""
    tensors = model_tensors(model, run.quantized_base)
    shapes = Shapes.of(model)
    p = run.strategy.stages
    stages = pipeline_stages(shapes.layers, p, run.accumulation) if p > 1 else [Stage(0, 1, range(shapes.layers), 1)]
    found = [_estimate_stage(stage_tensors(model, tensors, st), shapes, run, st) for st in stages]
    return max(found, key=lambda e: e.peak_bytes)


def _estimate_stage(tensors: list[_Tensor], shapes: Shapes, run: Run, stage: Stage) -> Estimate:
    held = state_bytes(tensors, run)
    s, w = run.strategy, run.world
    acts = activation_bytes(shapes, run, stage.layers)
    acts["saved"] *= stage.in_flight
    rb, cb, _ = dtypes(run)
    tokens = run.micro_batch * run.local_seq
    first_checkpointed = run.checkpointing == "full" or (run.checkpointing == "every_k" and stage.layers.start % run.every_k == 0)
    if not stage.first and (rb == 4 or first_checkpointed):
        # what the stage's first layer keeps of its input (fp32 for its norm, or a checkpoint's) is the
        # receive buffer itself, counted with the buffers
        acts["saved"] -= stage.in_flight * tokens * rb * shapes.hidden
    head = next((t for t in tensors if t.shape == (shapes.vocab, shapes.hidden)), None) if stage.last else None
    loss = loss_bytes(shapes, run, head is not None and head.trainable)
    if not stage.last:  # the final norm, the head and the loss are the last stage's
        loss = dict.fromkeys(loss, 0)
    grads_full = held["grads"]
    # between micro-batches ZeRO-1 keeps whole gradients, reduced into its partition only at the boundary;
    # a pipeline stage holds gradients beside its most activations only when a forward follows its first backward
    grads_held = held.get("grads_peak", grads_full) if run.accumulation > stage.in_flight else 0
    layer = shapes.layer_params // s.tp  # a rank's slice of a layer under tensor parallel (its norms whole: ~1e-4)
    # buffers that communication and gathering keep
    buffers_fwd = buffers_bwd = 0
    static_buffers = 0
    end_of_backward = None
    if s.stages > 1:  # a stage is not wrapped in DDP (Pipeline all-reduces its replicas' gradients itself)
        static_buffers = receive_buffers(shapes, run, stage)
    elif s.kind == "ddp" and w > 1:
        static_buffers = sum(t.numel for t in tensors if t.trainable) * (torch.finfo(run.param_dtype).bits // 8)
    elif s.kind == "fsdp" and s.tp > 1 and w // s.tp == 1:
        # tensor parallel with one data-parallel group: toolkit.strategy.tensor_parallel wraps only the
        # root in FSDP2 over a mesh of one, which copies every parameter into its unsharded buffer (torch's
        # world-size-1 path) and, being the root, keeps it from the forward to the end of the backward;
        # there all the unsharded gradients are held at once, then copied into the reduce's input
        pb = torch.finfo(run.param_dtype).bits // 8
        local = sum(math.prod(t.tp_slice(s.tp)) for t in tensors)
        buffers_fwd = buffers_bwd = local * pb
        unsharded_grads = sum(math.prod(t.tp_slice(s.tp)) for t in tensors if t.trainable) * pb
        end_of_backward = {"grads": grads_held + unsharded_grads, "activations": 0, "logits_loss": 0, "buffers": local * pb}
    elif s.kind == "fsdp":
        # FSDP2 gathers in its param_dtype (the compute dtype); transformers' FSDP2 under tensor parallel
        # in the weights' own dtype, and it keeps the output head (and final norm) unsharded from the
        # forward to the backward (its _fsdp_plan: keep_full_weight)
        wb = cb if s.tp == 1 else torch.finfo(run.param_dtype).bits // 8
        gathered = (1 if s.reshard_after_forward else shapes.layers) * layer * wb + layer * wb  # this layer + the prefetched next
        if s.tp > 1 and head is not None:
            gathered += math.prod(head.tp_slice(s.tp)) * wb
        buffers_fwd = gathered
        buffers_bwd = gathered + layer * (wb + 4)  # unsharded gradients and their fp32 reduce-scatter input
    elif s.kind == "deepspeed":
        bucket = s.reduce_bucket * cb * (2 if s.overlap_comm else 1)
        buffers_bwd = bucket
        if s.zero_stage == 3:
            buffers_fwd = layer * cb + s.prefetch_bucket * cb
            buffers_bwd += buffers_fwd
    moments = {
        "forward": {"grads": grads_held, "activations": acts["saved"], "logits_loss": loss["forward"], "buffers": buffers_fwd},
        "loss backward": {
            "grads": grads_held, "activations": acts["saved"], "logits_loss": loss["kept"] + loss["backward"],
            "buffers": buffers_bwd,
        },
        "last layer's backward": {
            "grads": max(grads_held, _head_grad(head, s.tp)),
            "activations": acts["saved"] + acts["recompute"] + acts["transient"], "logits_loss": 0, "buffers": buffers_bwd,
        },
        "optimizer step": {
            "grads": grads_full + (held["master"] if s.kind == "deepspeed" else 0),  # ZeRO: + the fp32 gradient partition
            "activations": sequence_mask_bytes(run), "logits_loss": 0, "buffers": 0,  # the strategy keeps the mask
        },
    }
    if end_of_backward:
        moments["end of backward"] = end_of_backward
    if not run.fused_adam and s.kind in ("ddp", "fsdp"):
        moments["optimizer step"]["buffers"] = held["optimizer"] // 2  # foreach AdamW's sqrt(v) temporaries
    moment, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    parts = {"params": held["params"], "optimizer": held["optimizer"], "master": held["master"], **parts}
    held = {k: v for k, v in held.items() if k != "grads_peak"}
    parts["buffers"] += static_buffers
    peak = sum(parts.values())
    reserve = CUDA_CONTEXT + int(ALLOCATOR_SLACK * peak)
    return Estimate(parts=parts, peak_bytes=peak, moment=moment, reserve_bytes=reserve, held=held,
                    stage=stage.index if s.stages > 1 else None)


def receive_buffers(shapes: Shapes, run: Run, stage: Stage) -> int:
    """A pipeline stage's receive buffers: torch.distributed.pipelining allocates, for every micro-batch of
    the step (not only those in flight), one for the hidden states and position ids it receives (all
    but the first stage) and one for the gradient coming back (all but the last), and keeps them."""
    tokens = run.micro_batch * run.local_seq
    rb = dtypes(run)[0]
    received = (0 if stage.first else rb * shapes.hidden + 8) + (0 if stage.last else rb * shapes.hidden)
    return run.accumulation * tokens * received


def _head_grad(head: _Tensor | None, tp: int = 1) -> int:
    """The first gradient backward makes: the output head's (fp32; a rank's slice under tensor parallel), before any layer's."""
    return 4 * math.prod(head.tp_slice(tp)) if head is not None and head.trainable else 0


def rank_key(strategy: str, checkpointing: str, every_k: int, micro_batch: int, offload: bool, stages: int = 1,
             micro_batches: int = 1) -> float:
    """Relative step time, for ranking what fits (a heuristic, not a measurement): recomputation
    costs about one more forward (a third of forward + backward) per checkpointed layer share;
    sharded parameters are gathered every layer (ZeRO-3, FSDP2), context parallel also gathers every
    layer's keys and values, sequence parallel all-to-alls every layer's q, k, v and output, tensor parallel all-reduces activations twice a layer each way (fast
    only inside a node); offload moves the optimizer to the CPU; DeepSpeed's engine adds a little
    per step; a small micro-batch leaves the GPU underused; a pipeline of `stages` idles (stages - 1) /
    (micro_batches + stages - 1) of each step (1F1B's bubble)."""
    recompute = {"none": 0.0, "full": 1 / 3, "every_k": 1 / (3 * max(1, every_k))}[checkpointing]
    bubble = (micro_batches + stages - 1) / micro_batches
    return ((1 + recompute) * STRATEGY_SPEED.get(strategy, 1.1) * (2.0 if offload else 1.0) * (1 + 0.5 / micro_batch)
            * bubble)


# ---------------------------------------------------------------------------- a model the machine cannot hold
def live_facts(strategy) -> StrategyFacts:
    """StrategyFacts of a launched toolkit.strategy.distributed.Strategy (what read_strategy reads
    from its config file), for the sizes of model state."""
    acc = strategy.accelerator
    kind = {"single": "ddp", "ddp": "ddp"}.get(strategy.kind, strategy.kind)
    offload_params = False
    if kind == "deepspeed":
        zero = (acc.state.deepspeed_plugin.deepspeed_config or {}).get("zero_optimization", {})
        offload_params = (zero.get("offload_param") or {}).get("device", "none") in ("cpu", "nvme")
    elif kind == "fsdp":
        offload_params = bool(getattr(getattr(acc.state.fsdp_plugin, "cpu_offload", None), "offload_params", False))
    return StrategyFacts(strategy.name, kind, zero_stage=strategy.zero_stage or 0,
                         offload_optimizer=strategy.offloads_optimizer, offload_params=offload_params,
                         cp=strategy.cp, tp=strategy.tp, sp=strategy.sp, stages=strategy.stages)


def training_state_bytes(model: torch.nn.Module, facts: StrategyFacts, world: int, precision: str) -> int:
    """What one process holds of `model`'s training state under `facts` (weights, gradients, AdamW's two
    moments, fp32 masters; sharded as the strategy shards them), activations not counted: a lower bound
    of a step's peak. A pipeline's stages hold 1/stages of it each, on average."""
    param = next(model.parameters())
    run = Run(facts, world, 1, facts.cp * facts.sp, precision=precision, param_dtype=param.dtype)
    held = state_bytes(model_tensors(model), run)
    return sum(held[k] for k in ("params", "grads", "optimizer", "master")) // facts.stages


def check_fits(model: torch.nn.Module, strategy, what: str) -> None:
    """Refuse, before it is built, a model whose training state alone is more than this machine has free:
    on a GPU its free memory (state a strategy offloads to the CPU is not counted), on a CPU the free host
    memory shared by the processes of this node. `model` is on the meta device; `what` names it."""
    import psutil

    facts = live_facts(strategy)
    precision = {"no": "fp32"}.get(strategy.accelerator.mixed_precision, strategy.accelerator.mixed_precision)
    per_process = training_state_bytes(model, facts, strategy.world_size, precision)
    device = strategy.device
    if device.type == "cuda":
        if facts.kind == "fsdp" and facts.offload_params:
            return  # FSDP's CPU offload keeps the weights, gradients and optimizer state on the host
        free, machine = torch.cuda.mem_get_info(device)[0], "this GPU has"
        need = per_process
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the processes of this node share its memory
        free, machine = psutil.virtual_memory().available, "this machine has"
        need = per_process * local
        machine += f" (for {local} processes)" if local > 1 else ""
    if need <= free:
        return
    n = sum(p.numel() for p in model.parameters())
    raise UserError(
        f"{what} has {_count(n)} parameters; training it needs ~{per_process / 1e9:.0f} GB per process under "
        f"{facts.name} (weights, gradients and AdamW state, before activations) and {machine} {free / 1e9:.0f} GB "
        "available; pick a smaller model, shard it over more GPUs or machines under zero3 or fsdp, or see "
        "python recipes/plan.py"
    )


def check_base_fits(model: torch.nn.Module, bytes_per_param: int, strategy, what: str) -> None:
    """Refuse, before it is loaded, a base model that this node cannot hold whole once per process: every
    rank loads it whole (Strategy.outside_training) before the strategy shards it. `model` is on the meta
    device; a weight takes `bytes_per_param` as it loads."""
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = sum(p.numel() for p in model.parameters())
    free = psutil.virtual_memory().available
    if n * bytes_per_param * local <= free:
        return
    raise UserError(
        f"{what} has {_count(n)} parameters: each of the {local} process(es) on this machine loads it whole "
        f"({n * bytes_per_param / 1e9:.0f} GB) before {strategy.name} shards it, and this machine has "
        f"{free / 1e9:.0f} GB available; pick a smaller base model, model.dtype=bfloat16, or fewer processes "
        "per machine (see python recipes/plan.py)"
    )


def _count(n: int) -> str:
    return next((f"{n / 10**e:.1f}{u}" for e, u in ((12, "T"), (9, "B"), (6, "M")) if n >= 10**e), f"{n:,}")
