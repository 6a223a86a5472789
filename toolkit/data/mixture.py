"""Several corpora mixed by weight (data.sources), in stages (data.stages): which blocks of which source
every global batch holds.

Every step's global batch takes from each source its weight's share of the blocks, rounded down or up (Shares), so
that each source is within one block of its weight at every step and of its share over the run. Each source is read
in its own shuffled order, a fresh one per pass over it (a source smaller than its share is repeated), and the blocks
of a step are shuffled together before the ranks take their parts. All of it is a function of (seed, step, the
weights of the steps before): a resume needs no data position, and a 2-process run sees a 1-process run's batches.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
import torch

from toolkit.config.declarations import ALWAYS, CheckedBy, Need
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.run.paths import READ

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source's name is part of metric keys (eval_loss/<name>, tokens/<name>)


# a source's keys read only by one kind of data (a recipe without data.format reads text)
TEXT_SOURCE = Need("data.format", ("text",), "text sources'")
CHAT_SOURCE = CheckedBy("DataConfig.source_problems")  # refused on a source that reads text or pairs


@dataclass
class SourceConfig:
    """One corpus of a mixture; each key says when it has an effect (used_when=, walked with data.format by
    tests/toolkit/training/test_unused.py): a text source's keys are said where the source reads records, a chat
    source's refused where it reads text (source_problems)."""

    name: str = field(help="what the logs and metrics call it: eval_loss/<name>, tokens/<name>", path=None,
                      used_when=ALWAYS)
    path: str | None = field(
        None, help="text/jsonl/parquet file, folder, glob or hub dataset id; empty = embedded Python docs", path=READ,
        used_when=ALWAYS,
    )
    weight: float = field(1.0, help="its share of every global batch's blocks (the weights are normalised)",
                          used_when=ALWAYS)
    text_column: str = field("text", help="column holding the text in jsonl/parquet/hub data", path=None,
                             used_when=TEXT_SOURCE)
    sample_by: Literal["document", "paragraph", "line"] = field(
        "paragraph", help="how plain-text files split into documents", used_when=TEXT_SOURCE
    )
    subset: str | None = field(None, help="hub dataset config name (data.name of a single source)", path=None,
                               used_when=ALWAYS)
    split: str = field("train", help="split to read from a hub dataset", path=None, used_when=ALWAYS)
    record_format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"] | None = field(
        None, help="chat: this source's record shape (docs/data.md); empty = data.record_format", used_when=CHAT_SOURCE)
    columns: dict = field(default_factory=dict, help="chat: this source's records of another shape, mapped as "
                          "data.columns maps them ({conversation, role, content, user, assistant, system}); empty = "
                          "data.columns", used_when=CHAT_SOURCE)


@dataclass
class StageConfig:
    start_step: int = field(help="the first step these weights are in force", used_when=ALWAYS)
    weights: dict = field(default_factory=dict, help="{source name: weight}; a source not named keeps its weight",
                          used_when=ALWAYS)


def mixture_problems(sources: list[SourceConfig], stages: list[StageConfig]) -> list[str]:
    """What is wrong with data.sources and data.stages, one line each (keys relative to data.)."""
    if any(s is None for s in [*sources, *stages]):
        return []  # an entry the loader could not build, and said why
    problems = []
    names = [s.name for s in sources]
    for i, source in enumerate(sources):
        if not NAME.fullmatch(str(source.name)):
            problems.append(f"sources[{i}].name={source.name!r} must be letters, digits, '_', '.' or '-' "
                            "(it names the source's metrics)")
        if source.weight < 0:
            problems.append(f"sources[{i}].weight={source.weight} ({source.name}) must be at least 0")
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"sources: {names.count(name)} sources are named {name}; give each its own name")
    if sources and sum(max(0.0, s.weight) for s in sources) == 0:
        problems.append("sources: the weights sum to 0; give at least one source a positive weight")
    if stages and not sources:
        problems.append("stages change the weights of data.sources, and there are none; list the sources in "
                        "data.sources")
        return problems
    weights = {s.name: max(0.0, s.weight) for s in sources}
    for i, stage in enumerate(stages):
        if stage.start_step < 1:
            problems.append(f"stages[{i}].start_step={stage.start_step} must be at least 1 (steps count from 1, as the "
                            "logs do)")
        if i and stage.start_step <= stages[i - 1].start_step:
            problems.append(f"stages[{i}].start_step={stage.start_step} is not after the stage before it "
                            f"(start_step={stages[i - 1].start_step}); list the stages in the order they start")
        for name, weight in stage.weights.items():
            if name not in weights:
                problems.append(f"stages[{i}].weights names {name}, which is not a source (the sources: "
                                f"{', '.join(names)})")
            elif not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight >= 0:
                problems.append(f"stages[{i}].weights.{name}={weight!r} must be a number, at least 0")
            else:
                weights[name] = float(weight)
        if weights and sum(weights.values()) == 0:
            problems.append(f"stages[{i}]: the weights from step {stage.start_step} on sum to 0; give at least one "
                            "source a positive weight")
    return problems


