"""The data a step takes (toolkit.training.feed): a global batch's blocks, its target and token counts, and a
mixture's tokens by source, from real packed blocks."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from toolkit.data.batching import BatchSchedule
from toolkit.data.mixture import MixtureSchedule, SourceConfig, weight_plan
from toolkit.data.packing import collate, column, packed_dataset, target_counts
from toolkit.training.feed import Feed


@pytest.fixture(scope="module")
def packed(tiny_texts, tiny_tokenizer, tmp_path_factory) -> tuple[datasets.Dataset, datasets.Dataset]:
    cache = tmp_path_factory.mktemp("packed")
    prose = packed_dataset(datasets.Dataset.from_dict({"text": tiny_texts}), tiny_tokenizer, 16, cache,
                           source_fingerprint="feed-prose")
    short = packed_dataset(datasets.Dataset.from_dict({"text": ["x = 1", "y = [2, 3]"] * 6}), tiny_tokenizer, 16,
                           cache, source_fingerprint="feed-short")
    return prose, short


def test_a_step_gives_each_rank_its_blocks_and_the_global_batchs_counts(packed):
    blocks = packed[0]
    ranks = [Feed(collate, None, 4, 1, blocks, target_counts, BatchSchedule(len(blocks), 4, 1, 2, r, 0)) for r in (0, 1)]
    global_idx = ranks[0].schedule.global_indices(1)
    for rank, feed in enumerate(ranks):
        micro, targets, tokens = feed.step_data(1, 2, 1, reduce=None)
        assert [m["input_ids"].tolist() for m in micro] == [[column(blocks, "input_ids")[i].tolist()]
                                                          for i in global_idx[2 * rank : 2 * rank + 2]]
        assert targets == int(target_counts(blocks)[global_idx].sum())
        assert tokens == int(column(blocks, "num_tokens")[global_idx].sum())
    assert feed.sources == [] and feed.source_tokens(1) == {} and feed.val is None


def test_a_mixtures_tokens_are_counted_by_source(packed):
    prose, short = packed
    plan = weight_plan([SourceConfig("prose", weight=0.75), SourceConfig("short", weight=0.25)], [])
    schedule = MixtureSchedule([len(prose), len(short)], plan, ["prose", "short"], 4, 2, 1, 0, 0)
    both = datasets.concatenate_datasets([prose, short])
    feed = Feed(collate, {"prose": prose}, 4, 2, both, target_counts, schedule)
    by_source = feed.source_tokens(3)
    global_idx = schedule.global_indices(3)
    tokens = column(both, "num_tokens")
    assert by_source == {"prose": int(tokens[global_idx[global_idx < len(prose)]].sum()),
                         "short": int(tokens[global_idx[global_idx >= len(prose)]].sum())}
    assert sum(by_source.values()) == feed.step_data(3, 1, 1, reduce=None)[2] and np.all(tokens > 0)
    assert feed.sources == ["prose", "short"] and feed.val == {"prose": prose}
