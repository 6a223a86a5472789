"""What a resume may change since its checkpoint: the data order may not move, the schedule's settings are
taken from the resumed step on, and AdamW's own hyperparameters (carried by its saved state) may not change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.integrity import read_intact
from toolkit.config.declarations import FROM_NEXT_STEP, KEPT_BY_THE_OPTIMIZER, SCHEDULE, Resume, declared
from toolkit.config.errors import UserError
from toolkit.config.keys import value_at
from toolkit.config.switches import AUTO
from toolkit.data.mixture import stages_said, trained_part, weight_plan
from toolkit.run.paths import READ


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


# What a resume does with a change of each key since its checkpoint is declared on the key's field (resume=, the
# kinds in toolkit.config.declarations): refused (what decides which tokens a step sees, what the ids mean, the shape
# or what trains), checked on its own (the data order and mixture, above, and a streamed run's place: resume's
# rank_files), taken from the resumed step on (the schedule, rebuilt from the config), taken from the next step (read
# at every step), kept by AdamW's saved state (refused) or free (where and how the same numbers are computed, saved or
# reported). A checkpoint records the refused, taken and kept keys (trained_settings).
RECORDED = ("refused", SCHEDULE.kind, FROM_NEXT_STEP.kind, KEPT_BY_THE_OPTIMIZER.kind)
# but for these: fp8 is bf16 with some matmuls in float8, over the same parameters, masters and optimizer state
SAME_STATE_PRECISIONS = {"bf16", "fp8"}


def trained_settings(cfg, optimizer_in_ds_json: bool = False) -> dict:
    """The settings a checkpoint records (the keys of this recipe's config whose change a resume refuses or takes, or
    AdamW keeps), by their dotted keys; gamma and orpo_lambda only where the objective uses them, at the value it uses.
    With `optimizer_in_ds_json` (a user's DeepSpeed JSON defines the optimizer or schedule, so the optim section is
    not what runs) the optimizer's and schedule's are left out."""
    on_resume = declared(type(cfg), "resume")
    keys = [k for kind in RECORDED for k, r in on_resume.items() if r.kind == kind]
    if optimizer_in_ds_json:
        keys = [k for k in keys if not k.startswith("optim.") and k != "train.max_steps"]
    paths = {key for key, role in declared(type(cfg), "path").items() if role == READ}  # compared as the files they name
    # (a source's name, forgetting.general=docs, is a name, even where a folder docs/ exists)
    names = {s.name for s in getattr(cfg.data, "sources", []) if s is not None}
    values = {}
    for key in keys:
        value = value_at(cfg, key, absent=dataclasses.MISSING)
        if value is dataclasses.MISSING or key in ("train.gamma", "train.orpo_lambda"):
            continue
        if key in paths and isinstance(value, str) and Path(value).exists() and value not in names:
            value = str(Path(value).resolve())  # the same file, wherever the run is launched from (load_config expanded ~)
        values[key] = list(value) if isinstance(value, tuple) else value
    if hasattr(cfg.train, "objective_settings"):
        values.update(cfg.train.objective_settings())
    return values


def check_same_settings(checkpoint: Checkpoint, settings: dict, max_steps: int,
                        on_resume: dict[str, Resume]) -> dict[str, tuple]:
    """Before loading: refuse a change a resume cannot take (one line naming each and what to do);
    return the ones it takes, {key: (in the checkpoint, now)}. `settings` is {} where a user's
    DeepSpeed JSON defines the optimizer or schedule (the recipe's optim section is not what runs);
    `on_resume` is what the recipe's config declares of each key (declared(type(cfg), "resume"))."""
    folder, saved = checkpoint.folder, checkpoint.state
    changed = {k: (saved.settings[k], v) for k, v in settings.items() if k in saved.settings and saved.settings[k] != v}
    refused = [f"{key}={_said(a)} (this run has {_said(b)}: {on_resume[k].why})" for k, (was, now) in changed.items()
               if on_resume[k].kind == "refused" and not _same_state(k, was, now)
               for key, a, b in _differences(k, was, now)]
    if refused:
        raise UserError(
            f"checkpoint {folder} was trained with {'; '.join(refused)}; a resume cannot take "
            f"{'these changes' if len(refused) > 1 else 'the change'}: resume with the checkpoint's value, or start a "
            "new output_dir (model.path= its final/ or a checkpoint's weights for a fine-tune)"
        )
    kept = [f"{k}={was} (this run has {now})" for k, (was, now) in changed.items()
            if on_resume[k] == KEPT_BY_THE_OPTIMIZER]
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


def check_before_preparing(folder: Path, cfg, optimizer_in_ds_json: bool = False, launched: bool = True) -> None:
    """A resume's refusals that the config and checkpoint `folder`'s record (trainer_state.json) decide, said before
    any data is prepared or model loaded (a tokenizer trained and a corpus packed, a 7B base loaded: minutes): the data
    order and the settings a resume cannot take, as the resume would say them. A record that cannot be read, or is
    not this checkpoint's (integrity.read_intact's cheap checks), is left to the resume's own check (resume=auto sets
    that checkpoint aside and tries the one before)."""
    checkpoint, _ = read_intact(folder)
    if checkpoint is None:
        return
    check_same_data_order(checkpoint, cfg.seed, cfg.train.global_batch_size, getattr(cfg.data, "streaming", False))
    sources = getattr(cfg.data, "sources", None)  # the mixture's record, as the recipes' weight_plan makes it
    mixture = {"sources": [s.name for s in sources],
               "plan": [[start, weights] for start, weights in weight_plan(sources, cfg.data.stages)]} if sources else {}
    check_same_mixture(checkpoint, mixture, lambda line: None)  # the resume says a change it takes
    settings = trained_settings(cfg, optimizer_in_ds_json)
    if not launched:  # an auto switch is made concrete for the launched device: compared once it is
        settings = {k: v for k, v in settings.items() if k not in AUTO or v != AUTO[k][0]}
    if cfg.train.epochs is not None:  # its steps follow from the packed blocks: the resume checks them
        settings.pop("train.max_steps", None)
        max_steps = checkpoint.state.step
    else:
        max_steps = cfg.train.max_steps
    check_same_settings(checkpoint, settings, max_steps, declared(type(cfg), "resume"))


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
    """As a user writes it to get it back: null (data.path=null, the embedded corpus; was said as "(empty)")."""
    return "null" if value is None else "(empty)" if value == "" else str(value)


def take_changed_settings(
    changed: dict[str, tuple], scheduler, step: int, peak_lr: float, say: Callable[[str], None],
    on_resume: dict[str, Resume],
) -> None:
    """After loading: the schedule of the new settings from `step` on, said in one line. Its functions
    of the step are already built from the config; its peak rate (`peak_lr`, OptimConfig.peak_lr) and
    the rate of the next step are the checkpoint's until set here."""
    if not changed:
        return
    now = ""
    if scheduler is not None and any(on_resume[k] == SCHEDULE for k in changed):
        groups = scheduler.optimizer.param_groups
        was = groups[0]["lr"]
        scheduler.base_lrs = [peak_lr] * len(groups)  # the recipe gives every group the same peak
        for group in groups:
            group["initial_lr"] = peak_lr
        rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, lr in zip(groups, rates, strict=True):
            group["lr"] = lr
        scheduler._last_lr = rates
        digits = next((d for d in (4, 6, 8, 17) if f"{rates[0]:.{d}g}" != f"{was:.{d}g}"), None)
        now = (f"; the learning rate of step {step + 1} is {rates[0]:.4g}, unchanged" if digits is None else
               f"; the learning rate of step {step + 1} is {rates[0]:.{digits}g} (was {was:.{digits}g})")
    listed = ", ".join(f"{k} {was} -> {v}" for k, (was, v) in changed.items())
    say(f"resumed with changed settings, taken from step {step + 1} on: {listed}{now}")