def weight_plan(sources: list[SourceConfig], stages: list[StageConfig]) -> list[tuple[int, list[float]]]:
    """[(first global batch, each source's normalised weight)], from batch 0 on: the sources' weights, then each
    stage's. A stage's start_step is the step as the logs count it (1 = the first), whose batch is number
    start_step - 1."""
    weights = [max(0.0, s.weight) for s in sources]
    plan = [(0, weights)]
    for stage in stages:
        weights = [float(stage.weights.get(s.name, w)) for s, w in zip(sources, weights, strict=True)]
        start = stage.start_step - 1
        plan = [(first, ws) for first, ws in plan if first < start] + [(start, weights)]
    return [(start, [w / sum(ws) for w in ws]) for start, ws in plan]


def stages_said(names: list[str], plan: list, max_steps: int | None = None) -> list[str]:
    """"from step N: weights a 0.700, b 0.300", one line for each (first batch, weights) of `plan`; a stage that
    starts after `max_steps` says so (a mistyped step, or one meant for a resume that trains longer)."""
    return [f"from step {start + 1}: weights " + ", ".join(f"{n} {w:.3f}" for n, w in zip(names, weights, strict=True))
            + (f" (after train.max_steps={max_steps}: not reached unless a resume raises it)"
               if max_steps is not None and start >= max_steps else "")
            for start, weights in plan]


@contextlib.contextmanager
def naming(index: int, sources: list[SourceConfig]):
    """A corpus error of data.sources[index] names its keys there (the corpus readers name a single source's)."""
    try:
        yield
    except UserError as exc:
        if not sources:
            raise
        text = str(exc).replace("data.name", f"data.sources[{index}].subset")
        for key in ("path", "text_column", "sample_by", "split"):
            text = text.replace(f"data.{key}", f"data.sources[{index}].{key}")
        raise UserError(text if text != str(exc) else f"data source {sources[index].name}: {text}") from None


def trained_part(plan: list, steps: int) -> list:
    """The weights of the first `steps` global batches, as [first batch, weights] pairs (a checkpoint records its
    plan as lists): what a resume after `steps` steps must keep."""
    kept = [[start, list(weights)] for start, weights in plan if start < steps]
    return [pair for i, pair in enumerate(kept) if i == 0 or pair[1] != kept[i - 1][1]]


def step_order(seed: int, step: int, n: int) -> np.ndarray:
    """The order the `n` blocks of global batch `step` are shuffled into, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7 * step + 1)
    return torch.randperm(n, generator=gen).numpy()


class Shares:
    """How many blocks of each source every global batch holds, by the weights in force at its step.

    A step gives each source the floor or the ceiling of its weight's share (within one block of it), and
    the ceilings go to the sources furthest behind their share so far: over any number of steps each source
    stays within a block or two of its share, where rounding every step alike would starve a small weight
    for the whole run (0.1 of 16 blocks: 1 a step, 6.25 %). Exact fractions, so that every rank computes the
    same; a function of the step, walked from step 0 (a resume replays the arithmetic, not the data)."""

    def __init__(self, plan: list[tuple[int, list[float]]], global_batch: int):
        self.global_batch = global_batch
        shares = []
        for start, weights in plan:
            exact = [Fraction(w) for w in weights]
            shares.append((start, [w * global_batch / sum(exact) for w in exact]))
        # the fractions of a block in units of 1/scale, as integers: the walk is integer arithmetic
        scale = math.lcm(*(x.denominator for _, share in shares for x in share))
        self.plan = [(start, [math.floor(x) for x in share], [int((x - math.floor(x)) * scale) for x in share])
                     for start, share in shares]
        self._unit = scale
        self._at, self._drawn, self._behind = 0, [0] * len(plan[0][1]), [0] * len(plan[0][1])

    def counts(self, step: int) -> np.ndarray:
        """Each source's blocks in global batch `step`."""
        self._walk(step)
        return np.asarray(self._step_counts(step)[0], dtype=np.int64)

    def drawn_before(self, step: int) -> np.ndarray:
        """Each source's blocks taken by the steps before `step`."""
        self._walk(step)
        return np.asarray(self._drawn, dtype=np.int64)

    def _step_counts(self, step: int) -> tuple[list[int], list[int], list[int]]:
        """(counts, floors, fractions in 1/unit) of global batch `step`, given how far behind each source is."""
        base, fraction = next((b, f) for start, b, f in reversed(self.plan) if start <= step)
        extra = self.global_batch - sum(base)  # the ceilings this step hands out
        ahead = sorted((i for i in range(len(base)) if fraction[i]), key=lambda i: (-(self._behind[i] + fraction[i]), i))
        up = set(ahead[:extra])
        return [b + (i in up) for i, b in enumerate(base)], base, fraction

    def _walk(self, step: int) -> None:
        if step < self._at:  # asked about an earlier step: walk again from the start
            self._at, self._drawn, self._behind = 0, [0] * len(self._drawn), [0] * len(self._drawn)
        while self._at < step:
            counts, base, fraction = self._step_counts(self._at)
            # behind by the fraction owed this step, ahead by a ceiling taken (one block: `unit`)
            self._behind = [d + f - (c - b) * self._unit for d, f, c, b in zip(self._behind, fraction, counts, base,
                                                                                strict=True)]
            self._drawn = [d + c for d, c in zip(self._drawn, counts, strict=True)]
            self._at += 1


