"""A pipeline's files (toolkit.strategy.pipeline.files), from a checkpoint an earlier commit saved
(tests/fixtures/checkpoints/pipeline@2: 2 stages on 2 processes): every stage's weights under their
whole-model names, and each one's Adam state and step. Saving and loading a stage: the pipeline tests."""

from __future__ import annotations

import torch
from saved_checkpoints import FIXTURES
from saved_formats import read_back
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.strategy.pipeline import files as pipeline


def test_a_pipeline_checkpoint_is_read_back_whole_by_parameter_name(tmp_path):
    weights, moments, steps = read_back("pipeline", "pipeline@2", tmp_path)
    folder = FIXTURES / "pipeline@2" / "step-3"
    assert [f.name for f in pipeline.stage_files(folder)] == ["pipeline_stage_0.safetensors", "pipeline_stage_1.safetensors"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder / "model_files"))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    # the tied head: one parameter of the model, a copy with its own Adam state on the last stage
    assert sorted(weights) == sorted(moments) and set(moments) == set(shapes) | {"lm_head.weight"}
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert all(weights[n].shape == shapes[n] and moments[n]["exp_avg"].shape == shapes[n] for n in shapes)
    assert moments["lm_head.weight"]["exp_avg"].shape == shapes["model.embed_tokens.weight"]
    assert set(steps.values()) == {3.0}
