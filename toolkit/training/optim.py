"""AdamW with decoupled weight decay, a warmup + cosine/linear learning-rate schedule, and the
peak rate scaled with the global batch when asked (optim.lr_scaling)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from toolkit.config.declarations import (
    ALWAYS,
    FROM_NEXT_STEP,
    KEPT_BY_THE_OPTIMIZER,
    SCHEDULE,
    Need,
    free,
)
from toolkit.config.load import field


@dataclass
class OptimConfig:
    lr: float = field(1e-3, help="peak learning rate", resume=SCHEDULE, used_when=ALWAYS)
    min_lr_ratio: float = field(0.1, help="cosine: final learning rate as a fraction of the peak", resume=SCHEDULE,
                                used_when=Need("optim.schedule", ("cosine",), "the cosine schedule's"),
                                accepts={"0": "cosine down to 0"})
    warmup_steps: int = field(0, help="linear warmup steps from 0 to the peak", resume=SCHEDULE, used_when=ALWAYS,
                              accepts={"0": "no warmup: the default", "2**31": "a warmup longer than the run: the lr "
                                       "it reaches is logged each step, and a resume that raises max_steps goes on to "
                                       "the peak"})
    schedule: Literal["cosine", "linear", "constant"] = field(
        "cosine", help="decay after warmup: cosine (to min_lr_ratio), linear (to 0), constant", resume=SCHEDULE,
        used_when=ALWAYS)
    weight_decay: float = field(0.1, help="AdamW weight decay (not applied to norms and biases)",
                                resume=KEPT_BY_THE_OPTIMIZER, used_when=ALWAYS, accepts={"0": "no decay"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], help="AdamW betas", resume=KEPT_BY_THE_OPTIMIZER,
                               used_when=ALWAYS, unique=False)  # two betas may be equal
    eps: float = field(1e-8, help="AdamW epsilon", resume=KEPT_BY_THE_OPTIMIZER, used_when=ALWAYS)
    max_grad_norm: float = field(1.0, help="clip the global gradient norm to this (0 = no clipping)",
                                 resume=FROM_NEXT_STEP, used_when=ALWAYS, accepts={"0": "no clipping, as documented"})
    fused: Literal["auto", "true", "false"] = field(
        "auto", help="torch's fused AdamW kernel: auto = on CUDA, where it is fastest; true/false to force",
        resume=free("an implementation of the same AdamW step"), used_when=ALWAYS,
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = field(
        "none", help="scale lr with train.global_batch_size from lr_reference_batch: linear (lr x B/B_ref, "
        "as for SGD) or sqrt (lr x sqrt(B/B_ref), the usual rule for Adam); none = lr as written",
        resume=SCHEDULE, used_when=ALWAYS,
    )
    lr_reference_batch: int = field(
        0, help="the global batch size lr was tuned at (needed by lr_scaling)", resume=SCHEDULE,
        used_when=Need("optim.lr_scaling", ("linear", "sqrt"), "lr_scaling's"),
        accepts={"0": "the default; lr_scaling=none does not read it",
                 "2**31": "the batch lr was tuned at: the scaled rate is what the run logs"},
    )

    def validate(self) -> list[str]:
        problems = []
        if self.lr <= 0:
            problems.append(f"lr={self.lr} must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.weight_decay < 0:  # torch's AdamW refuses it with a traceback when the optimizer is built
            problems.append(f"weight_decay={self.weight_decay} must be >= 0 (0 = no decay)")
        if self.eps <= 0:  # AdamW divides by sqrt(v) + eps: a weight with no gradient yet would turn NaN
            problems.append(f"eps={self.eps} must be > 0 (AdamW divides by it where a weight has had no gradient)")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps={self.warmup_steps} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"betas={self.betas} must be two numbers in [0, 1)")
        if self.max_grad_norm < 0:
            problems.append(f"max_grad_norm={self.max_grad_norm} must be >= 0")
        if self.lr_reference_batch < 0:
            problems.append(f"lr_reference_batch={self.lr_reference_batch} must be >= 0")
        elif self.lr_scaling != "none" and self.lr_reference_batch == 0:
            problems.append(f"lr_reference_batch=0 must be the global batch size lr was tuned at, since "
                            f"lr_scaling={self.lr_scaling} scales lr from it")
        return problems

    def peak_lr(self, global_batch: int) -> float:
        """The peak learning rate at `global_batch` sequences per step: lr, scaled by lr_scaling."""
        if self.lr_scaling == "none":
            return self.lr
        ratio = global_batch / self.lr_reference_batch
        return self.lr * (ratio if self.lr_scaling == "linear" else math.sqrt(ratio))


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, adamw=torch.optim.AdamW, lr: float | None = None
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters at peak rate `lr` (cfg.lr when None); `adamw` is the class
    the strategy asks for (`Strategy.adamw()`: DeepSpeed's CPU AdamW when it offloads optimizer
    state, the same update)."""
    # Matrices decay; vectors (norm gains, biases) do not, as in GPT-2/LLaMA training.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw(groups, lr=cfg.lr if lr is None else lr, betas=tuple(cfg.betas), eps=cfg.eps)