class MixtureSchedule:
    """BatchSchedule's contract (global_indices, micro_batches, epoch) over the blocks of several sources laid
    end to end: `sizes` holds each source's block count, in the order of the concatenated dataset."""

    def __init__(self, sizes: list[int], plan: list[tuple[int, list[float]]], names: list[str], global_batch: int,
                 micro_batch: int, world_size: int, rank: int, seed: int):
        for size, name, used in zip(sizes, names, np.any([w for _, w in plan], axis=0), strict=True):
            if size == 0 and used:
                raise UserError(f"data source {name} packs to no block; add data to it, lower data.seq_len or give "
                                "it weight 0")
        self.sizes, self.names = np.asarray(sizes, dtype=np.int64), names
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.plan, self.shares = plan, Shares(plan, global_batch)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.steps_per_epoch = max(1, int(self.sizes.sum()) // global_batch)  # of all the blocks, for the log
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._last: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def reweigh(self, plan: list[tuple[int, list[float]]]) -> None:
        """Other weights from some step on (a forgetting budget's replay, toolkit.training.forgetting): `plan` keeps
        the batches already drawn as they were, so only the steps after its change draw otherwise. `self.plan` stays
        the configured one, what a checkpoint records and a resume checks."""
        self.shares = Shares(plan, self.global_batch)
        self._last = (-1, np.empty(0, dtype=np.int64))

    def counts(self, step: int) -> np.ndarray:
        """Each source's blocks in global batch `step`."""
        return self.shares.counts(step)

    def drawn_before(self, step: int) -> np.ndarray:
        """Each source's blocks taken by the steps before `step`."""
        return self.shares.drawn_before(step)

    def _order(self, source: int, epoch: int) -> np.ndarray:
        """Source `source`'s blocks in the order of its pass number `epoch` (reproducible from the seed)."""
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.sizes):
                self._orders.clear()
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_009 + source)
            self._orders[key] = torch.randperm(int(self.sizes[source]), generator=gen).numpy()
        return self._orders[key]

    def global_indices(self, step: int) -> np.ndarray:
        if self._last[0] == step:  # the loop asks twice a step: for the blocks, and for each source's tokens
            return self._last[1]
        taken = []
        for source, (first, count) in enumerate(zip(self.drawn_before(step), self.counts(step), strict=True)):
            size = int(self.sizes[source])
            for k in range(int(first), int(first + count)):
                epoch, position = divmod(k, size)
                taken.append(self.offsets[source] + self._order(source, epoch)[position])
        self._last = (step, np.asarray(taken, dtype=np.int64)[step_order(self.seed, step, len(taken))])
        return self._last[1]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's share of the global batch, cut into micro-batches."""
        per_rank = self.global_batch // self.world_size
        mine = self.global_indices(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch)]

    def epoch(self, step: int) -> float:
        """Passes over all the blocks so far."""
        return float(self.drawn_before(step).sum()) / max(1, int(self.sizes.sum()))

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each block index."""
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def passes(self, steps: int) -> np.ndarray:
        """Each source's passes over its blocks in `steps` steps (above 1: repeated)."""
        return self.drawn_before(steps) / np.maximum(1, self.sizes)
