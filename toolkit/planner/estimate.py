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
from dataclasses import dataclass, field

import torch

from toolkit.config import UserError
from toolkit.planner.activations import Shapes, activation_bytes, dtypes, loss_bytes, sequence_mask_bytes
from toolkit.planner.facts import Run, StrategyFacts, live_facts
from toolkit.planner.state import Held, Stage, model_tensors, pipeline_stages, stage_tensors, state_bytes

CUDA_CONTEXT = 600 * 2**20  # what a CUDA context and its kernels take outside the allocator (H100: ~500-700 MiB)
ALLOCATOR_SLACK = 0.05  # cached-but-free blocks the caching allocator keeps beside the allocated peak




@dataclass
class Estimate:
    parts: dict[str, int]  # params, grads, optimizer, master, activations, logits_loss, buffers: at the peak
    peak_bytes: int
    moment: str  # which moment of the step is the peak
    reserve_bytes: int
    held: dict[str, int] = field(default_factory=dict)  # model state of the largest rank, as held_bytes measures it
    stage: int | None = None  # a pipeline's largest stage (whose rank this estimate is)




def estimate(model: torch.nn.Module, run: Run) -> Estimate:
    """Per-GPU peak of one training step of `model` (built on the meta device) under `run`; a
    pipeline's largest stage's."""
    tensors = model_tensors(model, run.quantized_base)
    shapes = Shapes.of(model)
    p = run.strategy.stages
    stages = pipeline_stages(shapes.layers, p, run.accumulation) if p > 1 else [Stage(0, 1, range(shapes.layers), 1)]
    found = [_estimate_stage(stage_tensors(model, tensors, st), shapes, run, st) for st in stages]
    return max(found, key=lambda e: e.peak_bytes)


def _estimate_stage(tensors: list[Held], shapes: Shapes, run: Run, stage: Stage) -> Estimate:
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


def _head_grad(head: Held | None, tp: int = 1) -> int:
    """The first gradient backward makes: the output head's (fp32; a rank's slice under tensor parallel), before any layer's."""
    return 4 * math.prod(head.tp_slice(tp)) if head is not None and head.trainable else 0




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
