"""Which strategy, checkpointing and micro-batch fit a run on your GPUs, before you launch it.

    python recipes/plan.py --config recipes/configs/pretrain_llama_1b.yaml --gpus 8 --gpu-memory 80GB
    python recipes/plan.py --config recipes/configs/finetune_smollm2_lora.yaml --gpus 1 --gpu-memory 24GB --json
    python recipes/plan.py --config recipes/configs/finetune_smollm2_lora.yaml --cpu --gpus 2 --gpu-memory 12GB

Reads the recipe YAML and key=value overrides as the recipe does, builds the model on the meta
device (no weights, no GPU) and, for every accelerate config in accelerate_configs/ x gradient
checkpointing (none / every_k / selective / full; selective for a dense model on a data-parallel
layout, where it is modelled) x micro-batch, estimates the per-GPU peak broken into
parameters, gradients, optimizer state (fp32 masters included), activations, logits and loss,
and communication/gathering buffers (toolkit.planner; docs/memory.md has the formulas).
`fits` means the peak plus the CUDA context and allocator slack stays under (1 - headroom) of the
GPU's memory. With --cpu it plans CPU processes instead (--gpus counts them, --gpu-memory is each one's share of
the host's memory; train.mixed_precision=auto is fp32 there, as on a CPU launch) and +rsv is what a process holds
beside its tensors: the runtime and its allocator's free memory (toolkit.planner.estimate.cpu_reserve). It then names the fastest row that fits and prints its launch line. The global
batch stays the recipe's: a micro-batch is listed only if it divides it over the data-parallel ranks.

Context, tensor and sequence parallel (fsdp_cp.yaml, fsdp_tp.yaml, zero3_sp.yaml) take cp, tp or sp
from the config's parallelism_config and make the --gpus processes cp (or tp, sp) x dp_shard,
dp_shard = GPUs / cp (the launch line says so). A model or config they refuse is not listed, with the
reason under the table; what a launch of them needs instead of the recipe's (sdpa for context and
sequence parallel, the full loss for tensor parallel) is estimated, said under the table and added to
the launch line. Tensor parallel under sdpa or eager attention also shards the sequence between the
layers (Megatron's sequence parallel: the residual stream and norms 1/tp per rank); under flex or flash
attention it keeps transformers' plan, the activations whole between the layers; the line under the
table says which. A mixture of experts keeps transformers' plan and spreads its experts over the tp
ranks (expert parallel); its rows assume balanced routing (a rank whose experts get more tokens holds
more), which the line under the table says.

Pipeline parallel (ddp.yaml with train.pipeline_stages=p, for p = 2 and 4 where p divides --gpus:
p stages x GPUs / p replicas) is listed as "pp<p> stage <s>": the row is the rank of its largest stage
s. A stage holds its layers' weights, gradients and AdamW state whole, its layers' activations for
each micro-batch in flight, the logits on the last stage alone, and a receive buffer per micro-batch;
under the launch's autocast, as DDP (fp16 is refused: the schedule's backward has no loss scaling).

Errors (one line, exit code 2): an unreadable config or override, any option's value outside what it takes
(--gpus below 1, --headroom outside [0, 0.9), a --gpu-memory that is not a size or is none, a --micro-batch
that is not sizes of 1 or more), argparse's own refusals, a model the planner does not model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.config.combinations import refusals  # noqa: E402
from toolkit.config.errors import UserError  # noqa: E402
from toolkit.config.files import read_config_file, read_yaml  # noqa: E402
from toolkit.config.load import load_config, to_dict  # noqa: E402
from toolkit.launch.cli import OneLineParser  # noqa: E402
from toolkit.models.adapter import apply_adapter, leave_out_bitsandbytes  # noqa: E402
from toolkit.models.router import expert_count  # noqa: E402
from toolkit.models.weight_cast import AUTOCAST, auto_applies  # noqa: E402
from toolkit.planner.estimate import cpu_reserve, estimate  # noqa: E402
from toolkit.planner.facts import Run, StrategyFacts, rank_key, read_strategy  # noqa: E402
from toolkit.planner.state import model_tensors  # noqa: E402
from toolkit.strategy import context_parallel, pipeline_parallel, sequence_parallel, tensor_parallel  # noqa: E402
from toolkit.strategy.parallelism import parallel_layout  # noqa: E402
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig  # noqa: E402

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
CHECKPOINTING = ("none", "every_k", "selective", "full")
PIPELINE_STAGES = (2, 4)  # listed where they divide --gpus; more rows would bury the table


def parse_size(text: str) -> int:
    """--gpu-memory in bytes: a positive number with an optional unit (GB when none)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB|TB)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-memory {text!r} is not a size; write one GPU's memory, e.g. 80GB, 24GiB or 40960MiB")
    unit = (m.group(2) or "GB").lower()
    size = int(float(m.group(1)) * {"gb": 1e9, "gib": 2**30, "mb": 1e6, "mib": 2**20, "tb": 1e12}[unit])
    if size < 1e6:
        raise UserError(f"--gpu-memory {text} is too little to plan in; write one GPU's memory (1MB or more), e.g. 80GB or 24GiB")
    return size


