"""BatchSchedule / accumulation_steps: which blocks each rank trains on, and batch-size validation."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.config.errors import UserError
from toolkit.data.batching import BatchSchedule
from toolkit.strategy.parallelism import accumulation_steps

N_BLOCKS, GLOBAL, MICRO, SEED = 103, 8, 2, 1234  # 103 % 8 != 0: a remainder is left out each epoch


def schedule(world_size: int = 1, rank: int = 0, seed: int = SEED, n_blocks: int = N_BLOCKS) -> BatchSchedule:
    return BatchSchedule(n_blocks, GLOBAL, MICRO, world_size, rank, seed)


def test_two_ranks_see_the_one_rank_global_batch():
    single = schedule()
    ranks = [schedule(world_size=2, rank=r) for r in range(2)]
    for step in range(3 * single.steps_per_epoch + 2):  # crosses epoch boundaries
        expected = single.global_indices(step)
        assert len(expected) == GLOBAL
        assert sum(len(m) for m in single.micro_batches(step)) == GLOBAL
        np.testing.assert_array_equal(np.concatenate(single.micro_batches(step)), expected)
        parts = [np.concatenate(s.micro_batches(step)) for s in ranks]
        assert all(len(m) == MICRO for s in ranks for m in s.micro_batches(step))
        assert all(len(p) == GLOBAL // 2 for p in parts)
        assert not set(parts[0]) & set(parts[1])  # no block on both ranks
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.sort(expected))
        for s in ranks:  # every rank knows the whole global batch (for the loss normaliser)
            np.testing.assert_array_equal(s.global_indices(step), expected)


def test_each_epoch_is_a_permutation():
    s = schedule()
    per_epoch = s.steps_per_epoch
    assert per_epoch == N_BLOCKS // GLOBAL
    epochs = []
    for epoch in range(3):
        seen = np.concatenate([s.global_indices(epoch * per_epoch + i) for i in range(per_epoch)])
        assert len(seen) == per_epoch * GLOBAL
        assert len(np.unique(seen)) == len(seen), "a block repeats within an epoch"
        assert seen.min() >= 0 and seen.max() < N_BLOCKS
        epochs.append(seen)
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    assert s.epoch(per_epoch) == 1.0


def test_deterministic_for_a_seed():
    a, b = schedule(), schedule()
    steps = [0, 5, 40, 3, 27, 0]  # any order, like a resume
    for step in steps:
        np.testing.assert_array_equal(a.global_indices(step), b.global_indices(step))
    # a fresh schedule jumping straight to a step (resume) agrees with one that walked there
    walked = schedule()
    for step in range(30):
        walked.global_indices(step)
    np.testing.assert_array_equal(walked.global_indices(30), schedule().global_indices(30))
    other = schedule(seed=SEED + 1)
    assert not np.array_equal(
        np.concatenate([a.global_indices(i) for i in range(4)]),
        np.concatenate([other.global_indices(i) for i in range(4)]),
    )


@pytest.mark.parametrize(
    "global_batch, micro, world",
    [(10, 4, 1), (12, 4, 2), (6, 4, 1)],
)
def test_accumulation_steps_refuses_sizes_that_do_not_divide(global_batch, micro, world):
    with pytest.raises(UserError) as info:
        accumulation_steps(global_batch, micro, world)
    message = str(info.value)
    assert f"global_batch_size={global_batch}" in message
    assert f"micro_batch_size={micro}" in message
    assert f"{world} process" in message


@pytest.mark.parametrize(
    "global_batch, micro, world, accum", [(16, 4, 1, 4), (16, 4, 2, 2), (8, 8, 1, 1), (24, 2, 3, 4)]
)
def test_accumulation_steps(global_batch, micro, world, accum):
    assert (
        accumulation_steps(global_batch, micro, world) == accum
    )


def test_too_few_blocks():
    with pytest.raises(UserError, match="global_batch_size=8"):
        schedule(n_blocks=GLOBAL - 1)
    assert schedule(n_blocks=GLOBAL).steps_per_epoch == 1
