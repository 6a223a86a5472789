"""Preference objectives on packed pair blocks (toolkit.data.preference): DPO, SimPO and ORPO (docs/preference.md).

Each pair's answers are scored by their summed log-probability under the model, read from one forward
over the packed micro-batch: the per-token log-probabilities of the targets are summed by `sequence`
(chosen 2k, rejected 2k + 1). A micro-batch gives the *sum* of its pairs' losses; the step divides by
the pairs of the whole global batch (toolkit.models.loss.backward_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.data.packing import IGNORE_INDEX
from toolkit.models.loss import NOT_INPUTS, head_at, on_targets, rows_of, static_flex_on_cpu, targets_of

OBJECTIVES = ("sft", "dpo", "simpo", "orpo")
STATS = ("chosen", "rejected", "accuracy", "pairs")  # what `PreferenceLoss.sums` adds up besides the loss
NOT_MODEL_INPUTS = (*NOT_INPUTS, "sequence", "ref_logps")


def token_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's log-probability of each position's target (fp32; 0 where there is none). With
    model.loss_positions=targets the head projects those positions alone, and the others are 0 as before."""
    targets = targets_of(batch)
    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS} | {"use_cache": False}
    rows = rows_of(batch, targets) if on_targets(model) else None
    with static_flex_on_cpu(model, targets.device), head_at(model, rows):
        logits = model(**inputs).logits
    if rows is None:
        flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="none")
        return -flat.view(targets.shape)
    picked = F.cross_entropy(logits.float(), targets.reshape(-1)[rows], reduction="none")
    return -torch.zeros(targets.numel(), dtype=picked.dtype, device=picked.device).index_add(
        0, rows, picked).view(targets.shape)


def sequence_sums(batch: dict[str, torch.Tensor], values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair sums of `values` over the targets, per-pair target counts), each (pairs x 2: chosen, rejected),
    for the pairs of the micro-batch that have targets on both sides."""
    targets = targets_of(batch) != IGNORE_INDEX
    slots = 2 * batch["sequence"].numel() + 2  # collate_pairs numbers sequences below 2 x rows x length
    index = batch["sequence"][targets]
    # in float64: a reward is the small difference of two sums of hundreds of log-probabilities
    sums = torch.zeros(slots, dtype=torch.float64, device=values.device).index_add(0, index, values[targets].double())
    counts = torch.zeros(slots, dtype=torch.float64, device=values.device).index_add(
        0, index, torch.ones_like(index, dtype=torch.float64))
    sums, counts = sums.view(-1, 2), counts.view(-1, 2)
    real = (counts > 0).all(dim=1)
    return sums[real], counts[real]


@dataclass(frozen=True)
class PreferenceLoss:
    objective: str
    beta: float
    gamma: float = 0.0
    orpo_lambda: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.objective == "dpo"

    def sums(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the micro-batch's pairs, 0-d; the sums of STATS, detached): chosen and rejected
        rewards, pairs whose chosen reward is the higher, pairs."""
        logps, counts = sequence_sums(batch, token_logps(model, batch))
        if self.objective == "dpo":
            ref, _ = sequence_sums(batch, batch["ref_logps"])
            rewards = self.beta * (logps - ref)
            losses = -F.logsigmoid(rewards[:, 0] - rewards[:, 1])
        else:
            mean = logps / counts
            rewards = self.beta * mean
            if self.objective == "simpo":
                losses = -F.logsigmoid(rewards[:, 0] - rewards[:, 1] - self.gamma)
            else:  # orpo
                # log(1 - e^p) as log(-expm1(p)): exact for p near 0, where 1 - e^p cancels; a mean of exactly 0
                # (every token certain) is kept off the pole
                mean = mean.clamp(max=-1e-12)
                log_odds = mean - torch.log(-torch.expm1(mean))
                losses = -mean[:, 0] - self.orpo_lambda * F.logsigmoid(log_odds[:, 0] - log_odds[:, 1])
        rewards = rewards.detach()
        stats = torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(), (rewards[:, 0] > rewards[:, 1]).sum().float(),
                             torch.tensor(float(len(rewards)), device=rewards.device)])
        return losses.sum().float(), stats

    @staticmethod
    def means(stats: list[float], prefix: str) -> dict[str, float]:
        """The logged means of summed STATS: `{prefix}/chosen`, `/rejected`, `/margin`, `/accuracy`."""
        chosen, rejected, correct, pairs = stats
        n = max(1.0, pairs)
        return {f"{prefix}/chosen": chosen / n, f"{prefix}/rejected": rejected / n,
                f"{prefix}/margin": (chosen - rejected) / n, f"{prefix}/accuracy": correct / n}
