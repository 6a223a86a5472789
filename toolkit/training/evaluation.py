"""Held-out loss and perplexity, identical whatever the number of processes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import datasets
import torch
from accelerate import Accelerator

from toolkit.config.declarations import ALWAYS, FROM_NEXT_STEP, free
from toolkit.config.load import field
from toolkit.config.values import path_problems
from toolkit.data.packing import IGNORE_INDEX, collate
from toolkit.models.loss import forward_loss_sum, targets_of
from toolkit.models.preference_loss import STATS, PreferenceLoss
from toolkit.run.paths import READ
from toolkit.training.harness import HarnessConfig
from toolkit.training.step import on_device

HARNESS = free("what is scored, in a process of its own (toolkit.training.harness_runs)")


def _nothing_scored(cfg) -> str | None:
    return None if cfg.eval.harness_tasks else "eval.harness_tasks is empty: nothing is scored"


def _no_held_out_data(cfg) -> str | None:
    # said in the key's name: the data line's "0 held-out documents" is no word on what was asked
    if cfg.data.val_fraction > 0 or getattr(cfg.data, "val_path", None):
        return None
    return ("data.val_fraction=0 holds out no documents, and no data.val_path gives any: there is nothing to evaluate; "
            "set data.val_fraction above 0 (e.g. 0.05) for a held-out loss")


def _nothing_evaluated(cfg) -> str | None:
    return None if cfg.eval.every == 0 else _no_held_out_data(cfg)  # 0: only at the end, nothing asked of the steps


def _no_blocks_to_take(cfg) -> str | None:
    return None if cfg.eval.blocks == 0 else _no_held_out_data(cfg)  # 0: every block there is, none or some


@dataclass
class EvalConfig:
    every: int = field(50, help="held-out loss and perplexity every N optimizer steps (0 = only at the end)",
                       resume=free("when the held-out loss is measured"), used_when=_nothing_evaluated,
                       accepts={"0": "only at the end", "2**31": "only at the end"})
    blocks: int = field(64, help="held-out blocks per evaluation (of each source of a mixture), the same on any "
                        "number of processes (0 = all)", resume=FROM_NEXT_STEP,
                        used_when=_no_blocks_to_take,
                        accepts={"0": "every held-out block", "2**31": "every held-out block"})
    harness_tasks: list[str] = field(
        default_factory=list, help="lm-evaluation-harness tasks: a fine-tune scores its base and its result, "
        "pretraining every eval.every steps in a process beside training (pip install -e '.[eval]'; docs/evaluation.md)",
        resume=HARNESS, used_when=ALWAYS, path=None, unique=True, accepts={"[]": "nothing scored: the default"})
    harness_include_path: str | None = field(
        None, help="a folder of your own harness task YAML files", resume=HARNESS, used_when=_nothing_scored,
        path=READ, accepts={"unset": "the harness's own tasks only: the default"})
    harness_num_fewshot: int | None = field(
        None, help="examples in each harness prompt (empty: each task's own)", resume=HARNESS,
        used_when=_nothing_scored, accepts={
            "unset": "each task's own number of shots", "0": "no shots", "2**31": "more than a task has is refused at "
            "the start, once its examples are read (harness.check_tasks)"})
    harness_limit: float | None = field(
        None, help="documents per harness task, below 1 a fraction (empty: all)", resume=HARNESS,
        used_when=_nothing_scored, accepts={"unset": "every document"})

    def validate(self) -> list[str]:
        problems = [f"{name}={getattr(self, name)} must be >= 0" for name in ("every", "blocks") if getattr(self, name) < 0]
        if self.harness_tasks:  # the config's loader names the section
            unusable = path_problems(self, ("harness_include_path",))
            problems += unusable or [line.removeprefix("eval.") for line in HarnessConfig.of_training(self).validate()]
        return problems


class WholeModel:
    """The held-out loss of a model that runs whole on this rank: each micro-batch as it comes, of any rows."""

    fixed_rows = False

    def __init__(self, model, loss_chunk_tokens: int):
        self.model, self.loss_chunk_tokens = model, loss_chunk_tokens

    def add(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(its token loss sum, its targets)."""
        loss = forward_loss_sum(self.model, batch, self.loss_chunk_tokens).double()
        return loss, (targets_of(batch) != IGNORE_INDEX).sum()

    def flush(self) -> float:
        return 0.0


def evaluate(accelerator: Accelerator, model, blocks: datasets.Dataset | dict[str, datasets.Dataset], *args,
             **kwargs) -> dict[str, float]:
    """eval_loss and eval_ppl over the held-out `blocks` (held_out_sums' arguments); for a mixture's held-out
    blocks by source, also each source's eval_loss/<name> and eval_tokens/<name> (its held-out targets): the
    whole is the mean of the former weighted by the latter.
    With a preference `objective`: eval_loss, the mean over the held-out pairs (a mixture's also by source, with
    eval_pairs/<name>), and eval_rewards/* over all of them."""
    if kwargs.get("objective") is not None:
        sums = {name: held_out_sums(accelerator, model, b, *args, **kwargs)
                for name, b in (blocks.items() if isinstance(blocks, dict) else [("", blocks)])}
        loss_sum, pairs, *stats = (sum(column) for column in zip(*sums.values(), strict=True))
        by_source = {k: v for name, (s, n, *_) in sums.items() if name
                     for k, v in ((f"eval_loss/{name}", s / max(1.0, n)), (f"eval_pairs/{name}", int(n)))}
        return {"eval_loss": loss_sum / max(1.0, pairs), **PreferenceLoss.means(stats, "eval_rewards"), **by_source}
    if not isinstance(blocks, dict):
        return _loss_and_ppl(*held_out_sums(accelerator, model, blocks, *args, **kwargs))
    sums = {name: held_out_sums(accelerator, model, b, *args, **kwargs) for name, b in blocks.items()}
    result = _loss_and_ppl(sum(s for s, _ in sums.values()), sum(t for _, t in sums.values()))
    return {**result, **{f"eval_loss/{name}": s / max(1.0, t) for name, (s, t) in sums.items()},
            **{f"eval_tokens/{name}": int(t) for name, (_, t) in sums.items()}}