def load_recipe_config(path: str, overrides: list[str]):
    """(recipe name, its validated config): a YAML with an adapter section is a fine-tune."""
    raw = read_config_file(path)  # as the user wrote it: Path("") would be the folder it runs in
    finetune = "adapter" in raw or any(o.startswith("adapter.") for o in overrides)
    cls = FinetuneConfig if finetune else PretrainConfig
    return ("finetune" if finetune else "pretrain"), load_config(cls, path, overrides)


BUILT: dict[str, tuple] = {}  # a config's meta model, built once a process: plan() runs it for one GPU count at a time


def meta_model(recipe: str, cfg, notes: list[str] | None = None) -> tuple[torch.nn.Module, torch.dtype, bool]:
    """(the model on the meta device, with its adapter as the recipe puts it on; its weights' dtype; whether its base
    is 4-bit); where the architecture came from, if not the usual place, in `notes`. Not to be changed: it is kept
    for the next plan of the same config."""
    part = cfg.adapter if recipe == "finetune" else cfg.tokenizer
    key = json.dumps([recipe, to_dict(cfg.model), to_dict(part)], sort_keys=True, default=str)
    if key not in BUILT:
        said: list[str] = []
        BUILT[key] = (*_build(recipe, cfg, said), said)
    *built, said = BUILT[key]
    if notes is not None:
        notes.extend(said)
    return tuple(built)


def _build(recipe: str, cfg, notes: list[str]) -> tuple[torch.nn.Module, torch.dtype, bool]:
    from transformers import AutoModelForCausalLM

    if recipe == "pretrain":
        from toolkit.models.scratch import hf_config

        vocab = cfg.model.config.get("vocab_size", cfg.tokenizer.vocab_size)
        config = hf_config(cfg.model, vocab, 0, None)
        dtype, quantized = torch.float32, False
    else:
        from toolkit.models.base_model import base_config

        config = base_config(cfg.model, notes)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype, torch.float32)
        quantized = cfg.adapter.method == "qlora"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if recipe == "finetune" and cfg.adapter.is_lora:
        model, _ = apply_adapter(model, cfg.adapter)  # the recipe's: its targets, layers, DoRA, modules_to_save
    return model, dtype, quantized


def strategies(folder: Path, hidden: int) -> list[StrategyFacts]:
    """Every single-node accelerate config (multi-node ones lay memory out as their single-node twin)."""
    found = []
    for path in sorted(folder.glob("*.yaml")):
        raw = read_yaml(path) or {}
        if int(raw.get("num_machines", 1)) > 1:
            continue
        found.append(read_strategy(path, hidden))
    return found


