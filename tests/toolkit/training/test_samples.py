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
    from toolkit.config.errors import ConfigError
    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import PretrainConfig

    with pytest.raises(ConfigError, match=r"^samples.prompts\[1\] is empty; give text to continue from, or drop it$"):
        load_config(PretrainConfig, None, [f"samples.prompts=[The, '{prompt}']"])
    if prompt:  # what it guards: no ids to start from
        return
    with pytest.raises((IndexError, RuntimeError)):  # the error depends on the model
        generate(tiny_model("llama", seed=0, tokenizer=tiny_tokenizer), tiny_tokenizer, [prompt], 2)


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_and_its_new_tokens_past_the_positions_are_refused_before_training(chat, tiny_model, chat_tokenizer):
    """GPT-2 (learned positions) with samples.max_new_tokens within n_positions but the prompt's tokens on top went
    past them: an IndexError in generate after training, exit 1, no samples (issue 44). Refused before training,
    with what fits; at exactly the positions it generates."""
    from recipe_runner import CHATML

    from toolkit.config.errors import UserError
    from toolkit.training.samples import SamplesConfig, check_prompt_lengths, prompt_ids

    template = CHATML if chat else None
    prompt = "The for statement is used to iterate over the elements of a sequence"
    n = prompt_ids(chat_tokenizer, prompt, template).shape[1]
    model = tiny_model("gpt2", seed=0, tokenizer=chat_tokenizer, n_positions=n + 4)
    fits = SamplesConfig(prompts=[prompt], max_new_tokens=4)
    check_prompt_lengths(chat_tokenizer, fits, n + 4, template)
    generate(model, chat_tokenizer, fits.prompts, fits.max_new_tokens, template)
    past = SamplesConfig(prompts=["The", prompt], max_new_tokens=5)
    with pytest.raises(UserError, match=rf"^samples.prompts\[1\] is {n} tokens, and with samples.max_new_tokens=5 a "
                       rf"sample would be {n + 5} tokens, more than the model's {n + 4} positions; use "
                       r"samples.max_new_tokens=4 or less, or a shorter prompt$"):
        check_prompt_lengths(chat_tokenizer, past, n + 4, template)
    with pytest.raises(IndexError):  # what it guards (the last new token is never fed: one more to fail)
        generate(model, chat_tokenizer, [prompt], 6, template)
