"""Every layout x recomputation x micro-batch of a recipe's config on a machine, estimated (toolkit.planner.estimate):
the rows recipes/plan.py prints, and the fastest that fits. A layout the launch would refuse is left out in its words.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from toolkit.config.combinations import refusals
from toolkit.config.errors import UserError
from toolkit.config.files import read_yaml
from toolkit.config.load import to_dict
from toolkit.config.switches import Machine
from toolkit.config.switches import resolve as resolve_switches
from toolkit.launch.cli import ROOT
from toolkit.models.adapter import apply_adapter
from toolkit.models.router import expert_count
from toolkit.models.weight_cast import AUTOCAST, auto_applies
from toolkit.parallel_layout import ParallelLayout
from toolkit.planner.estimate import cpu_reserve, estimate
from toolkit.planner.facts import Run, StrategyFacts, rank_key, read_strategy
from toolkit.planner.state import model_tensors
from toolkit.strategy import context_parallel, sequence_parallel, tensor_parallel
from toolkit.strategy.parallelism import parallel_layout
from toolkit.strategy.pipeline import stages

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
CHECKPOINTING = ("none", "every_k", "selective", "full")
PIPELINE_STAGES = (2, 4)  # listed where they divide --gpus; more rows would bury the table


BUILT: dict[str, tuple] = {}  # a config's meta model, built once a process: plan() runs it for one GPU count at a time


def meta_model(recipe: str, cfg, notes: list[str] | None = None) -> tuple[torch.nn.Module, torch.dtype, bool]:
    """(the model on the meta device, with its adapter as the recipe puts it on; its weights' dtype; whether its base
    is 4-bit); where the architecture came from, if not the usual place, in `notes`. Not to be changed: it is kept
    for the next plan of the same config."""
    part = cfg.adapter if recipe == "finetune" else cfg.tokenizer
    template = cfg.data.chat_template if recipe == "finetune" and cfg.model.new_tokens else None  # new_tokens=[template]
    key = json.dumps([recipe, to_dict(cfg.model), to_dict(part), template], sort_keys=True, default=str)
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
    if recipe == "finetune" and cfg.model.new_tokens:  # the rows the run adds, as load_base_model adds them
        from toolkit.models.base_model import base_tokenizer
        from toolkit.models.new_tokens import add_new_tokens, resize_for_new_tokens

        tokenizer = base_tokenizer(dataclasses.replace(cfg.model, new_tokens=[]))
        added = add_new_tokens(tokenizer, cfg.model.new_tokens, cfg.data.chat_template, f"model.path={cfg.model.path}")
        if added:
            notes.append(resize_for_new_tokens(model, tokenizer, added))
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
    toolkit.strategy.pipeline.stages.problems, the check the launch makes of the model."""
    facts, notes = [], []
    for p in PIPELINE_STAGES:
        if gpus % p:
            continue
        found = stages.problems(model, p)
        if found:
            notes.append(f"pipeline, train.pipeline_stages={p}: not listed: {found[0]}")
            continue
        facts.append(StrategyFacts("pipeline", parallel_layout("MULTI_GPU", {}, stages=p)))
    return facts, notes


def as_launched(cfg, device: str, precision: str, layout: ParallelLayout):
    """A copy of `cfg` with its auto switches as the launch makes them on `device` under `layout` (the planner's
    precision names: fp32, bf16, fp16, fp8)."""
    cfg = copy.deepcopy(cfg)
    resolve_switches(cfg, Machine(device, {"fp32": "no", "fp8": "bf16"}.get(precision, precision), layout))
    return cfg