def model_parallel_needs(facts: StrategyFacts, model: torch.nn.Module, cfg, gpus: int) -> tuple[dict[str, str], str | None]:
    """(overrides a launch of `facts` needs beyond the recipe's, why it cannot run at all) for context,
    tensor and sequence parallel, by the checks the launch itself makes (toolkit.strategy.*.problems)."""
    group = facts.layout.cp * facts.layout.tp * facts.layout.sp
    if group == 1:
        return {}, None
    if gpus % group:
        return {}, f"{group} ranks per {axis_name(facts)} group do not divide --gpus {gpus}"
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    m, needs = cfg.model, {}
    if facts.layout.cp > 1 or facts.layout.sp > 1:
        module = context_parallel if facts.layout.cp > 1 else sequence_parallel
        if m.attn_implementation not in module.SUPPORTED_ATTENTION:
            needs["model.attn_implementation"] = "sdpa"
        found = module.problems(config, max(facts.layout.cp, facts.layout.sp), cfg.data.seq_len, "sdpa")
    else:
        found = tensor_parallel.problems(config, facts.layout.tp)
        if problem := tensor_parallel.sequence_problem(facts.layout.tp, cfg.data.seq_len):  # as the launch refuses it
            found.append(problem)
    return needs, (found[0] if found else None)


def tp_layout(facts: StrategyFacts, attention: str, experts: int) -> str:
    """How tensor parallel lays the activations out under `attention` (the launch's
    toolkit.strategy.tensor_parallel.sequence_layout), and a mixture of `experts` its experts."""
    if facts.layout.tp == 1:
        return ""
    if experts:
        return (f", experts spread over the tp ranks (ep {facts.layout.tp}: {experts // facts.layout.tp} of {experts} on each), "
                "activations whole between the layers (a mixture of experts: transformers' plan); estimated with "
                "balanced routing: a rank whose experts get more of the tokens holds more")
    if attention in tensor_parallel.SEQUENCE_ATTENTION:
        return ", sequence parallel between the layers"
    return f", activations whole between the layers ({attention}: transformers' plan)"


def axis_name(facts: StrategyFacts) -> str:
    """The model-parallel axis a config splits over: cp, tp or sp."""
    return "cp" if facts.layout.cp > 1 else "sp" if facts.layout.sp > 1 else "tp"


def pipelines(model: torch.nn.Module, gpus: int) -> tuple[list[StrategyFacts], list[str]]:
    """(a StrategyFacts per stage count to list, lines on those not listed), by
    toolkit.strategy.pipeline_parallel.problems, the check the launch makes of the model."""
    facts, notes = [], []
    for p in PIPELINE_STAGES:
        if gpus % p:
            continue
        found = pipeline_parallel.problems(model, p)
        if found:
            notes.append(f"pipeline, train.pipeline_stages={p}: not listed: {found[0]}")
            continue
        facts.append(StrategyFacts("pipeline", parallel_layout("MULTI_GPU", {}, stages=p)))
    return facts, notes


