"""What one training step leaves for what runs after it: the step's numbers, and which cadence is due at it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.training.metrics import HostCopy


@dataclass(frozen=True)
class Due:
    """What runs after step `step`, decided once: each cadence of the recipe config's."""

    last: bool  # the run's last step
    log: bool  # a train row of metrics.jsonl (logging.every)
    eval: bool  # the held-out loss (eval.every, and the last step)
    save: bool  # a checkpoint (checkpoint.every)
    harness: bool  # the model scored by the harness beside training (eval.every with eval.harness_tasks)

    @classmethod
    def at(cls, step: int, cfg: Any, held_out: bool, harness_steps: bool) -> Due:
        last = step == cfg.train.max_steps
        on_eval = bool(cfg.eval.every) and step % cfg.eval.every == 0
        return cls(last=last, log=step % cfg.logging.every == 0 or last, eval=held_out and (last or on_eval),
                   save=bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0,
                   harness=harness_steps and on_eval and not last)


@dataclass
class Stepped:
    """One optimizer step, done: what the cadences after it read."""

    step: int  # 1-based: the step just trained
    lr: float  # the rate it trained with
    tokens: int  # the global batch's tokens
    grad_norm: Any
    nonfinite: str | torch.Tensor | None  # what was not finite; the flags themselves while still on the device
    totals: HostCopy  # the step's one all-reduce
    values: list[float] | None  # its values on the host, where something due needed them
    loss: float | None  # the global mean loss, where the values were read
    due: Due

    @property
    def on_device(self) -> torch.Tensor | None:
        """The non-finite flags not read yet (train.step_sync=none)."""
        return self.nonfinite if isinstance(self.nonfinite, torch.Tensor) else None


@dataclass
class Window:
    """The tokens and seconds since the last logged step: the tokens/s it logs."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def reset(self) -> None:
        self.tokens, self.seconds = 0, 0.0