def use_fused(fused: str, device: torch.device) -> bool:
    """torch's fused AdamW: one kernel for all parameters instead of a few per tensor list. The
    same update up to rounding; `auto` takes it on CUDA only, so CPU runs keep their exact numbers."""
    return fused == "true" or (fused == "auto" and device.type == "cuda")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    """transformers' schedules: cosine decays to min_lr_ratio x peak, linear to 0."""
    name = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}[cfg.schedule]
    extra = {"min_lr_rate": cfg.min_lr_ratio} if cfg.schedule == "cosine" else None
    # imported here: transformers.optimization imports peft, and peft bitsandbytes, which a run marks
    # absent first when it does not use it (toolkit.models.adapter.leave_out_bitsandbytes)
    from transformers import get_scheduler

    return get_scheduler(
        name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max_steps, scheduler_specific_kwargs=extra
    )


def wind_back(scheduler) -> None:
    """The schedule one step back: it stepped for a step whose skip the host learned a step later
    (train.step_sync=none). transformers' schedules are LambdaLR, a rate per position; the count of calls
    goes back too, so that the state saved is the one of a run that never stepped it."""
    scheduler.last_epoch -= 2
    scheduler.step()
    scheduler._step_count -= 2


def prepare_optimization(strategy, model: torch.nn.Module, cfg: OptimConfig, max_steps: int, global_batch: int):
    """(model, optimizer, scheduler, step_scheduler): everything prepared by the strategy, at the
    peak rate for `global_batch` (OptimConfig.peak_lr).

    The recipe's AdamW and schedule, unless a user's DeepSpeed JSON defines its own optimizer or
    scheduler (its backend's `optimization_owned`): then DeepSpeed builds them from placeholders. Our scheduler
    is built on the prepared optimizer (ZeRO-3 and FSDP2 rebuild the parameter groups), stepped
    once per optimizer step by the trainer (`step_scheduler`; Accelerate would step it once per
    process) and saved through register_for_checkpointing.
    """
    lr, owned = cfg.peak_lr(global_batch), strategy.family.optimization_owned(strategy)
    if "optimizer" in owned:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = strategy.placeholder_optimizer(trainable, lr, cfg.weight_decay)
    else:
        adamw = strategy.adamw()
        if adamw is torch.optim.AdamW and use_fused(cfg.fused, strategy.accelerator.device):
            adamw = functools.partial(torch.optim.AdamW, fused=True)
        optimizer = build_optimizer(model, cfg, adamw, lr)
    if "scheduler" in owned:
        scheduler = strategy.placeholder_scheduler(optimizer, max_steps, cfg.warmup_steps)
        model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
        return model, optimizer, scheduler, False  # the DeepSpeed engine steps it
    model, optimizer = strategy.prepare(model, optimizer)
    scheduler = build_scheduler(optimizer, cfg, max_steps)
    strategy.accelerator.register_for_checkpointing(scheduler)
    return model, optimizer, scheduler, True