def plan(recipe: str, cfg, gpus: int, gpu_memory: int, headroom: float = 0.1,
         micro_batches: tuple[int, ...] = MICRO_BATCHES, cpu: bool = False,
         configs: Path = ROOT / "accelerate_configs") -> tuple[list[dict], dict | None, list[str]]:
    """(the rows, the fastest that fits, lines on the layouts not listed and the model-parallel ones) for `recipe`'s
    validated `cfg` on `gpus` GPUs of `gpu_memory` bytes (CPU processes and their share of the host's with `cpu`),
    over every single-node accelerate config in `configs` and the pipelines."""
    notes: list[str] = []
    precision = {"auto": "fp32" if cpu else "bf16", "no": "fp32"}.get(cfg.train.mixed_precision,
                                                                      cfg.train.mixed_precision)
    device = "cpu" if cpu else "cuda"
    written, cfg = cfg, as_launched(cfg, device, precision, ParallelLayout("ddp", max(1, gpus)))
    model, dtype, quantized = meta_model(recipe, cfg, notes)
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    hidden, experts = config.hidden_size, expert_count(config)
    t, m = cfg.train, cfg.model
    if precision == "fp8":  # its memory is not modelled yet; bf16's is its upper bound
        notes.append("train.mixed_precision=fp8 is planned as bf16, its upper bound: what the float8 layers save is not "
                     "modelled yet (the 1B YAML on an H200 held 48.4 GB under fp8, 59.1 under bf16: docs/fp8.md)")
        precision = "bf16"
    budget = gpu_memory * (1 - headroom)
    micro = list(micro_batches or MICRO_BATCHES)
    rows = []
    tensors = model_tensors(model, quantized)
    staged, pipeline_notes = pipelines(model, gpus)
    # the rows of selective recomputation, where the launch's own rules let it run
    selective = dataclasses.replace(cfg, model=dataclasses.replace(m, gradient_checkpointing="selective"))
    for facts in [*strategies(configs, hidden), *staged]:
        cfg = as_launched(written, device, precision, facts.layout)
        m = cfg.model
        # the launch's own refusals: the first that no override lifts leaves the layout out, in its words
        found = refusals(cfg, facts.layout, precision)
        needs, refused = model_parallel_needs(facts, model, cfg, gpus)
        refused = next((r.line.split(";")[0] for r in found if r.instead is None), refused)
        if refused:
            name = f"pipeline, train.pipeline_stages={facts.layout.pp}" if facts.layout.pp > 1 else facts.name
            notes.append(f"{name}: not listed: {refused}")
            continue
        for refusal in found:
            needs = {**needs, **refusal.instead}
        group = facts.layout.cp * facts.layout.tp * facts.layout.sp
        data_ranks = gpus // (group * facts.layout.pp)  # a cp, tp or sp group, or a pipeline, reads one micro-batch
        required = " ".join(f"{k}={v}" for k, v in needs.items())
        attention = needs.get("model.attn_implementation", m.attn_implementation)
        if group > 1:
            notes.append(f"{facts.name}: {axis_name(facts)} {group} x dp_shard {data_ranks}" + tp_layout(facts, attention, experts)
                         + (f", as launched with {required}" if needs else ""))
        if facts.layout.pp > 1:
            notes.append(f"pp{facts.layout.pp}: ddp.yaml + train.pipeline_stages={facts.layout.pp} ({facts.layout.pp} stages x "
                         f"{data_ranks} replicas), each row is the rank of its largest stage"
                         + (f", as launched with {required}" if needs else ""))
        elif needs and group == 1:  # a layout of its own whose row a rule's override lifts: said too
            notes.append(f"{facts.name}: as launched with {required}")
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
                    facts, gpus, mb, cfg.data.seq_len, accumulation=t.global_batch_size // (mb * data_ranks),
                    checkpointing=ckpt, every_k=m.gradient_checkpointing_k, precision=precision, param_dtype=dtype,
                    attention=attention,
                    loss_chunk_tokens=0 if "model.loss" in needs else m.chunk_tokens, quantized_base=quantized,
                    fused_adam=cfg.optim.fused != "false", compiled=m.compile != "none",
                    # (a 4-bit base's matrices are not copied: QLoRA's copies are its adapters')
                    cast_per_step=not quantized and auto_applies(m.cast_weights, facts.layout, AUTOCAST.get(precision),
                                                                 needs.get("model.compile", m.compile)),
                )
                est = estimate(model, run, tensors)
                if cpu:
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
            f"no micro-batch in {micro} divides train.global_batch_size={t.global_batch_size} over {gpus} GPUs; "
            f"plan for a --gpus that divides {t.global_batch_size}, or set train.global_batch_size to a multiple of "
            f"{gpus}"
        )
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: (r["relative_step_time"], r["peak_bytes"])) if fitting else None
    return rows, best, notes


def nothing_fits(recipe: str, cfg, rows: list[dict]) -> str:
    """What to change where no row fits: what limits it, and only the changes that lower it and are not in effect
    already (more GPUs where some row shards the model, a LoRA for a full fine-tune)."""
    method = cfg.adapter.method if recipe == "finetune" else None
    shards = any(r["strategy"] != "ddp" or r["pipeline_stages"] > 1 or r["cp"] * r["tp"] * r["sp"] > 1 for r in rows)
    changes = [] if shards else ["GPUs with more memory"]
    changes += ["more GPUs"] if shards else []
    changes += ["a shorter data.seq_len"]
    if method == "full":
        changes.append("a LoRA (adapter.method=lora)")
    limit = "" if shards else "DDP holds the whole model on every GPU: more GPUs do not lower it; "
    return f"{limit}try {', '.join(changes[:-1])} or {changes[-1]}" if len(changes) > 1 else f"{limit}try {changes[0]}"

