"""Training checkpoints: the strategy's save_state in checkpoints/step-N/, keep the last K, resume.

A checkpoint is complete only once its TrainerState (`trainer_state.json`) is written, after
every rank has finished its part of `save_state`; a folder without it (a crash mid-save) is
never resumed from and never counts towards `keep_last` (see toolkit.run_dir). Just before it,
the manifest records every file's size and CRC-32 (toolkit.manifest), checked before a resume.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from toolkit.config import UserError, field
from toolkit.faults import fail_point, kill_point
from toolkit.manifest import MANIFEST, check_manifest, crc32, write_manifest
from toolkit.run_dir import (
    MODEL_FILES,
    PRUNED,
    STATE_FILE,
    RunDir,
    TrainerState,
    checkpoint_step,
    converted_state,
)
from toolkit.strategy.distributed import Strategy, numbers_only_loading
from toolkit.strategy.saved import OPTIMIZER_NAMES, SavedLayout, deepspeed_tag_folder, saved_layout


@dataclass
class CheckpointConfig:
    every: int = field(100, help="save a checkpoint every N optimizer steps (0 = only at the end)")
    keep_last: int = field(2, help="complete checkpoints to keep; older ones are deleted")
    final_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", help="dtype of the weights in final/ and adapter/: the fp32 master weights cast to it, under every strategy"
    )
    on_save_error: Literal["stop", "continue"] = field(
        "stop", help="when a checkpoint cannot be written (disk full, I/O error): stop the run (exit 5; resume=auto "
        "continues from the previous checkpoint once there is room) or train on and try again at the next save"
    )

    def validate(self) -> list[str]:
        problems = []
        if self.every < 0:
            problems.append(f"every={self.every} must be >= 0")
        if self.keep_last < 1:
            problems.append(f"keep_last={self.keep_last} must be at least 1")
        return problems


def save_checkpoint(
    strategy: Strategy,
    run: RunDir,
    state: TrainerState,
    keep_last: int,
    model_files: Callable[[Path], None] | None = None,
    say: Callable[[str], None] = print,
    rank_files: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank must call it.

    `model_files(folder)` writes what turns the saved weights back into a model without the
    run (config, tokenizer): recipes/export.py consolidates any checkpoint from it alone.
    `rank_files(folder)` is called on every rank, for what each rank keeps of its own (a stream's position).
    """
    acc = strategy.accelerator
    folder = run.checkpoint(state.step)
    # what wrote the files: a resume under another strategy or world size converts them
    state.strategy, state.world_size = strategy.name, strategy.world_size
    optimizer_names = strategy.optimizer_parameter_names()
    kill_point("save.start", state.step)
    if acc.is_main_process:
        if folder.exists():
            shutil.rmtree(folder)  # a stale, incomplete save of the same step
        shutil.rmtree(converted_state(folder), ignore_errors=True)  # made from a checkpoint of this step before
        run.drop_pruned()
    previous = run.latest_checkpoint()
    if acc.is_main_process and previous is not None:
        warn_low_space(folder, previous, say)
    acc.wait_for_everyone()
    # A write that fails (disk full, I/O error, permission) on any rank fails the save on every
    # rank: the partial folder goes, the previous checkpoint was never touched, and the trainer
    # stops or goes on as checkpoint.on_save_error says.
    failure = None
    try:
        strategy.save_state(folder)
        if rank_files is not None:
            rank_files(folder)
        fail_point("save.rank_files", state.step, folder)
    except (OSError, RuntimeError) as exc:
        failure = _write_failure(exc, strategy.rank, folder)
    kill_point("save.rank_files", state.step)
    failure = _first(strategy, failure)
    if failure is None and acc.is_main_process:
        try:
            if model_files is not None:
                model_files(folder / MODEL_FILES)
            if optimizer_names is not None:  # optimizer.bin numbers its parameters; say which is which
                (folder / OPTIMIZER_NAMES).write_text(json.dumps({"groups": optimizer_names}))
            fail_point("save.manifest", state.step, folder / MANIFEST)
            # The manifest before the state file (a complete checkpoint always has one), and its
            # checksum in the state: a state file copied in from another checkpoint is told apart.
            state.manifest_crc32 = crc32(write_manifest(folder))
            kill_point("save.manifest", state.step)
            state.write(folder)
        except (OSError, RuntimeError) as exc:
            failure = _write_failure(exc, strategy.rank, folder)
    failure = _first(strategy, failure)
    if failure is not None:
        if acc.is_main_process:
            written = _bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            needed = _bytes(previous) if previous is not None else written
            failure += f"; a checkpoint needs about {_size(needed)}, {_size(_free(folder))} is free there"
            failure += f"; {previous.name} is intact" if previous is not None else "; no earlier checkpoint exists"
        failure = _first(strategy, failure if acc.is_main_process else None)
        raise SaveFailed(f"checkpoint {folder.name} could not be written: {failure}")
    if acc.is_main_process:
        kill_point("save.state_file", state.step)
        done = run.complete_checkpoints()
        # never the newest one that passed its checks: after a skipped non-finite step or with
        # non-finite weights, the last keep_last saves may all hold a model that diverged
        passed = [c for c in done if not TrainerState.read(c).suspect][-1:]
        for old in [c for c in done[:-keep_last] if c not in passed]:
            # Out of rotation in one rename, then deleted: a crash mid-delete leaves a folder
            # that is plainly not a checkpoint, never a step-N that lost some of its files.
            going = old.rename(old.with_name(old.name + PRUNED))
            kill_point("prune", state.step)
            shutil.rmtree(going)
            converted = converted_state(old)  # its state by parameter name goes with it, the same way
            if converted.exists():
                shutil.rmtree(converted.rename(converted.with_name(converted.name + PRUNED)))
    acc.wait_for_everyone()
    return folder


