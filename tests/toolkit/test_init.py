"""toolkit/__init__.py: what it keeps off a run's output. transformers' bars while a model's weights load or are
written, once `quiet_weight_bars()` runs (the recipes' entry and export call it); its other bars stay."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from toolkit import quiet_weight_bars


def save_load_and_another_bar(folder) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    LlamaForCausalLM.from_pretrained(folder)
    for _ in hf_logging.tqdm(range(3), desc="another bar"):
        pass


def test_model_weight_bars_are_off_and_other_bars_stay(tmp_path, capfd):
    previous = hf_logging.set_tqdm_hook(None)  # as transformers has it
    try:
        save_load_and_another_bar(tmp_path / "plain")
        assert "Loading weights" in capfd.readouterr().err  # the control: the bar is there to take away
        quiet_weight_bars()
        save_load_and_another_bar(tmp_path / "quiet")
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err
        assert "another bar" in err
    finally:
        hf_logging.set_tqdm_hook(previous)


def test_accelerates_removed_shared_tensor_is_dropped_for_a_tied_head_alone(caplog):
    """A tied head saved once is what the load ties again, with or without a LoRA on it (issue 63: a LoRA on lm_head
    with model.loss=full printed "Removed shared tensor {'base_model.model.lm_head.base_layer.weight'}" at each save);
    any other shared tensor is still said."""
    import logging

    import torch
    from accelerate.state import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors
    from peft import LoraConfig, get_peft_model

    PartialState()  # Accelerate's logger needs its state, as in a run
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    plain = LlamaForCausalLM(config)
    lora = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    copied = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"],
                                                                 modules_to_save=["lm_head"]))
    # model.new_tokens under a LoRA: the head's token_adapter (its base weight and the rows' delta) tied to the
    # embedding's, removed as a pair (the message named both, at each checkpoint)
    tokens = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"],
                                                                 trainable_token_indices={"embed_tokens": [60, 61]}))
    with caplog.at_level(logging.WARNING):
        for model in (plain, lora, copied, tokens):
            assert len(clean_state_dict_for_safetensors(model.state_dict())) < len(model.state_dict())
        assert "Removed shared tensor" not in caplog.text
        other = torch.zeros(3)
        clean_state_dict_for_safetensors({"a.weight": other, "b.weight": other})
        assert "Removed shared tensor {'b.weight'}" in caplog.text


def test_the_trainable_tokens_a_tied_head_shares_load_back_from_a_checkpoint_without_them(tmp_path):
    """What that dropped message would have asked for: the rows' delta saved once, through the embedding, is the
    head's again once loaded (so the record is one the user could not act on)."""
    import torch
    from accelerate.utils.other import clean_state_dict_for_safetensors
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_model, save_file

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)

    def model(seed):
        torch.manual_seed(seed)
        return get_peft_model(LlamaForCausalLM(config), LoraConfig(
            r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [60, 61]})).eval()

    saved = model(0)
    with torch.no_grad():
        for name, param in saved.named_parameters():
            if "trainable_tokens_delta" in name:
                param.normal_()
    save_file(clean_state_dict_for_safetensors(saved.state_dict()), tmp_path / "model.safetensors")
    loaded = model(0)
    load_model(loaded, tmp_path / "model.safetensors", strict=False)
    ids = torch.tensor([[60, 61, 3]])
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, loaded(ids).logits)
