"""Per-GPU memory of a training run, estimated from the model's shapes before anything is allocated.

    model = meta model (no weights); facts = read_strategy("accelerate_configs/zero3.yaml", hidden)
    est = estimate(model, Run(facts, world=8, micro_batch=8, seq_len=2048, checkpointing="full", ...))
    est.peak_bytes, est.parts          # what the largest rank allocates at its peak, and why

`peak_bytes` is comparable with `torch.cuda.max_memory_allocated` (docs/memory.md gives every formula).
What the peak is made of: docs/internals.md, toolkit/planner/estimate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from toolkit.config.errors import UserError
from toolkit.launch.environment import local_world_size
from toolkit.planner.activations import Shapes, activation_bytes, dtypes, loss_bytes, sequence_mask_bytes
from toolkit.planner.facts import Run, StrategyFacts, live_facts
from toolkit.planner.state import Held, Stage, model_tensors, pipeline_stages, stage_tensors, state_bytes
from toolkit.strategy.families import family_of

CUDA_CONTEXT = 600 * 2**20  # what a CUDA context and its kernels take outside the allocator (H100: ~500-700 MiB)
ALLOCATOR_SLACK = 0.05  # cached-but-free blocks the caching allocator keeps beside the allocated peak
# a CPU process (plan.py --cpu): its resident memory beside the tensors' peak, measured on the README's SmolLM2 LoRA
# (docs/benchmarks.md, "CPU: resident memory of the README's LoRA fine-tune by allocator"): the interpreter, torch, transformers, the data and tokenizer before the model
CPU_RUNTIME = 340 * 10**6
CPU_ALLOCATOR_SLACK = 0.15  # mimalloc's free memory beside the live tensors (the launcher preloads it; glibc's: ~0.9x)




@dataclass
class Estimate:
    parts: dict[str, int]  # params, grads, optimizer, master, activations, logits_loss, buffers: at the peak
    peak_bytes: int
    moment: str  # which moment of the step is the peak
    reserve_bytes: int
    held: dict[str, int] = field(default_factory=dict)  # model state of the largest rank, as held_bytes measures it
    stage: int | None = None  # a pipeline's largest stage (whose rank this estimate is)




def estimate(model: torch.nn.Module, run: Run, tensors: list[Held] | None = None) -> Estimate:
    """Per-GPU peak of one training step of `model` (built on the meta device) under `run`; a
    pipeline's largest stage's. `tensors`: model_tensors(model, run.quantized_base), where the caller
    estimates many runs of one model (walking a 7B LoRA's parameters takes 30 ms)."""
    tensors = model_tensors(model, run.quantized_base) if tensors is None else tensors
    shapes = Shapes.of(model)
    p = run.strategy.layout.pp
    stages = pipeline_stages(shapes.layers, p, run.accumulation) if p > 1 else [Stage(0, 1, range(shapes.layers), 1)]
    found = [_estimate_stage(stage_tensors(model, tensors, st), shapes, run, st) for st in stages]
    return max(found, key=lambda e: e.peak_bytes)


def _estimate_stage(tensors: list[Held], shapes: Shapes, run: Run, stage: Stage) -> Estimate:
    held = state_bytes(tensors, run)
    s = run.strategy
    acts = activation_bytes(shapes, run, stage.layers)
    acts["saved"] *= stage.in_flight
    rb, cb, _ = dtypes(run)
    tokens = run.micro_batch * run.local_seq
    first_checkpointed = run.checkpointing in ("full", "selective") or (run.checkpointing == "every_k" and stage.layers.start % run.every_k == 0)
    if not stage.first and (rb == 4 or first_checkpointed):
        # what the stage's first layer keeps of its input (fp32 for its norm, or a checkpoint's) is the
        # receive buffer itself, counted with the buffers
        acts["saved"] -= stage.in_flight * tokens * rb * shapes.hidden
    head = next((t for t in tensors if t.shape == (shapes.vocab, shapes.hidden)), None) if stage.last else None
    loss = loss_bytes(shapes, run, head is not None and head.trainable)
    if not stage.last:  # the final norm, the head and the loss are the last stage's
        loss = dict.fromkeys(loss, 0)
    # between micro-batches ZeRO-1 keeps whole gradients, reduced into its partition only at the boundary;
    # a pipeline stage holds gradients beside its most activations only when a forward follows its first backward
    grads_held = held.get("grads_peak", held["grads"]) if run.accumulation > stage.in_flight else 0
    backend = family_of(s.layout)
    buffers = backend.planned_buffers(run, shapes, tensors, head, stage, grads_held, (rb, cb))
    moments = {
        "forward": {"grads": grads_held, "activations": acts["saved"], "logits_loss": loss["forward"],
                    "buffers": buffers.forward},
        "loss backward": {
            "grads": grads_held, "activations": acts["saved"], "logits_loss": loss["kept"] + loss["backward"],
            "buffers": buffers.backward,
        },
        "last layer's backward": {
            "grads": max(grads_held, _head_grad(head, s.layout.tp)),
            "activations": acts["saved"] + acts["recompute"] + acts["transient"], "logits_loss": 0,
            "buffers": buffers.backward,
        },
        "optimizer step": {
            "grads": backend.step_gradients(held),
            "activations": sequence_mask_bytes(run), "logits_loss": 0, "buffers": 0,  # the strategy keeps the mask
        },
    }
    if buffers.end_of_backward:
        moments["end of backward"] = buffers.end_of_backward
    if not run.fused_adam and backend.foreach_temporaries:
        moments["optimizer step"]["buffers"] = held["optimizer"] // 2  # foreach AdamW's sqrt(v) temporaries
    moment, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    parts = {"params": held["params"], "optimizer": held["optimizer"], "master": held["master"], **parts}
    held = {k: v for k, v in held.items() if k != "grads_peak"}
    parts["buffers"] += buffers.static
    peak = sum(parts.values())
    reserve = CUDA_CONTEXT + int(ALLOCATOR_SLACK * peak)
    return Estimate(parts=parts, peak_bytes=peak, moment=moment, reserve_bytes=reserve, held=held,
                    stage=stage.index if s.layout.pp > 1 else None)


def cpu_reserve(peak_bytes: int) -> int:
    """What a CPU process holds beside its tensors' peak (plan.py --cpu, in place of a CUDA context and the caching
    allocator's slack): the runtime and the free memory its allocator keeps beside the live tensors (mimalloc, which
    the launcher preloads into CPU ranks: toolkit.launch.launcher.cpu_allocator)."""
    return CPU_RUNTIME + int(CPU_ALLOCATOR_SLACK * peak_bytes)


def _head_grad(head: Held | None, tp: int = 1) -> int:
    """The first gradient backward makes: the output head's (fp32; a rank's slice under tensor parallel), before any layer's."""
    return 4 * math.prod(head.tp_slice(tp)) if head is not None and head.trainable else 0




def training_state_bytes(model: torch.nn.Module, facts: StrategyFacts, world: int, precision: str) -> int:
    """What one process holds of `model`'s training state under `facts` (weights, gradients, AdamW's two
    moments, fp32 masters; sharded as the strategy shards them), activations not counted: a lower bound
    of a step's peak. A pipeline's stages hold 1/stages of it each, on average."""
    param = next(model.parameters())
    run = Run(facts, world, 1, facts.layout.cp * facts.layout.sp, precision=precision, param_dtype=param.dtype)
    held = state_bytes(model_tensors(model), run)
    return sum(held[k] for k in ("params", "grads", "optimizer", "master")) // facts.layout.pp


def check_fits(model: torch.nn.Module, strategy, what: str) -> None:
    """Refuse, before it is built, a model whose training state alone is more than this machine has free:
    on a GPU its free memory (state a strategy offloads to the CPU is not counted), on a CPU the free host
    memory shared by the processes of this node. `model` is on the meta device; `what` names it."""
    import psutil

    facts = live_facts(strategy)
    precision = {"no": "fp32"}.get(strategy.accelerator.mixed_precision, strategy.accelerator.mixed_precision)
    per_process = training_state_bytes(model, facts, strategy.layout.world, precision)
    device = strategy.device
    if device.type == "cuda":
        if family_of(facts.layout).state_on_host(facts):
            return
        free, machine = torch.cuda.mem_get_info(device)[0], "this GPU has"
        need = per_process
    else:
        local = local_world_size()  # the processes of this node share its memory
        free, machine = psutil.virtual_memory().available, "this machine has"
        need = per_process * local
        machine += f" (for {local} processes)" if local > 1 else ""
    if need <= free:
        return
    n = sum(p.numel() for p in model.parameters())
    raise UserError(
        f"{what} has {_count(n)} parameters; training it needs ~{gigabytes(per_process)} per process under "
        f"{facts.name} (weights, gradients and AdamW state, before activations) and {machine} {gigabytes(free)} "
        "available; pick a smaller model, shard it over more GPUs or machines under zero3 or fsdp, or see "
        "python recipes/plan.py"
    )


def check_base_fits(model: torch.nn.Module, bytes_per_param: int, strategy, what: str) -> None:
    """Refuse, before it is loaded, a base model that this node cannot hold whole once per process: every
    rank loads it whole (Strategy.outside_training) before the strategy shards it. `model` is on the meta
    device; a weight takes `bytes_per_param` as it loads."""
    import psutil

    local = local_world_size()
    n = sum(p.numel() for p in model.parameters())
    free = psutil.virtual_memory().available
    if n * bytes_per_param * local <= free:
        return
    # only what would lower it: a weight that loads in 2 bytes already (model.dtype=bfloat16, or the base's own) has
    # no smaller dtype to suggest
    changes = ["a smaller base model", *(["model.dtype=bfloat16"] if bytes_per_param > 2 else []),
               "fewer processes per machine" if local > 1 else "a machine with more memory"]
    raise UserError(
        f"{what} has {_count(n)} parameters: each of the {local} process(es) on this machine loads it whole "
        f"({gigabytes(n * bytes_per_param)}) before {strategy.layout.name} shards it, and this machine has "
        f"{gigabytes(free)} available; pick {', '.join(changes[:-1])} or {changes[-1]} (see python recipes/plan.py)"
    )


def gigabytes(n_bytes: float) -> str:
    """A size in GB (1e9 bytes) with enough digits to tell it from its neighbours: 0.5 GB, 12.3 GB, 148 GB."""
    return f"{n_bytes / 1e9:.3g} GB" if n_bytes < 1e11 else f"{n_bytes / 1e9:.0f} GB"


def _count(n: int) -> str:
    return next((f"{n / 10**e:.1f}{u}" for e, u in ((12, "T"), (9, "B"), (6, "M")) if n >= 10**e), f"{n:,}")
