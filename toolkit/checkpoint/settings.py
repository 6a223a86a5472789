"""What a resume may change since its checkpoint: the data order may not move, the schedule's settings are
taken from the resumed step on, and AdamW's own hyperparameters (carried by its saved state) may not change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.config import UserError
from toolkit.data.mixture import stages_said, trained_part
from toolkit.run_dir import TrainerState


def check_same_data_order(folder: Path, seed: int, global_batch_size: int) -> None:
    """The batch order is a function of (seed, step, global batch): a resume with another seed or
    global batch would read other sequences than the interrupted run, so it is refused in one line.
    Everything else a strategy splits (processes, micro-batches, accumulation) may change."""
    saved = TrainerState.read(folder)
    for key, was, now in (("seed", saved.seed, seed), ("train.global_batch_size", saved.global_batch_size or None,
                                                       global_batch_size)):
        if was is not None and was != now:
            raise UserError(
                f"checkpoint {folder} was trained with {key}={was} and this run has {key}={now}: the data "
                f"position would not carry over; resume with {key}={was} (or start a new output_dir)"
            )


def check_same_mixture(folder: Path, mixture: dict, say: Callable[[str], None]) -> None:
    """A mixture's sources and the weights of the steps trained are part of the data order: a resume that
    changes them is refused in one line; other weights for the steps to come are taken, said in one line.
    `mixture` is this run's TrainerState.mixture ({} for one corpus)."""
    saved = TrainerState.read(folder)
    was, step = saved.mixture, saved.step
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


# What a resume does with each optimizer/schedule setting changed since the checkpoint (the README's
# Resume table): the schedule is a function of the step rebuilt from the config, so its settings
# are taken from the resumed step on; AdamW's hyperparameters travel with its saved state, which a
# resume loads over the config's, so a change there would be dropped: it is refused instead.
SCHEDULE = ("optim.lr", "optim.lr_scaling", "optim.lr_reference_batch", "optim.warmup_steps", "optim.schedule",
            "optim.min_lr_ratio", "train.max_steps")
FROM_NEXT_STEP = ("optim.max_grad_norm",)  # read at every step
KEPT_BY_THE_OPTIMIZER = ("optim.betas", "optim.eps", "optim.weight_decay")


def trained_settings(cfg) -> dict:
    """The settings a checkpoint records, by their dotted keys (a recipe config's optim and train); the
    fine-tuning objective's too, read at every step like FROM_NEXT_STEP."""
    values = {}
    for key in SCHEDULE + FROM_NEXT_STEP + KEPT_BY_THE_OPTIMIZER:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    values["optim.betas"] = list(values["optim.betas"])
    if hasattr(cfg.train, "objective_settings"):
        values.update(cfg.train.objective_settings())
    return values


def check_same_settings(folder: Path, settings: dict, max_steps: int) -> dict[str, tuple]:
    """Before loading: refuse a change a resume cannot take (one line naming each and what to do);
    return the ones it takes, {key: (in the checkpoint, now)}. `settings` is {} where a user's
    DeepSpeed JSON defines the optimizer or schedule (the recipe's optim section is not what runs)."""
    saved = TrainerState.read(folder)
    changed = {k: (saved.settings[k], v) for k, v in settings.items() if k in saved.settings and saved.settings[k] != v}
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


