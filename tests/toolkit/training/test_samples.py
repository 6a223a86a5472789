"""Generation is one process's own business: a whole model, never synced with other ranks."""

from __future__ import annotations

import pytest

from toolkit.training.samples import generate


def test_a_whole_model_generates(tiny_model, tiny_tokenizer):
    model = tiny_model(tokenizer=tiny_tokenizer).train()
    out = generate(model, tiny_tokenizer, ["The for statement"], max_new_tokens=4)
    assert len(out) == 1 and isinstance(out[0], str)
    assert model.training  # left as the caller had it


@pytest.mark.parametrize("shard_attribute", ["ds_id", "to_local"])
def test_a_sharded_model_is_refused_instead_of_hanging(tiny_model, tiny_tokenizer, shard_attribute):
    model = tiny_model(tokenizer=tiny_tokenizer)
    # what ZeRO-3 (ds_id) and FSDP2 (DTensor.to_local) leave on a parameter of a prepared model
    setattr(next(model.parameters()), shard_attribute, 0)
    with pytest.raises(RuntimeError, match="cannot generate from a sharded model in one process"):
        generate(model, tiny_tokenizer, ["The for statement"], max_new_tokens=4)


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_refused_before_the_run_not_after_its_training(prompt, tiny_model, tiny_tokenizer):
    """It is no tokens to continue from: generate failed with an IndexError after training and final/ were done."""
    from toolkit.config import ConfigError, load_config
    from toolkit.training.recipe_config import PretrainConfig

    with pytest.raises(ConfigError, match=r"^samples.prompts\[1\] is empty; give text to continue from, or drop it$"):
        load_config(PretrainConfig, None, [f"samples.prompts=[The, '{prompt}']"])
    if prompt:  # what it guards: no ids to start from
        return
    with pytest.raises((IndexError, RuntimeError)):  # the error depends on the model
        generate(tiny_model("llama", seed=0, tokenizer=tiny_tokenizer), tiny_tokenizer, [prompt], 2)
