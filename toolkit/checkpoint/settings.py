"""What a resume may change since its checkpoint: the data order may not move, the schedule's settings are
taken from the resumed step on, and AdamW's own hyperparameters (carried by its saved state) may not change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.formats import Checkpoint
from toolkit.config.errors import UserError
from toolkit.config.keys import value_at
from toolkit.data.mixture import stages_said, trained_part
from toolkit.run.paths import PATH_SETTINGS, READ


def check_same_data_order(checkpoint: Checkpoint, seed: int, global_batch_size: int, streaming: bool = False) -> None:
    """The batch order is a function of (seed, step, global batch): a resume with another seed or
    global batch would read other sequences than the interrupted run, so it is refused in one line.
    Everything else a strategy splits (processes, micro-batches, accumulation) may change. A streamed
    run's position is a place in its stream (stream_*.npz): prepared data cannot take it up."""
    folder, saved = checkpoint.folder, checkpoint.state
    if not streaming and any(folder.glob("stream_*.npz")):
        raise UserError(f"checkpoint {folder} was trained with data.streaming=true: its data position is a place in "
                        "the stream; resume it with data.streaming=true")
    for key, was, now in (("seed", saved.seed, seed), ("train.global_batch_size", saved.global_batch_size or None,
                                                       global_batch_size)):
        if was is not None and was != now:
            raise UserError(
                f"checkpoint {folder} was trained with {key}={was} and this run has {key}={now}: the data "
                f"position would not carry over; resume with {key}={was} (or start a new output_dir)"
            )


def check_same_mixture(checkpoint: Checkpoint, mixture: dict, say: Callable[[str], None]) -> None:
    """A mixture's sources and the weights of the steps trained are part of the data order: a resume that
    changes them is refused in one line; other weights for the steps to come are taken, said in one line.
    `mixture` is this run's TrainerState.mixture ({} for one corpus)."""
    folder, was, step = checkpoint.folder, checkpoint.state.mixture, checkpoint.state.step
    if not was and not mixture:
        return

    def names(m: dict) -> str:
        return f"the mixture of {', '.join(m['sources'])} (data.sources)" if m else "one corpus (data.path)"

    if not was or not mixture or was["sources"] != mixture["sources"]:
        raise UserError(f"checkpoint {folder} was trained on {names(was)} and this run reads {names(mixture)}: the "
                        "data position would not carry over; resume with the checkpoint's data section (or start a "
                        "new output_dir)")
    if trained_part(was["plan"], step) != trained_part(mixture["plan"], step):
        raise UserError(f"checkpoint {folder} trained steps 1-{step} with other data.sources weights or data.stages "
                        f"than this run gives those steps; resume with them as they were: only the weights from step "
                        f"{step + 1} on may change")
    if was["plan"] != mixture["plan"]:
        in_force = next(weights for start, weights in reversed(mixture["plan"]) if start <= step)
        coming = [(step, in_force)] + [(start, weights) for start, weights in mixture["plan"] if start > step]
        say(f"resumed with changed data.stages, taken from step {step + 1} on: "
            + "; ".join(stages_said(mixture["sources"], coming)))


# Every key of the recipe configs x what a resume does with a change since its checkpoint. A checkpoint
# records the REFUSED, TAKEN and KEPT_BY_THE_OPTIMIZER keys (trained_settings); tests/toolkit/checkpoint/
# test_settings.py walks every field, so a new key fails until it is classified here.
#
# Refused: what decides which tokens a step sees, what the token ids mean, the model's shape or what trains.
TOKENS = "it decides which tokens each step reads"
IDS = "it decides what the token ids mean"
SHAPE = "it decides the model's shape and which weights train"
REFUSED = {
    **{f"data.{k}": TOKENS for k in ("path", "name", "split", "text_column", "sample_by", "seq_len", "val_fraction",
                                     "val_path", "format", "overlong", "chat_template", "record_format",
                                     "stream_val_documents", "columns.conversation", "columns.role", "columns.content",
                                     "columns.user", "columns.assistant", "columns.system")},
    **{f"tokenizer.{k}": IDS for k in ("path", "vocab_size", "min_frequency", "train_documents")},
    **{f"model.{k}": SHAPE for k in ("model_type", "config", "path", "gguf_file", "dtype")},
    **{f"adapter.{k}": SHAPE for k in ("method", "r", "alpha", "layers", "target_modules", "modules_to_save", "dora",
                                       "rslora")},
    "train.mixed_precision": "the strategy's saved weights and optimizer state are in its precision",
}
# but for these: fp8 is bf16 with some matmuls in float8, over the same parameters, masters and optimizer state
SAME_STATE_PRECISIONS = {"bf16", "fp8"}
# Checked on their own, before these: the data order and the mixture (check_same_data_order, check_same_mixture),
# and a streamed run's place in its stream (resume's rank_files).
OWN_CHECK = ("seed", "train.global_batch_size", "data.sources", "data.stages", "data.streaming")
# Taken from the resumed step on, said in one line: the schedule is a function of the step rebuilt from the
# config; the rest is read at every step.
SCHEDULE = ("optim.lr", "optim.lr_scaling", "optim.lr_reference_batch", "optim.warmup_steps", "optim.schedule",
            "optim.min_lr_ratio", "train.max_steps")
