"""How any model trains (toolkit.models.compute.ComputeConfig): its checks, and that both recipes'
`model` sections (scratch.ModelConfig for pretrain, base_model.BaseModelConfig for finetune) take
the same three keys with the same defaults and checks."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.load import load_config
from toolkit.models.base_model import BaseModelConfig
from toolkit.models.compute import ComputeConfig
from toolkit.models.scratch import ModelConfig

COMPUTE_KEYS = [
    "attn_implementation", "gradient_checkpointing", "gradient_checkpointing_k", "compile", "cast_weights", "loss",
    "loss_positions", "loss_chunk_tokens",
]
MODEL_SECTIONS = [ModelConfig, BaseModelConfig]


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_the_defaults_are_valid_and_train_without_recomputation():
    cfg = ComputeConfig()
    assert cfg.validate() == []
    assert (cfg.attn_implementation, cfg.gradient_checkpointing, cfg.gradient_checkpointing_k) == ("sdpa", "none", 2)


@pytest.mark.parametrize("k", [0, -1])
def test_every_k_below_one_is_refused(k):
    assert ComputeConfig(gradient_checkpointing="every_k", gradient_checkpointing_k=k).validate() == [
        f"gradient_checkpointing_k={k} must be at least 1"
    ]


def test_k_of_one_is_valid():
    assert ComputeConfig(gradient_checkpointing="every_k", gradient_checkpointing_k=1).validate() == []


def test_an_unknown_checkpointing_mode_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError) as caught:
        load_config(ComputeConfig, None, ["gradient_checkpointing=ful"])
    assert caught.value.problems == ["gradient_checkpointing='ful' is not one of none, full, every_k, selective; did you mean full?"]


def test_every_field_is_documented():
    assert all(f.metadata.get("help") for f in dataclasses.fields(ComputeConfig))


@pytest.mark.parametrize("section", MODEL_SECTIONS, ids=lambda c: c.__name__)
def test_each_model_section_inherits_the_compute_keys(section):
    assert issubclass(section, ComputeConfig)
    ours, theirs = _fields(ComputeConfig), _fields(section)
    assert list(ours) == COMPUTE_KEYS
    for name in COMPUTE_KEYS:
        assert theirs[name].default == ours[name].default
        assert theirs[name].type == ours[name].type
        assert theirs[name].metadata["help"] == ours[name].metadata["help"]


def test_both_recipes_take_the_same_compute_keys():
    compute = [set(_fields(s)) & set(COMPUTE_KEYS) for s in MODEL_SECTIONS]
    assert compute[0] == compute[1] == set(COMPUTE_KEYS)


@pytest.mark.parametrize("section", MODEL_SECTIONS, ids=lambda c: c.__name__)
def test_each_model_section_runs_the_compute_checks(section):
    assert section().validate() == []
    assert "gradient_checkpointing_k=0 must be at least 1" in section(gradient_checkpointing_k=0).validate()


@pytest.mark.parametrize("section", MODEL_SECTIONS, ids=lambda c: c.__name__)
def test_each_model_section_loads_the_compute_keys_from_overrides(section):
    cfg = load_config(section, None, ["attn_implementation=eager", "gradient_checkpointing=every_k",
                                      "gradient_checkpointing_k=3"])
    assert (cfg.attn_implementation, cfg.gradient_checkpointing, cfg.gradient_checkpointing_k) == ("eager", "every_k", 3)
    with pytest.raises(ConfigError, match="gradient_checkpointing_k=0 must be at least 1"):
        load_config(section, None, ["gradient_checkpointing_k=0"])


def test_chunk_tokens_is_zero_unless_the_loss_is_chunked():
    assert ComputeConfig().chunk_tokens == 0
    assert ComputeConfig(loss="chunked", loss_chunk_tokens=512).chunk_tokens == 512
    assert ComputeConfig(loss="full", loss_chunk_tokens=512).chunk_tokens == 0


@pytest.mark.parametrize(("value", "said"), [
    ("automatic", "is not one of auto, eager, flash_attention_2, flash_attention_3, flex_attention, sdpa; did you mean auto?"),
    ("Auto", "did you mean auto?"), ("sdpa2", "did you mean sdpa?"), ("eagre", "did you mean eager?"),
    ("flash-attention-2", "did you mean flash_attention_2?"),
    # transformers' own kernels that read no document boundaries: why not, not a spelling
    ("sdpa_paged", "cannot keep packed documents apart; use sdpa, eager, flex_attention, flash_attention_2 on GPU, or auto"),
    ("paged_attention", "cannot keep packed documents apart"),
])
def test_an_attention_that_is_not_one_is_told_its_nearest_or_why(value, said):
    problems = ComputeConfig(attn_implementation=value).validate()
    assert len(problems) == 1 and said in problems[0], problems