class SaveFailed(Exception):
    """A checkpoint could not be written; its partial folder is gone and the previous one is intact."""


def _write_failure(exc: Exception, rank: int, folder: Path) -> str:
    """One line for a failed write; anything else is re-raised. torch.save reports a full disk
    as a RuntimeError from its zip writer ("unexpected pos ..."), not as an OSError."""
    if isinstance(exc, OSError):
        where = f" writing {exc.filename}" if exc.filename else ""
        return f"rank {rank}{where}: {exc.strerror or exc}"
    text = str(exc)
    if "inline_container" not in text and "write" not in text.lower():
        raise exc
    full = " (the disk is full)" if _free(folder) == 0 else ""
    return f"rank {rank} writing into {folder}: {text.splitlines()[0][:200]}{full}"


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _first(strategy: Strategy, failure: str | None) -> str | None:
    """Collective: the first rank's failure, the same verdict on every rank."""
    if strategy.world_size == 1:
        return failure
    from accelerate.utils import gather_object

    return next((f for f in gather_object([failure]) if f is not None), None)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _free(folder: Path) -> int:
    """Free bytes on the filesystem that holds `folder` (or its nearest existing parent)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def warn_low_space(folder: Path, previous: Path, say: Callable[[str], None]) -> None:
    """Before a save: say so when the disk has less room than the previous checkpoint took (a
    save of the same model needs as much), while there is still time to free some."""
    needed, free = _bytes(previous), _free(folder)
    if free < needed:
        say(f"warning: {_size(free)} free for checkpoint {folder.name}, the previous one took {_size(needed)}: "
            "it will likely fail; free space or lower checkpoint.keep_last")


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


# What a resume does with each optimizer/schedule setting changed since the checkpoint (the README's
# Resume table): the schedule is a function of the step rebuilt from the config, so its settings
# are taken from the resumed step on; AdamW's hyperparameters travel with its saved state, which a
# resume loads over the config's, so a change there would be dropped: it is refused instead.
SCHEDULE = ("optim.lr", "optim.lr_scaling", "optim.lr_reference_batch", "optim.warmup_steps", "optim.schedule",
            "optim.min_lr_ratio", "train.max_steps")
FROM_NEXT_STEP = ("optim.max_grad_norm",)  # read at every step
KEPT_BY_THE_OPTIMIZER = ("optim.betas", "optim.eps", "optim.weight_decay")


def trained_settings(cfg) -> dict:
    """The settings a checkpoint records, by their dotted keys (a recipe config's optim and train)."""
    values = {}
    for key in SCHEDULE + FROM_NEXT_STEP + KEPT_BY_THE_OPTIMIZER:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    values["optim.betas"] = list(values["optim.betas"])
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


def load_checkpoint(strategy: Strategy, folder: Path, say: Callable[[str], None] = print) -> TrainerState:
    """Collective. A checkpoint of another model shape is refused with one line, before loading.

    The shapes are compared from the configs (the checkpoint's model_files/ and the live model's),
    which reads the same under every strategy and on every rank; a size mismatch that still
    reaches the strategy's loader is translated the same way.

    A checkpoint of another strategy or world size that Accelerate cannot load as it is (see
    Strategy.resumes_natively) is converted to its state by parameter name and loaded from that
    (toolkit.strategy.consolidated), with one line saying so."""
    acc = strategy.accelerator
    # outside_training: the meta models are built as in a single process (under ZeRO-3 too)
    with strategy.outside_training():
        for model in acc._models:  # the prepared models: the trainer hands over only the strategy
            check_same_model(folder, acc.unwrap_model(model))
    saved = saved_layout(folder)
    if saved is not None and not strategy.resumes_natively(saved):
        _load_converted(strategy, folder, saved, say)
    else:
        _load_native(strategy, folder)
        strategy.load_stage_state(folder)
    state = TrainerState.read(folder)
    # Accelerate counts micro-batches to know which one closes an optimizer step, and load_state
    # restores the count of the run that saved: with another accumulation (another world size)
    # the steps would close on the wrong micro-batch (measured: FSDP2 from 2 processes to 1 went
    # off the curve at the first step). Every optimizer step is `accumulation` micro-batches.
    acc.step = state.step * strategy.accumulation
    return state


def _load_native(strategy: Strategy, folder: Path) -> None:
    acc = strategy.accelerator
    # Accelerate unpickles registered objects (our LR schedule) with weights_only=False, which
    # runs whatever code a tampered file names; for this load they are read as plain numbers.
    import accelerate.accelerator as accelerator_module

    real, accelerator_module.load_custom_state = accelerator_module.load_custom_state, _load_numbers_only
    try:
        with numbers_only_loading():  # DeepSpeed's own files likewise
            acc.load_state(str(folder))
    except pickle.UnpicklingError as exc:
        raise UserError(_not_only_numbers(folder, exc)) from None
    except RuntimeError as exc:
        found = _first_mismatch_in(str(exc))
        if found is None:
            raise
        raise UserError(_different_model(folder, found)) from None
    finally:
        accelerator_module.load_custom_state = real


def _load_converted(strategy: Strategy, folder: Path, saved: SavedLayout, say: Callable[[str], None]) -> None:
    """Weights and Adam state from the checkpoint's state by parameter name; the LR schedule and the
    random states (of the ranks that exist in both) from the checkpoint itself."""
    acc = strategy.accelerator
    here = SavedLayout(strategy.name, strategy.world_size).describe()
    if strategy.ds_owned:
        raise UserError(
            f"checkpoint {folder} was saved under {saved.describe()}; resuming it under {here} needs a conversion, "
            f"and this launch's DeepSpeed JSON defines its own {' and '.join(strategy.ds_owned)}, whose state the "
            f"conversion cannot fill: remove them from the JSON, or resume under {saved.describe()}"
        )
    converted, cached = strategy.converted_checkpoint(folder)
    strategy.load_consolidated(converted)
    for index, obj in enumerate(acc._custom_objects):  # the LR schedule
        saved_state = _numbers(folder / f"custom_checkpoint_{index}.pkl")
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            _load_schedule(obj, saved_state, folder)
        else:
            obj.load_state_dict(saved_state)
    _restore_random_states(folder / f"random_states_{strategy.rank}.pkl")
    how = f"reused its conversion {converted.name}" if cached else f"converted it into {converted.name}"
    say(f"checkpoint {folder.name} was saved under {saved.describe()}, this run is {here}: {how} (weights and "
        "Adam state by parameter name) and loaded it")


def _load_schedule(schedule: torch.optim.lr_scheduler.LRScheduler, saved: dict, folder: Path) -> None:
    """The saved schedule onto this run's parameter groups, and the rate of the next step into each
    group (a native load takes it from the optimizer's saved groups).

    A schedule keeps one rate (and one rate function) per parameter group of the run that saved it,
    and strategies do not agree on empty groups: DeepSpeed drops the recipe's no-decay group when it
    is empty (LoRA, whose adapter weights are all matrices), torch keeps it. The recipe gives every
    group the same rate and schedule, so the saved values are then one value, given to every group."""
    groups = schedule.optimizer.param_groups
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = saved.get(key)
        if not isinstance(values, list) or len(values) == len(groups):
            continue
        if any(value != values[0] for value in values):
            raise UserError(
                f"checkpoint {folder} has a learning rate for each of {len(values)} parameter groups and this run "
                f"has {len(groups)}, with different rates: they cannot be matched; resume it under the strategy "
                "it was saved with"
            )
        saved[key] = [values[0]] * len(groups)
    schedule.load_state_dict(saved)
    for group, lr in zip(groups, schedule.get_last_lr(), strict=True):
        group["lr"] = lr


def _restore_random_states(file: Path) -> None:
    """This rank's random generators as the rank of the same number left them, where it existed
    (dropout is the only consumer: the batch order is a function of the seed and step)."""
    if not file.is_file():
        return
    import random

    import numpy as np
    from accelerate.utils import load

    states = load(file)  # weights_only, numpy's state allowed
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _load_numbers_only(obj, path: str, index: int = 0) -> None:
    """accelerate.checkpointing.load_custom_state, refusing any pickled object beyond tensors,
    numbers, strings and containers."""
    obj.load_state_dict(_numbers(Path(path) / f"custom_checkpoint_{index}.pkl"))


def _numbers(file: Path):
    """A torch file's contents, refused in one line if it pickles anything beyond numbers."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(_not_only_numbers(file, exc)) from None


def _not_only_numbers(where: Path, exc: Exception) -> str:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    what = f" ({found.group(1)})" if found else ""
    return (
        f"{where} holds pickled objects beyond tensors and numbers{what}; the toolkit never unpickles "
        "those (they can run code): resume from a checkpoint the toolkit wrote"
    )


def check_same_model(folder: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose model_files/ config (and adapter config) give other parameter
    shapes than `model`'s; nothing to compare for a checkpoint without them or a model without a config."""
    files = folder / MODEL_FILES
    lora = hasattr(model, "peft_config")
    base = model.get_base_model() if lora else model
    if not (files / "config.json").is_file() or not isinstance(getattr(base, "config", None), PretrainedConfig):
        return
    saved_adapter = None
    if (files / "adapter_config.json").is_file():
        from peft import PeftConfig

        saved_adapter = PeftConfig.from_pretrained(str(files))
    saved = _shapes(AutoConfig.from_pretrained(files), saved_adapter)
    live = _shapes(base.config, model.peft_config["default"] if lora else None)
    found = _first_mismatch(saved, live)
    if found is not None:
        raise UserError(_different_model(folder, found))


def _shapes(config: PretrainedConfig, adapter) -> dict[str, list[int]]:
    """Parameter name -> shape of the model a config (and adapter config) builds; on the meta
    device, so nothing is allocated whatever the model's size."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):  # QLoRA: compare the float architecture
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if adapter is not None:
            from peft import get_peft_model

            model = get_peft_model(model, copy.deepcopy(adapter))
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _first_mismatch(saved: dict[str, list[int]], live: dict[str, list[int]]) -> tuple[str, str, str] | None:
    """(parameter, its shape in the checkpoint, in this model), in the live model's order."""
    for name, shape in live.items():
        if name not in saved:
            return name, "absent", str(shape)
        if saved[name] != shape:
            return name, str(saved[name]), str(shape)
    extra = next((name for name in saved if name not in live), None)
    return None if extra is None else (extra, str(saved[extra]), "absent")


_SIZE = re.compile(
    r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)
_MISSING = re.compile(r'Missing key\(s\) in state_dict: "([^"]+)"')
_UNEXPECTED = re.compile(r'Unexpected key\(s\) in state_dict: "([^"]+)"')


def _first_mismatch_in(error: str) -> tuple[str, str, str] | None:
    """The first parameter that torch's load_state_dict refused, from its error text."""
    if m := _SIZE.search(error):
        return m.group(1), m.group(2), m.group(3)
    if m := _MISSING.search(error):
        return m.group(1), "absent", "present"
    if m := _UNEXPECTED.search(error):
        return m.group(1), "present", "absent"
    return None


def _different_model(folder: Path, found: tuple[str, str, str]) -> str:
    name, saved, live = found
    return (
        f"checkpoint {folder} holds a different model: {name} is {saved} there and {live} in this run; "
        "resume with the model settings it was saved with, or start a new output_dir"
    )


def intact_checkpoint(
    strategy: Strategy, run: RunDir, chosen: Path, auto: bool, say: Callable[[str], None] = print
) -> Path:
    """Collective: the checkpoint to resume from once its manifest is checked (on the main process;
    every rank gets the same verdict).

    resume=auto falls back to the newest older checkpoint that is intact, saying so, and moves
    each damaged one aside (`step-N.damaged`: kept for a post-mortem, out of rotation, never
    resumed from); resume=PATH stops in one line that names the damaged file.
    """

    def choose() -> Path:
        run.drop_pruned()
        candidates = [chosen] + ([c for c in reversed(run.complete_checkpoints()) if c != chosen] if auto else [])
        problems = []
        for folder in candidates:
            problem = check_manifest(folder) or check_state_file(folder)
            if problem is None:
                return folder
            problems.append(problem)
            if not auto:
                break
            aside = folder.with_name(folder.name + ".damaged")
            folder.rename(aside)
            say(f"checkpoint {folder.name} is damaged ({problem}); moved to {aside.name}, trying the one before")
        where = f"resume={chosen}" if not auto else f"resume=auto: no intact checkpoint in {run.checkpoints}"
        raise UserError(f"{where}: {problems[0]}; resume from an intact checkpoint or start a new output_dir")

    return strategy.on_main(choose)


def check_state_file(folder: Path) -> str | None:
    """None if the checkpoint's trainer_state.json is its own: readable, of the folder's step, and
    naming the checksum of the manifest beside it (checkpoints older than that field pass on the step)."""
    path = folder / STATE_FILE
    try:
        state = TrainerState.read(folder)
    except (OSError, ValueError, TypeError) as exc:
        return f"{path} is not a readable trainer state ({exc})"
    step = checkpoint_step(folder)
    if step is not None and state.step != step:
        return f"{path} is of step {state.step}, not {step}: a state file from another checkpoint"
    manifest = folder / MANIFEST
    if state.manifest_crc32 and not manifest.is_file():  # else every file it lists would go unchecked
        return f"{manifest} is missing (its {STATE_FILE} names one), so its files cannot be checked"
    if state.manifest_crc32 and crc32(manifest) != state.manifest_crc32:
        return f"{path} belongs to another checkpoint (it names another manifest than {manifest})"
    if not manifest.is_file():  # a checkpoint older than manifests: at least every rank's files
        return missing_rank_file(folder)
    return None


def missing_rank_file(folder: Path) -> str | None:
    """The first file one rank of the run that saved `folder` should have written and did not: its
    random states (every strategy), its ZeRO optimizer partition (DeepSpeed ZeRO-1/2/3, which
    otherwise fails deep in DeepSpeed with a ValueError that names no rank)."""
    saved = saved_layout(folder)
    if saved is None or not saved.world_size:
        return None
    for rank in range(saved.world_size):
        if not (folder / f"random_states_{rank}.pkl").is_file():
            return f"{folder / f'random_states_{rank}.pkl'} is missing (rank {rank} of {saved.world_size} writes it)"
    if saved.layout in ("zero1", "zero2", "zero3"):
        tag = deepspeed_tag_folder(folder)
        for rank in range(saved.world_size):
            if not any(tag.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt")):
                return (f"{tag}/*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt is missing (the optimizer state of rank "
                        f"{rank} of {saved.world_size})")
    return None