def plan(args) -> tuple[list[dict], dict | None, str, list[str]]:
    """(the rows, the fastest that fits, the recipe, lines on the model-parallel configs)."""
    recipe, cfg = load_recipe_config(args.config, args.overrides)
    notes: list[str] = []
    model, dtype, quantized = meta_model(recipe, cfg, notes)
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    hidden, experts = config.hidden_size, expert_count(config)
    t, m = cfg.train, cfg.model
    precision = {"auto": "fp32" if args.cpu else "bf16", "no": "fp32"}.get(t.mixed_precision, t.mixed_precision)
    if precision == "fp8":  # its memory is not modelled yet; bf16's is its upper bound
        notes.append("train.mixed_precision=fp8 is planned as bf16, its upper bound: what the float8 layers save is not "
                     "modelled yet (the 1B YAML on an H200 held 48.4 GB under fp8, 59.1 under bf16: docs/fp8.md)")
        precision = "bf16"
    budget = args.gpu_memory * (1 - args.headroom)
    micro = list(args.micro_batch or MICRO_BATCHES)  # checked by check_args; a caller of plan() may leave it empty
    rows = []
    tensors = model_tensors(model, quantized)
    staged, pipeline_notes = pipelines(model, args.gpus)
    # the rows of selective recomputation, where the launch's own rules let it run
    selective = dataclasses.replace(cfg, model=dataclasses.replace(m, gradient_checkpointing="selective"))
    for facts in [*strategies(ROOT / "accelerate_configs", hidden), *staged]:
        # the launch's own refusals: the first that no override lifts leaves the layout out, in its words
        found = refusals(cfg, facts.layout, precision)
        needs, refused = model_parallel_needs(facts, model, cfg, args.gpus)
        refused = next((r.line.split(";")[0] for r in found if r.instead is None), refused)
        if refused:
            name = f"pipeline, train.pipeline_stages={facts.layout.pp}" if facts.layout.pp > 1 else facts.name
            notes.append(f"{name}: not listed: {refused}")
            continue
        for refusal in found:
            needs = {**needs, **refusal.instead}
        group = facts.layout.cp * facts.layout.tp * facts.layout.sp
        data_ranks = args.gpus // (group * facts.layout.pp)  # a cp, tp or sp group, or a pipeline, reads one micro-batch
        required = " ".join(f"{k}={v}" for k, v in needs.items())
        attention = needs.get("model.attn_implementation", m.attn_implementation)
        if group > 1:
            notes.append(f"{facts.name}: {axis_name(facts)} {group} x dp_shard {data_ranks}" + tp_layout(facts, attention, experts)
                         + (f", as launched with {required}" if needs else ""))
        if facts.layout.pp > 1:
            notes.append(f"pp{facts.layout.pp}: ddp.yaml + train.pipeline_stages={facts.layout.pp} ({facts.layout.pp} stages x "
                         f"{data_ranks} replicas), each row is the rank of its largest stage"
                         + (f", as launched with {required}" if needs else ""))
        for ckpt in CHECKPOINTING:
            # selective: not modelled for a mixture or a model-parallel group (selective_bytes_per_token), refused
            # under ZeRO-3 at launch (gradient_checkpointing.py)
            if ckpt == "selective" and (experts or group > 1 or any(
                    r.setting == "model.gradient_checkpointing=selective" for r in refusals(selective, facts.layout, precision))):
                continue
            for mb in micro:
                if t.global_batch_size % (mb * data_ranks):
                    continue
                run = Run(
                    facts, args.gpus, mb, cfg.data.seq_len, accumulation=t.global_batch_size // (mb * data_ranks),
                    checkpointing=ckpt, every_k=m.gradient_checkpointing_k, precision=precision, param_dtype=dtype,
                    attention=attention,
                    loss_chunk_tokens=0 if "model.loss" in needs else m.chunk_tokens, quantized_base=quantized,
                    fused_adam=cfg.optim.fused != "false", compiled=m.compile != "none",
                    # (a 4-bit base's matrices are not copied: QLoRA's copies are its adapters')
                    cast_per_step=not quantized and auto_applies(m.cast_weights, facts.layout, AUTOCAST.get(precision),
                                                                 needs.get("model.compile", m.compile)),
                )
                est = estimate(model, run, tensors)
                if args.cpu:
                    est.reserve_bytes = cpu_reserve(est.peak_bytes)
                offload = facts.offload_optimizer or facts.offload_params
                rows.append({
                    "strategy": facts.name, "gradient_checkpointing": ckpt, "micro_batch_size": mb,
                    "accumulation": run.accumulation, "cp": facts.layout.cp, "tp": facts.layout.tp, "sp": facts.layout.sp,
                    "dp_shard": data_ranks, "pipeline_stages": facts.layout.pp, "stage": est.stage,
                    "requires": [f"{k}={v}" for k, v in needs.items()], **{f"{k}_bytes": v for k, v in est.parts.items()},
                    "peak_bytes": est.peak_bytes, "reserve_bytes": est.reserve_bytes, "peak_at": est.moment,
                    "fits": est.peak_bytes + est.reserve_bytes <= budget,
                    "relative_step_time": round(rank_key(facts.name, ckpt, m.gradient_checkpointing_k, mb, offload,
                                                         facts.layout.pp, run.accumulation), 3),
                })
    notes += pipeline_notes
    if not rows:
        raise UserError(
            f"no micro-batch in {micro} divides train.global_batch_size={t.global_batch_size} over {args.gpus} GPUs; "
            f"plan for a --gpus that divides {t.global_batch_size}, or set train.global_batch_size to a multiple of "
            f"{args.gpus}"
        )
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: (r["relative_step_time"], r["peak_bytes"])) if fitting else None
    return rows, best, recipe, notes


