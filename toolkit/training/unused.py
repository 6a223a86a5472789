"""The settings that the rest of a config leaves without effect, said in one line each before anything runs.

A key set away from its default where the combination does not read it makes a run silently differ from its
YAML; it is said, not refused, since an override may run a YAML written for one mode in another. Every key of
the recipe configs is classified here (USED_WHEN, CHECKED_BY, ALWAYS); tests/toolkit/training/test_unused.py
walks them over every field, so a new key fails until classified.
Why said and not refused, and what each table holds: docs/internals.md, toolkit/training/unused.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from toolkit.config.keys import value_at as get

_LORA = ("adapter.method", ("lora", "qlora"), "LoRA's")
_CHAT = ("data.format", ("chat",), "chat records'")
_TEXT = ("data.format", ("text",), "text data's")


class Need(NamedTuple):
    """`key` has an effect only where `on` (a dotted key) is one of `values`; `whose` says whose setting it is."""

    on: str
    values: tuple
    whose: str


# key -> Need, or a callable(cfg) -> the reason it has no effect here (None where it has one)
USED_WHEN: dict[str, Need | Callable[[Any], str | None]] = {
    **{f"adapter.{name}": Need(*_LORA) for name in (
        "r", "alpha", "dropout", "layers", "target_modules", "modules_to_save", "dora", "rslora", "merge")},
    **{f"data.columns.{name}": Need(*_CHAT) for name in ("role", "content", "user", "assistant", "system")},
    "data.overlong": Need("data.format", ("chat", "preference"), "chat and preference records'"),
    "data.sample_by": Need(*_TEXT),
    "data.text_column": Need(*_TEXT),
    "data.stream_val_documents": Need("data.streaming", (True,), "streaming's"),
    "train.max_nonfinite_skips": Need("train.on_nonfinite", ("skip",), "on_nonfinite=skip's"),
    "train.fp8_recipe": Need("train.mixed_precision", ("fp8",), "fp8's"),
    "train.fp8_layers": Need("train.mixed_precision", ("fp8",), "fp8's"),
    "model.gradient_checkpointing_k": Need("model.gradient_checkpointing", ("every_k",), "every_k recomputation's"),
    "model.loss_chunk_tokens": Need("model.loss", ("chunked",), "the chunked loss's"),
    "optim.lr_reference_batch": Need("optim.lr_scaling", ("linear", "sqrt"), "lr_scaling's"),
    "optim.min_lr_ratio": Need("optim.schedule", ("cosine",), "the cosine schedule's"),
    "tokenizer.vocab_size": Need("tokenizer.path", (None,), "for a tokenizer the run trains"),
    "tokenizer.min_frequency": Need("tokenizer.path", (None,), "for a tokenizer the run trains"),
    "tokenizer.train_documents": Need("tokenizer.path", (None,), "for a tokenizer the run trains"),
    "train.max_steps": lambda cfg: (
        f"train.epochs={cfg.train.epochs:g} sets it from the data" if cfg.train.epochs is not None else None),
    "data.val_fraction": lambda cfg: (
        f"data.val_path={cfg.data.val_path} is the held-out data" if getattr(cfg.data, "val_path", None) else None),
    **{f"data.{name}": (lambda cfg, name=name: "data.sources name their own" if cfg.data.sources else None)
       for name in ("name", "split")},
    # the end's save waits for its files either way (the run ends with its checkpoint complete); refused where it
    # cannot write in the background at all: toolkit.config.combinations
    "checkpoint.async_save": lambda cfg: (
        "checkpoint.every=0 saves only at the end, which waits for its files either way" if not cfg.checkpoint.every
        else None),
    **{f"eval.harness_{name}": (lambda cfg: None if cfg.eval.harness_tasks else "eval.harness_tasks is empty: nothing "
                                "is scored") for name in ("include_path", "num_fewshot", "limit")},
    "model.gguf_cache": lambda cfg: (
        None if _gguf_base(cfg.model) else f"model.path={cfg.model.path} is not a GGUF base (model.gguf_file is empty)"),
}

# Keys whose check sits with their component, which knows the combination: key -> where.
CHECKED_BY = {
    "resume": "RunConfig.validate (with overwrite=true)",
    "train.beta": "FinetuneTrainConfig.validate", "train.gamma": "FinetuneTrainConfig.validate",
    "train.orpo_lambda": "FinetuneTrainConfig.validate",
    "data.chat_template": "FinetuneDataConfig.validate", "data.record_format": "FinetuneDataConfig.validate",
    "data.columns.conversation": "FinetuneDataConfig.validate",
}

# Read by every combination the recipes accept.
ALWAYS = (
    "output_dir", "seed", "overwrite",
    "train.epochs", "train.global_batch_size", "train.micro_batch_size", "train.mixed_precision",
    "train.collective_timeout_s", "train.on_nonfinite", "train.pipeline_stages", "train.step_sync",
    "train.objective",  # with data.format: FinetuneConfig.validate
    "optim.lr", "optim.lr_scaling", "optim.schedule", "optim.warmup_steps", "optim.betas", "optim.eps",
    "optim.weight_decay", "optim.max_grad_norm", "optim.fused",
    "checkpoint.every", "checkpoint.keep_last", "checkpoint.final_dtype", "checkpoint.on_save_error",
    "logging.every", "logging.trackers", "logging.profile",
    "eval.harness_tasks",  # empty: nothing scored, its default
    "eval.every", "eval.blocks",  # without held-out data (val_fraction=0) the data line says 0 held-out
    "samples.max_new_tokens", "samples.prompts",  # max_new_tokens=0 is the samples' off switch
    "data.path", "data.seq_len", "data.num_proc", "data.cache_dir", "data.streaming", "data.sources", "data.stages",
    "data.format", "data.val_path",  # val_path with sources: FinetuneDataConfig.validate
    "model.model_type", "model.config", "model.init_seed", "model.attn_implementation", "model.compile",
    "model.cast_weights",  # per_step where it cannot apply: toolkit.models.weight_cast
    "model.gradient_checkpointing", "model.loss", "model.path", "model.gguf_file", "model.dtype", "model.cache_dir",
    "tokenizer.path",
    "adapter.method",
)

# List-valued keys whose repeated entries would do a thing twice or mean nothing: refused (repeated_entries). The others' order or
# repeats mean something (optim.betas, logging.profile's [first, last], a prompt asked twice).
UNIQUE = ("logging.trackers", "adapter.target_modules", "adapter.modules_to_save", "adapter.layers", "eval.harness_tasks")
REPEATS_MEAN_SOMETHING = ("optim.betas", "logging.profile", "samples.prompts", "data.sources", "data.stages")


def _gguf_base(model) -> bool:
    path = model.path or ""
    return model.path is None or bool(model.gguf_file) or path.endswith(".gguf")


def unused_settings(cfg) -> list[str]:
    """One line for each key set away from its default where the rest of `cfg` gives it no effect."""
    default = type(cfg)()
    lines = []
    for key, need in USED_WHEN.items():
        value = get(cfg, key, absent=dataclasses.MISSING)
        if value is dataclasses.MISSING or value == get(default, key):
            continue
        if isinstance(need, Need):
            state = get(cfg, need.on, absent="text" if need.on == "data.format" else None)
            if state in need.values:
                continue
            lines.append(f"note: {key}={_said(value)} is ignored: {need.on}={_said(state)} gives it no effect (it is "
                         f"{need.whose})")
        elif (why := need(cfg)) is not None:
            lines.append(f"note: {key}={_said(value)} is ignored: {why}")
    return lines


def repeated_entries(cfg) -> list[str]:
    """One problem for each UNIQUE list that names an entry more than once."""
    problems = []
    for key in UNIQUE:
        values = get(cfg, key) or []
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            problems.append(f"{key} names {', '.join(twice)} more than once; list each once")
    return problems


def _said(value: Any) -> str:
    if value is None:
        return ""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return repr(text) if not text.isprintable() else text  # a line break would split the one line