FROM_NEXT_STEP = ("optim.max_grad_norm", "train.epochs", "train.fp8_recipe", "train.fp8_layers", "train.on_nonfinite",
                  "train.max_nonfinite_skips", "adapter.dropout", "eval.blocks", "train.objective", "train.beta", "train.gamma", "train.orpo_lambda")
# AdamW's hyperparameters travel with its saved state, which a resume loads over the config's: refused.
KEPT_BY_THE_OPTIMIZER = ("optim.betas", "optim.eps", "optim.weight_decay")
# Free to change: where and how the same numbers are computed, saved or reported (the proof in brackets).
FREE = {
    "output_dir": "where the run is (resume=PATH names a checkpoint of another)",
    "resume": "which checkpoint", "overwrite": "refused beside resume (RunConfig.validate)",
    "train.micro_batch_size": "the accumulation splits the same global batch (test_strategies' parity runs)",
    "train.pipeline_stages": "a checkpoint converts to another layout (test_resume_elsewhere)",
    "train.collective_timeout_s": "a wait limit", "train.step_sync": "when the host reads the step's verdict",
    "optim.fused": "an implementation of the same AdamW step",
    **{f"checkpoint.{k}": "what is saved and when, not what trains" for k in ("every", "keep_last", "final_dtype",
                                                                            "on_save_error", "async_save")},
    **{f"logging.{k}": "what is reported" for k in ("every", "trackers", "profile")},
    "eval.every": "when the held-out loss is measured",
    **{f"eval.harness_{k}": "what is scored, in a process of its own (toolkit.training.harness_runs)"
       for k in ("tasks", "include_path", "num_fewshot", "limit")},
    "samples.prompts": "generated from the base again on a resume (recipes/finetune.py)",
    "samples.max_new_tokens": "generated from the base again on a resume (recipes/finetune.py)",
    "data.num_proc": "tokenization processes", "data.cache_dir": "where the same blocks are cached",
    "model.init_seed": "the weights come from the checkpoint",
    "model.attn_implementation": "the same attention (test_attention's equivalence)",
    "model.compile": "the same forward, compiled", "model.cast_weights": "the same casts (test_weight_cast)",
    "model.gradient_checkpointing": "recomputation (test_gradient_checkpointing)",
    "model.gradient_checkpointing_k": "recomputation (test_gradient_checkpointing)",
    "model.loss": "the chunked loss equals the full one (test_loss)", "model.loss_chunk_tokens": "(test_loss)",
    "model.cache_dir": "where the base's float copy is kept", "model.gguf_cache": "whether it is kept",
    "adapter.merge": "what final/ holds after training",
}
PATHS = tuple(key for key, role in PATH_SETTINGS.items() if role == READ)  # compared as the files they name