def launch_line(best: dict, recipe: str, args) -> str:
    replaced = ("train.micro_batch_size=", "model.gradient_checkpointing=", "train.pipeline_stages=",
                *(o.split("=")[0] + "=" for o in best["requires"]))
    stages = [f"train.pipeline_stages={best['pipeline_stages']}"] if best["pipeline_stages"] > 1 else []
    # quoted for the shell: an override may hold spaces (data.sources=[{name: web, ...}])
    extra = "".join(f" {shlex.quote(o)}" for o in [*(o for o in args.overrides if not o.startswith(replaced)),
                                                    *best["requires"], *stages])
    groups = f" --parallelism_config_dp_shard_size {best['dp_shard']}" if best["cp"] * best["tp"] * best["sp"] > 1 else ""
    config = "ddp" if best["pipeline_stages"] > 1 else best["strategy"]
    settings = (f"--config {args.config} train.micro_batch_size={best['micro_batch_size']} "
                f"model.gradient_checkpointing={best['gradient_checkpointing']}{extra}")
    if Path.cwd().resolve() != ROOT:  # planned from elsewhere (llm-toolkit plan): the command that runs from there
        return f"llm-toolkit {recipe} --config_file {config} --num_processes {args.gpus}{groups} {settings}"
    return (f"bash recipes/launch.sh --config_file accelerate_configs/{config}.yaml --num_processes {args.gpus}{groups} "
            f"recipes/{recipe}.py {settings}")


def label(row: dict) -> str:
    """A row's strategy as the table names it: a pipeline by its stage count and largest stage."""
    return f"pp{row['pipeline_stages']} stage {row['stage']}" if row["pipeline_stages"] > 1 else row["strategy"]


LEGEND = ("per GPU, GB = 1e9 bytes; step: estimated step time relative to the fastest row (the ranking: a rule of "
          "thumb for recomputation, sharding's gathers, offload and pipeline bubbles, not a measurement); +rsv: the "
          "CUDA context and the allocator's slack beside the peak, which must fit too")


CPU_RSV = "the runtime (interpreter, torch, the data) and the memory the allocator keeps free (mimalloc)"


def table(rows: list[dict], args) -> str:
    gb = 1e9
    head = (f"{'strategy':<14}{'ckpt':<9}{'mb':>3}{'step':>6}{'params':>8}{'grads':>8}{'optim':>8}{'master':>8}"
            f"{'activ':>8}{'logits':>8}{'buffers':>8}{'peak':>8}{'+rsv':>7}  fits")
    fastest = min(r["relative_step_time"] for r in rows)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{label(r):<14}{r['gradient_checkpointing']:<9}{r['micro_batch_size']:>3}"
            f"{r['relative_step_time'] / fastest:>6.2f}"
            + "".join(f"{r[k + '_bytes'] / gb:>8.1f}" for k in ("params", "grads", "optimizer", "master", "activations", "logits_loss", "buffers"))
            + f"{r['peak_bytes'] / gb:>8.1f}{r['reserve_bytes'] / gb:>7.1f}  {'yes' if r['fits'] else 'no'}"
        )
    return "\n".join(lines)


def shortlist(rows: list[dict]) -> list[dict]:
    """Each strategy's fastest row that fits (its smallest when none does), fastest first."""
    by_strategy: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: (not r["fits"], r["relative_step_time"], r["peak_bytes"] if r["fits"] else 0)):
        by_strategy.setdefault(label(r), r)
    if not any(r["fits"] for r in by_strategy.values()):
        by_strategy = {k: min((r for r in rows if label(r) == k), key=lambda r: r["peak_bytes"]) for k in by_strategy}
    return sorted(by_strategy.values(), key=lambda r: (not r["fits"], r["relative_step_time"]))


def parser() -> OneLineParser:
    """The command line; every option's wrong values are refused in one line (tests/recipes/test_plan.py walks them)."""
    parser = OneLineParser("python recipes/plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a recipe YAML from recipes/configs/")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run will use (its world size)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB, 24GiB")
    parser.add_argument("--headroom", type=float, default=0.1, help=f"share of the GPU's memory kept free ({HEADROOM[0]}-"
                        f"{HEADROOM[1]}, the upper end excluded)")
    parser.add_argument("--micro-batch", help="comma-separated micro-batch sizes to list (default 1..32)")
    parser.add_argument("--cpu", action="store_true", help="plan CPU processes: --gpus counts them, --gpu-memory is "
                        "each one's share of the host's memory, +rsv the runtime and the allocator's free heap")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.add_argument("--all", action="store_true", help="list every row (strategy x recomputation x micro-batch), "
                        "not only each strategy's fastest that fits")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for the recipe")
    return parser


