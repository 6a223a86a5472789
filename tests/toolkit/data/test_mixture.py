"""Several corpora mixed by weight (toolkit.data.mixture): each step's share of every source, its order,
what a stage changes, what a resume sees, and the one-line refusals of a mixture that cannot be."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.config.errors import UserError
from toolkit.config.load import load_config
from toolkit.data.corpus import DataConfig
from toolkit.data.mixture import (
    MixtureSchedule,
    Shares,
    SourceConfig,
    StageConfig,
    stages_said,
    trained_part,
    weight_plan,
)

SIZES = [300, 90, 25]  # a large source, one about its share, one far smaller than its share (repeated)
SOURCES = [SourceConfig("web", weight=0.7), SourceConfig("code", weight=0.2), SourceConfig("docs", weight=0.1)]


def schedule(world: int = 1, rank: int = 0, stages=(), global_batch: int = 16, micro_batch: int = 2, seed: int = 3):
    return MixtureSchedule(SIZES, weight_plan(SOURCES, list(stages)), [s.name for s in SOURCES], global_batch,
                           micro_batch, world, rank, seed)


def per_source(mixture: MixtureSchedule, indices: np.ndarray) -> np.ndarray:
    return np.bincount(mixture.source_of(indices), minlength=len(SIZES))


@pytest.mark.parametrize("world", [1, 2])
def test_every_step_holds_each_source_within_one_block_of_its_weight(world):
    """50 steps of a 0.7/0.2/0.1 mixture: each step's blocks by source, on 1 and 2 ranks; the ranks' parts are the
    global batch of one process."""
    one, ranks = schedule(), [schedule(world, r) for r in range(world)]
    for step in range(50):
        counts = per_source(one, one.global_indices(step))
        assert counts.sum() == 16 and np.all(np.abs(counts - np.array([0.7, 0.2, 0.1]) * 16) < 1), (step, counts)
        taken = np.concatenate([np.concatenate(r.micro_batches(step)) for r in ranks])
        assert np.array_equal(taken, one.global_indices(step))


def test_each_source_is_read_in_a_fresh_order_each_pass_and_a_small_one_is_repeated():
    mixture = schedule()
    drawn = [[] for _ in SIZES]
    for step in range(50):
        indices = mixture.global_indices(step)
        for source, index in zip(mixture.source_of(indices), indices, strict=True):
            drawn[source].append(index - mixture.offsets[source])
    docs = drawn[2]  # 1.6 blocks a step of a 25-block source: 80 blocks, 3.2 passes
    assert len(docs) == 80 and mixture.passes(50)[2] == 3.2
    assert set(np.bincount(docs).tolist()) == {3, 4}  # each block once a pass
    first, second = docs[:20], docs[30:46]  # inside the first and the second pass (a step shuffles 1-2 of them)
    assert len(set(first)) == 20 and len(set(second)) == 16 and set(first) != set(second[:20])
    web = drawn[0][:270]  # 11.2 blocks a step of 300: 25 steps read 280 of them, none twice
    assert len(set(web)) == len(web) == 270 and mixture.passes(25)[0] < 1


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_after_any_step_trains_the_remaining_batches_of_the_uninterrupted_run(world):
    """The order is a function of (seed, step): a schedule made at a resume, after each step in turn, gives each
    rank the rest of the batches it would have had; another seed gives another order."""
    stages = [StageConfig(12, {"code": 0.6})]
    for rank in range(world):
        walked = schedule(world, rank, stages)
        uninterrupted = [walked.micro_batches(step) for step in range(20)]
        for resumed_at in range(20):
            resumed = schedule(world, rank, stages)
            rest = [resumed.micro_batches(step) for step in range(resumed_at, 20)]
            assert all(np.array_equal(a, b) for got, want in zip(rest, uninterrupted[resumed_at:], strict=True)
                       for a, b in zip(got, want, strict=True)), (rank, resumed_at)
    assert not np.array_equal(schedule(seed=4).global_indices(19), schedule().global_indices(19))


def test_a_stage_changes_the_weights_from_its_step_on():
    annealing = [StageConfig(40, {"code": 0.5, "web": 0})]  # docs keeps its 0.1; step 40 is batch 39
    staged, plain = schedule(stages=annealing), schedule()
    for batch in range(39):
        assert np.array_equal(staged.global_indices(batch), plain.global_indices(batch))
    share = np.array([0, 0.5, 0.1]) / 0.6 * 16  # web off, code and docs as 0.5 : 0.1
    for batch in range(39, 60):
        counts = per_source(staged, staged.global_indices(batch))
        assert counts[0] == 0 and np.all(np.abs(counts - share) < 1), (batch, counts)
    assert np.all(np.abs(staged.drawn_before(60) - plain.drawn_before(39) - 21 * share) < 2)


def test_the_stages_are_said_as_the_weights_they_give_and_one_past_the_run_says_so():
    """A stage's weights are said normalised with the weights it keeps (code 0.5 beside web 0.7 and docs 0.1 is
    0.385); one that starts after train.max_steps (a mistyped step) says that it is not reached."""
    plan = weight_plan(SOURCES, [StageConfig(40, {"code": 0.5}), StageConfig(90, {"web": 0})])
    assert stages_said(["web", "code", "docs"], plan[1:], 60) == [
        "from step 40: weights web 0.538, code 0.385, docs 0.077",
        "from step 90: weights web 0.000, code 0.833, docs 0.167 (after train.max_steps=60: not reached unless a "
        "resume raises it)"]


def test_a_stage_edited_for_steps_not_trained_leaves_the_trained_steps_as_they_were():
    before = schedule(stages=[StageConfig(40, {"code": 0.5})])
    after = schedule(stages=[StageConfig(60, {"docs": 0.6}), StageConfig(80, {"web": 0.0})])
    for batch in range(39):  # steps 1-39
        assert np.array_equal(before.global_indices(batch), after.global_indices(batch))
    plan = weight_plan(SOURCES, [StageConfig(40, {"code": 0.5})])
    assert trained_part(plan, 39) == trained_part(weight_plan(SOURCES, []), 39) != trained_part(plan, 40)


@pytest.mark.parametrize(("weights", "global_batch"), [([0.6, 0.3, 0.1], 16), ([0.95, 0.05], 8), ([1 / 3] * 3, 16),
                                                   ([0.5, 0.0, 0.5], 3)])
def test_each_step_is_within_a_block_of_the_weights_and_the_run_keeps_them(weights, global_batch):
    """A step rounds each share down or up; the ups go to the sources furthest behind, so that no source is
    starved of its share over the run (rounding each step alike gave 0.1 of 16 blocks 1 a step, 6.25 %, and
    0.05 of 8 none at all)."""
    sources = [SourceConfig(f"s{i}", weight=w) for i, w in enumerate(weights)]
    shares = Shares(weight_plan(sources, []), global_batch)
    exact = np.array(weights) / sum(weights) * global_batch
    for step in range(200):
        counts = shares.counts(step)
        assert counts.sum() == global_batch and np.all(np.abs(counts - exact) < 1), (step, counts)
        assert np.all(np.abs(shares.drawn_before(step + 1) - exact * (step + 1)) < 1), step
    assert np.all(shares.drawn_before(200)[np.array(weights) == 0] == 0)
    assert Shares(weight_plan(sources, []), global_batch).drawn_before(150).tolist() == shares.drawn_before(150).tolist()


def test_a_source_with_a_weight_and_no_block_is_refused():
    with pytest.raises(UserError, match="data source docs packs to no block; add data to it, lower data.seq_len or "
                                        "give it weight 0"):
        MixtureSchedule([10, 10, 0], weight_plan(SOURCES, []), ["web", "code", "docs"], 4, 2, 1, 0, 0)
    off = [SourceConfig("web"), SourceConfig("docs", weight=0.0)]
    MixtureSchedule([10, 0], weight_plan(off, []), ["web", "docs"], 4, 2, 1, 0, 0)  # weight 0: never read


def data_section(tmp_path, sources: list, stages: list | None = None, **keys) -> DataConfig:
    import yaml

    from toolkit.training.recipe_config import PretrainConfig

    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump({"data": {"sources": sources, "stages": stages or [], **keys}}))
    return load_config(PretrainConfig, config).data


def test_a_source_without_a_name_or_with_a_misspelled_key_is_refused_by_the_loader(tmp_path):
    """The refusals of a mixture itself, one line each, are the recipe's (tests/recipes/test_pretrain_errors.py)."""
    from toolkit.config.errors import ConfigError

    for sources, says in (([{"path": "data/web"}], "missing required key data.sources[0].name"),
                          ([{"name": "web", "wieght": 2}], "unknown key data.sources[0].wieght; did you mean "
                                                           "data.sources[0].weight?")):
        with pytest.raises(ConfigError) as raised:
            data_section(tmp_path, sources)
        assert says in str(raised.value)


def test_each_source_is_a_data_section_of_its_own(tmp_path):
    data = data_section(tmp_path, [{"name": "web", "weight": 0.7}, {"name": "wiki", "path": "wikitext", "weight": 0.3,
                                                                    "subset": "wikitext-2-raw-v1", "split": "test"}],
                        [{"start_step": 100, "weights": {"web": 0}}], seq_len=64)
    web, wiki = data.of_sources()
    assert (web.path, web.seq_len, web.sources) == (None, 64, [])
    assert (wiki.path, wiki.name, wiki.split, wiki.seq_len) == ("wikitext", "wikitext-2-raw-v1", "test", 64)
    assert weight_plan(data.sources, data.stages) == [(0, [0.7, 0.3]), (99, [0.0, 1.0])]
    assert DataConfig().of_sources() == [DataConfig()]