def trained_settings(cfg, optimizer_in_ds_json: bool = False) -> dict:
    """The settings a checkpoint records (REFUSED, TAKEN and KEPT_BY_THE_OPTIMIZER keys this recipe's config has), by
    their dotted keys; gamma and orpo_lambda only where the objective uses them, at the value it uses. With
    `optimizer_in_ds_json` (a user's DeepSpeed JSON defines the optimizer or schedule, so the optim section is not
    what runs) the optimizer's and schedule's are left out."""
    keys = [*REFUSED, *SCHEDULE, *FROM_NEXT_STEP, *KEPT_BY_THE_OPTIMIZER]
    if optimizer_in_ds_json:
        keys = [k for k in keys if not k.startswith("optim.") and k != "train.max_steps"]
    values = {}
    for key in keys:
        value = value_at(cfg, key, absent=dataclasses.MISSING)
        if value is dataclasses.MISSING or key in ("train.gamma", "train.orpo_lambda"):
            continue
        if key in PATHS and isinstance(value, str) and Path(value).exists():  # load_config expanded `~` and $VAR
            value = str(Path(value).resolve())  # the same file, wherever the run is launched from
        values[key] = list(value) if isinstance(value, tuple) else value
    if hasattr(cfg.train, "objective_settings"):
        values.update(cfg.train.objective_settings())
    return values


def check_same_settings(checkpoint: Checkpoint, settings: dict, max_steps: int) -> dict[str, tuple]:
    """Before loading: refuse a change a resume cannot take (one line naming each and what to do);
    return the ones it takes, {key: (in the checkpoint, now)}. `settings` is {} where a user's
    DeepSpeed JSON defines the optimizer or schedule (the recipe's optim section is not what runs)."""
    folder, saved = checkpoint.folder, checkpoint.state
    changed = {k: (saved.settings[k], v) for k, v in settings.items() if k in saved.settings and saved.settings[k] != v}
    refused = [f"{key}={_said(a)} (this run has {_said(b)}: {REFUSED[k]})" for k, (was, now) in changed.items()
               if k in REFUSED and not _same_state(k, was, now) for key, a, b in _differences(k, was, now)]
    if refused:
        raise UserError(
            f"checkpoint {folder} was trained with {'; '.join(refused)}; a resume cannot take "
            f"{'these changes' if len(refused) > 1 else 'the change'}: resume with the checkpoint's value, or start a "
            "new output_dir (model.path= its final/ or a checkpoint's weights for a fine-tune)"
        )
    kept = [f"{k}={was} (this run has {now})" for k, (was, now) in changed.items() if k in KEPT_BY_THE_OPTIMIZER]
    if kept:
        raise UserError(
            f"checkpoint {folder} was trained with {', '.join(kept)}: AdamW's saved state carries them and a resume "
            f"loads them over the config, so the change would be dropped; resume with the checkpoint's values, or "
            "start a new output_dir (from its final/ or a checkpoint's weights)"
        )
    if max_steps < saved.step:
        raise UserError(
            f"train.max_steps={max_steps} is below the step of checkpoint {folder} ({saved.step}): a "
            f"resume cannot go back; set train.max_steps >= {saved.step}, or resume=PATH an earlier checkpoint"
        )
    return changed


def _same_state(key: str, was, now) -> bool:
    return key == "train.mixed_precision" and {was, now} <= SAME_STATE_PRECISIONS


def _differences(key: str, was, now):
    """(key, was, now) of each difference: a dict's (model.config) by its own keys."""
    if not (isinstance(was, dict) and isinstance(now, dict)):
        yield key, was, now
        return
    for sub in [*was, *(k for k in now if k not in was)]:
        if was.get(sub) != now.get(sub):
            yield f"{key}.{sub}", was.get(sub), now.get(sub)


def _said(value) -> str:
    return "(empty)" if value is None or value == "" else str(value)


def take_changed_settings(
    changed: dict[str, tuple], scheduler, step: int, peak_lr: float, say: Callable[[str], None]
) -> None:
    """After loading: the schedule of the new settings from `step` on, said in one line. Its functions
    of the step are already built from the config; its peak rate (`peak_lr`, OptimConfig.peak_lr) and
    the rate of the next step are the checkpoint's until set here."""
    if not changed:
        return
    now = ""
    if scheduler is not None and any(k in SCHEDULE for k in changed):
        groups = scheduler.optimizer.param_groups
        was = groups[0]["lr"]
        scheduler.base_lrs = [peak_lr] * len(groups)  # the recipe gives every group the same peak
        for group in groups:
            group["initial_lr"] = peak_lr
        rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, lr in zip(groups, rates, strict=True):
            group["lr"] = lr
        scheduler._last_lr = rates
        now = f"; the learning rate of step {step + 1} is {rates[0]:.4g} (was {was:.4g})"
    listed = ", ".join(f"{k} {was} -> {v}" for k, (was, v) in changed.items())
    say(f"resumed with changed settings, taken from step {step + 1} on: {listed}{now}")