HEADROOM = (0, 0.9)


def check_args(args: argparse.Namespace) -> None:
    """Each option's value in its range, each refused in a line of its own, before any config is read."""
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus} must be at least 1: the GPUs the run will use")
    if not HEADROOM[0] <= args.headroom < HEADROOM[1]:  # nan fails too
        raise UserError(f"--headroom {args.headroom:g} must be at least {HEADROOM[0]} and below {HEADROOM[1]}: the share "
                        "of each GPU's memory kept free, e.g. 0.1")
    args.gpu_memory = parse_size(args.gpu_memory)
    args.micro_batch = parse_micro_batches(args.micro_batch)


def parse_micro_batches(text: str | None) -> tuple[int, ...]:
    """--micro-batch's sizes, in order, once each; MICRO_BATCHES when it is not given."""
    if text is None:
        return MICRO_BATCHES
    allowed = "give sizes of 1 or more separated by commas, e.g. 1,2,4"
    if not text.strip():
        raise UserError(f"--micro-batch {text!r} names no size; {allowed}, or leave it out for {','.join(map(str, MICRO_BATCHES))}")
    sizes = []
    for part in text.split(","):
        if not part.strip().isdigit():
            raise UserError(f"--micro-batch {text}: {part.strip()!r} is not a whole number; {allowed}")
        if int(part) < 1:
            raise UserError(f"--micro-batch {text}: {int(part)} is not a size; {allowed}")
        sizes.append(int(part))
    return tuple(sorted(set(sizes)))


def main(argv: list[str] | None = None) -> int:
    leave_out_bitsandbytes()  # a QLoRA is planned on the meta device, without its 4-bit kernels
    try:
        args = parser().parse_args(argv)
        check_args(args)
        rows, best, recipe, notes = plan(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print("".join(f"{n}\n" for n in notes), end="", file=sys.stderr)
        print(json.dumps(rows, indent=1))
        return 0
    budget = args.gpu_memory * (1 - args.headroom) / 1e9
    unit, units = ("CPU process", "CPU process(es)") if args.cpu else ("GPU", "GPU(s)")
    if best is None:
        smallest = min(rows, key=lambda r: r["peak_bytes"])
        print(f"nothing fits {args.gpus} {units} of {args.gpu_memory / 1e9:.0f} GB: the smallest is {label(smallest)} / "
              f"{smallest['gradient_checkpointing']} / micro-batch {smallest['micro_batch_size']} at "
              f"{smallest['peak_bytes'] / 1e9:.1f} GB per {unit}; add GPUs, shorten data.seq_len or train a LoRA")
    else:
        print(f"fastest that fits: {label(best)}, gradient checkpointing {best['gradient_checkpointing']}, "
              f"micro-batch {best['micro_batch_size']} ({best['peak_bytes'] / 1e9:.1f} GB peak per {unit}, "
              f"{(best['peak_bytes'] + best['reserve_bytes']) / 1e9:.1f} with +rsv, of {budget:.1f} usable: "
              f"{args.gpu_memory / 1e9:.0f} GB less {args.headroom:.0%} headroom)")
        print(launch_line(best, recipe, args))
    shown = rows if args.all else shortlist(rows)
    print(f"\n{'every row' if args.all else 'each strategy at its fastest that fits'} ({len(shown)} of {len(rows)}"
          f"{'' if args.all else '; --all lists every one'}), {args.gpus} {units} of {args.gpu_memory / 1e9:.0f} GB:")
    print(table(shown, args))
    print(LEGEND.replace("per GPU", "per CPU process").replace("the CUDA context and the allocator's slack", CPU_RSV)
          if args.cpu else LEGEND)
    if notes:
        print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `plan.py ... | head`: the reader has what it wanted, and no traceback follows
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