def forwards(blocks: datasets.Dataset | dict[str, datasets.Dataset], micro_batch: int, max_blocks: int,
             world: int) -> int:
    """The micro-batches held_out_sums runs on each of `world` data ranks over `blocks` (a mixture's: over each
    source's): a pass's bar counts them."""
    if isinstance(blocks, dict):
        return sum(forwards(b, micro_batch, max_blocks, world) for b in blocks.values())
    n = len(blocks) if max_blocks == 0 else min(max_blocks, len(blocks))
    return math.ceil(math.ceil(n / world) / micro_batch)


def said(result: dict[str, float]) -> str:
    """An evaluation's result as its log line says it: "held-out loss 2.1234 (a 2.0000, b 2.3000), perplexity 8.37"."""
    sources = ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in result.items() if k.startswith("eval_loss/"))
    return (f"held-out loss {result['eval_loss']:.4f}" + (f" ({sources})" if sources else "")
            + (f", perplexity {result['eval_ppl']:.2f}" if "eval_ppl" in result else
               f", reward margin {result['eval_rewards/margin']:.4f}, accuracy {result['eval_rewards/accuracy']:.2f}"))


def _loss_and_ppl(loss_sum: float, targets: float) -> dict[str, float]:
    loss = loss_sum / max(1.0, targets)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def held_out_sums(
    accelerator: Accelerator,
    model,
    blocks: datasets.Dataset,
    micro_batch: int,
    max_blocks: int,
    attn: str,
    collate_fn: Callable[[dict, str], dict[str, torch.Tensor]] = collate,
    loss_chunk_tokens: int = 0,
    data_ranks: tuple[int, int] | None = None,
    split: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    pipeline=None,
    objective: PreferenceLoss | None = None,
    bar=None,
) -> tuple[float, ...]:
    """(token loss sum, targets) over the first `max_blocks` held-out blocks, split across ranks; with a
    preference `objective`, (pair loss sum, pairs, the sums of its STATS).

    `collate_fn` turns block columns into model inputs with `labels` (packed text by default;
    `toolkit.data.chat.collate_chat` for chat blocks, whose labels keep only assistant tokens).
    `loss_chunk_tokens` > 0 computes the loss without the full logits (model.loss=chunked).
    `data_ranks` (ranks that read different blocks, this rank's index among them; default every
    process) and `split` (a collated batch -> this rank's share of its sequences) are context
    parallel's (toolkit.strategy.context_parallel): the ranks of a group read the same blocks.
    `pipeline` (toolkit.strategy.pipeline.stages): the micro-batches go through its stages, each of
    `micro_batch` rows and as many per run as it was built for (the schedule's shapes are fixed), the
    rows and runs that fill them with no targets. `bar` (toolkit.training.phases) is updated after each micro-batch.

    Every rank runs the same number of forwards (sharded models gather weights inside
    forward, so an uneven count would hang); a rank short of blocks repeats one and
    zeroes its weight.
    """
    n = len(blocks) if max_blocks == 0 else min(max_blocks, len(blocks))
    world, rank = data_ranks or (accelerator.num_processes, accelerator.process_index)
    per_rank = math.ceil(n / world)
    mine = list(range(rank, n, world))
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    targets = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    stats = torch.zeros(len(STATS) if objective is not None else 0, dtype=torch.float64, device=accelerator.device)
    losses = pipeline.held_out() if pipeline is not None else WholeModel(model, loss_chunk_tokens)
    for start in range(0, per_rank, micro_batch):
        idx = mine[start : start + micro_batch]
        real = len(idx)
        rows = micro_batch if losses.fixed_rows else min(micro_batch, per_rank - start)
        idx = idx + [0] * (rows - real)
        if not idx:
            continue
        batch = collate_fn(blocks[idx], attn)
        if real < len(idx):  # varlen attention has joined the rows into one: mask by the blocks' rows
            batch["labels"].view(len(idx), -1)[real:] = IGNORE_INDEX
        if split is not None:
            batch = split(batch)
        batch = on_device(batch, accelerator.device)
        if objective is not None:
            pair_loss, micro_stats = objective.sums(model, batch)
            loss_sum += pair_loss.double()
            stats += micro_stats.double()
        else:
            loss, counted = losses.add(batch)
            loss_sum += loss
            targets += counted
        if bar is not None:
            bar.update()
    loss_sum += losses.flush()
    model.train()
    if objective is not None:  # (loss, pairs, *STATS): the pairs are STATS' last
        return tuple(accelerator.reduce(torch.cat([loss_sum[None], stats[-1:], stats]), reduction="sum").tolist())
    total = accelerator.reduce(torch.stack([loss_sum, targets]), reduction="sum")
    return total[0].item(), total[1].item()
