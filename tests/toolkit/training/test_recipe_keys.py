"""Both recipes' keys and the tables derived from their fields (toolkit.training.recipe_keys)."""

from __future__ import annotations

import dataclasses

from toolkit.config.declarations import ALWAYS, free, undeclared
from toolkit.config.load import field
from toolkit.run.paths import CACHE, OUTPUT, READ, RESUME
from toolkit.training import recipe_keys as keys
from toolkit.training.evaluation import EvalConfig
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig


def test_every_key_of_both_recipes_declares_what_each_table_asks_of_it():
    assert keys.unclassified() == []


# a recipe with keys added the way they were before: with their help only, or missing one declaration
@dataclasses.dataclass
class LouderEval(EvalConfig):
    harness_batch: int = field(8, help="prompts per harness batch")
    harness_tags: list[str] = field(default_factory=list, help="labels", resume=free("labels"), used_when=ALWAYS,
                                    path=None)


@dataclasses.dataclass
class Louder(FinetuneConfig):
    eval: LouderEval = field(default_factory=LouderEval, help="held-out evaluation cadence and size")
    motto: str | None = field(None, help="a line for the logs", resume=free("a line"), used_when=ALWAYS)


def test_a_key_added_to_a_recipe_without_its_declarations_fails_the_classification():
    """The point of declaring on the field: a key added in a section, or to a recipe, with only its help is named by
    the walk that every classification test reads."""
    assert undeclared(Louder) == [
        "eval.harness_batch declares no resume=: say it on its field (toolkit.config.declarations)",
        "eval.harness_batch declares no used_when=: say it on its field (toolkit.config.declarations)",
        "eval.harness_tags declares no unique=: say it on its field (toolkit.config.declarations)",
        "motto declares no path=: say it on its field (toolkit.config.declarations)",
    ]
    assert undeclared(FinetuneConfig) == []


def test_the_derived_tables_hold_what_the_hand_written_ones_held():
    """Checked against the hand-written tables of 12aa419 when they were replaced (every table equal, key for key);
    these are their short tables whole and a few rows of the long ones."""
    assert {k: r for k, r in keys.PATH_SETTINGS.items() if r} == {
        "output_dir": OUTPUT, "data.cache_dir": CACHE, "model.cache_dir": CACHE, "resume": RESUME,
        **dict.fromkeys(("model.path", "model.gguf_file", "tokenizer.path", "data.path", "data.val_path",
                         "data.sources[].path", "data.chat_template", "eval.harness_include_path",
                         "forgetting.general"), READ)}
    assert len(keys.PATH_SETTINGS) == 35 and len(keys.OVERLAPS) == 92  # + evaluate --output's 12 (issue 63); model.new_tokens (64); forgetting.general
    assert sorted(keys.OWN_CHECK) == sorted(("seed", "train.global_batch_size", "data.sources", "data.stages",
                                             "data.streaming"))
    assert sorted(keys.SCHEDULE) == sorted(("optim.lr", "optim.lr_scaling", "optim.lr_reference_batch",
                                            "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio",
                                            "train.max_steps"))
    assert sorted(keys.KEPT_BY_THE_OPTIMIZER) == ["optim.betas", "optim.eps", "optim.weight_decay"]
    assert (len(keys.REFUSED), len(keys.FROM_NEXT_STEP), len(keys.FREE)) == (41, 15, 40)  # + train.canary, canary_every; data.append_stop, model.new_tokens; model.loss_positions; forgetting.*
    assert keys.REFUSED["data.seq_len"] == "it decides which tokens each step reads"
    assert keys.REFUSED["train.mixed_precision"] == "the strategy's saved weights and optimizer state are in its precision"
    assert keys.FREE["model.loss"] == "the chunked loss equals the full one (test_loss)"
    assert sorted(keys.UNIQUE) == sorted(("logging.trackers", "adapter.target_modules", "adapter.modules_to_save",
                                          "adapter.layers", "eval.harness_tasks", "model.new_tokens"))
    assert sorted(keys.REPEATS_MEAN_SOMETHING) == sorted(("optim.betas", "logging.profile", "samples.prompts",
                                                          "data.sources", "data.stages"))
    assert keys.CHECKED_BY == {
        "resume": "RunConfig.validate (with overwrite=true)", "train.beta": "FinetuneTrainConfig.validate",
        "forgetting.budget": "forgetting_problems",
        "train.gamma": "FinetuneTrainConfig.validate", "train.orpo_lambda": "FinetuneTrainConfig.validate",
        "data.chat_template": "FinetuneDataConfig.validate", "data.record_format": "FinetuneDataConfig.validate",
        "data.columns.conversation": "FinetuneDataConfig.validate",
        # a source's keys declare it since issue 63 (they said nothing: keys inside a list needed only path=)
        "data.sources[].record_format": "DataConfig.source_problems", "data.sources[].columns": "DataConfig.source_problems"}
    assert (len(keys.USED_WHEN), len(keys.ALWAYS)) == (37 + 2 + 3 + 1 + 4, 56 + 7 - 1 + 1 + 1 + 1)  # + the sources' keys; eval.every, eval.blocks, train.canary(_every); data.append_stop; model.new_tokens; model.loss_positions; forgetting.*
    assert keys.USED_WHEN["adapter.r"] == ("adapter.method", ("lora", "qlora"), "LoRA's")
    assert keys.USED_WHEN["tokenizer.vocab_size"] == ("tokenizer.path", (None,), "for a tokenizer the run trains")
    assert keys.ACCEPTS["optim.max_grad_norm"] == {"0": "no clipping, as documented"}


def test_each_recipe_reads_its_own_keys_of_the_tables():
    """PATHS, the settings a checkpoint records and the notes are each recipe's: a pretraining config has no model.path."""
    assert "model.path" in FinetuneConfig.PATHS and "model.path" not in PretrainConfig.PATHS
    assert set(PretrainConfig.PATHS) | set(FinetuneConfig.PATHS) == {k for k, r in keys.PATH_SETTINGS.items() if r}
