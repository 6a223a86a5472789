"""A model from scratch: any transformers model_type plus sizes, checked before any work is done."""

from __future__ import annotations

import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.models.scratch import (
    ModelConfig,
    build_model,
    check_seq_len,
    count_parameters,
    describe_sizes,
    hf_config,
    max_positions,
    meta_model,
)

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
VOCAB = 300


def llama(**overrides) -> ModelConfig:
    return ModelConfig(model_type="llama", config={**SIZES, **overrides})


# validate


def test_a_valid_config_has_no_problems():
    assert llama().validate() == []
    assert ModelConfig(model_type="gpt2", config=dict(n_embd=64, n_layer=2, n_head=4)).validate() == []


def test_an_unknown_model_type_gets_a_suggestion():
    assert ModelConfig(model_type="lama").validate() == [
        "model_type=lama is not a transformers model type; did you mean llama?"
    ]
    assert ModelConfig(model_type="zzzzzzzz").validate() == [
        "model_type=zzzzzzzz is not a transformers model type"
    ]


@pytest.mark.parametrize("model_type", ["t5", "vit"])
def test_a_model_type_without_a_causal_lm_is_refused_before_any_work(model_type):
    """transformers refuses it only when the model is built, after the data work, in ~190 lines."""
    assert ModelConfig(model_type=model_type).validate() == [
        f"model_type={model_type} has no causal LM in transformers (it is not a text decoder); use one that has, "
        "e.g. llama, gpt2, qwen2, mistral"
    ]


def test_unknown_config_keys_are_each_named():
    problems = llama(hidden_sizee=3, zzqq=1).validate()
    assert problems == [
        "config.hidden_sizee is not a llama config key; did you mean hidden_size?",
        "config.zzqq is not a llama config key",
    ]


def test_attribute_map_aliases_are_known_keys():
    # gpt2 calls it n_embd; hidden_size is its attribute_map alias and must not be rejected (96: 12 heads of 8)
    assert ModelConfig(model_type="gpt2", config={"hidden_size": 96, "n_positions": 128}).validate() == []
    assert (
        ModelConfig(model_type="gpt2", config={"num_hidden_layer": 2})
        .validate()[0]
        .startswith("config.num_hidden_layer is not a gpt2 config key")
    )


def test_an_integer_where_transformers_wants_a_float_is_made_one():
    """An override reads `router_aux_loss_coef=0` as an int; transformers' strict config refused it
    with a traceback."""
    cfg = ModelConfig(model_type="qwen3_moe", config={"router_aux_loss_coef": 0, "num_experts": 4})
    assert cfg.config == {"router_aux_loss_coef": 0.0, "num_experts": 4}
    assert type(cfg.config["router_aux_loss_coef"]) is float and type(cfg.config["num_experts"]) is int
    assert cfg.validate() == []
    assert hf_config(cfg, vocab_size=VOCAB, eos_id=0, pad_id=None).router_aux_loss_coef == 0.0


def test_a_value_of_the_wrong_type_is_one_problem():
    assert ModelConfig(model_type="llama", config={"hidden_size": "wide"}).validate() == [
        "config.hidden_size: Field 'hidden_size' expected int, got str (value: 'wide')"
    ]


def test_all_problems_are_reported_together():
    problems = ModelConfig(model_type="lama", config={"x": 1}, gradient_checkpointing_k=0, compile="model",
                           loss="chunked").validate()
    assert sorted(problems) == [
        "compile=model computes the loss in the compiled graph, whole: set loss=full, or compile=layers to keep "
        "loss=chunked",
        "gradient_checkpointing_k=0 must be at least 1",
        "model_type=lama is not a transformers model type; did you mean llama?",
    ]


# hf_config


def test_hf_config_takes_the_tokenizer_vocab_and_special_ids():
    config = hf_config(llama(), vocab_size=VOCAB, eos_id=5, pad_id=7)
    assert config.model_type == "llama"
    assert config.vocab_size == VOCAB
    assert config.hidden_size == 64 and config.num_hidden_layers == 2
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (5, 5, 7)
    assert config.use_cache is False
    assert hf_config(llama(), VOCAB, 0, None).pad_token_id is None


def test_a_gpt2_with_a_smaller_vocabulary_is_built_without_transformers_warning(capfd, caplog):
    """GPT-2's default bos/eos id 50256 outside a 1024-token BPE: transformers warned 'bos_token_id must be `None` or
    an integer within the vocabulary' and the same for eos, at every run (issue 44's probe)."""
    cfg = ModelConfig(model_type="gpt2", config=dict(n_embd=32, n_layer=1, n_head=2, n_positions=64))
    meta_model(cfg, 1024)
    config = hf_config(cfg, vocab_size=1024, eos_id=3, pad_id=4)
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (3, 3, 4)
    said = capfd.readouterr().err + caplog.text
    assert "token_id" not in said, said


def test_hf_config_keeps_a_larger_vocab():
    cfg = llama(vocab_size=320)  # rounded up for the tensor cores: allowed
    assert hf_config(cfg, VOCAB, 0, 1).vocab_size == 320
    assert cfg.config["vocab_size"] == 320  # the user's dict is not modified
    assert "vocab_size" not in llama().config


def test_hf_config_refuses_a_vocab_smaller_than_the_tokenizer():
    with pytest.raises(
        UserError, match=r"model.config.vocab_size=299 is smaller than the tokenizer's 300 tokens; remove it"
    ):
        hf_config(llama(vocab_size=299), VOCAB, 0, 1)


# check_seq_len


def test_check_seq_len_against_max_positions():
    check_seq_len(llama(), 512)  # exactly the limit is fine
    with pytest.raises(UserError, match=r"data.seq_len=513 is larger than the model's max positions \(512\)"):
        check_seq_len(llama(), 513)


def test_check_seq_len_reads_gpt2_n_positions():
    gpt2 = ModelConfig(model_type="gpt2", config=dict(n_embd=64, n_layer=2, n_head=4, n_positions=128))
    check_seq_len(gpt2, 128)
    with pytest.raises(UserError, match=r"max positions \(128\)"):
        check_seq_len(gpt2, 129)


def test_max_positions_of_a_config():
    assert max_positions(hf_config(llama(max_position_embeddings=64), VOCAB, 0, 1)) == 64


# build_model


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_build_model_is_deterministic_for_a_seed():
    cfg = llama()
    config = hf_config(cfg, VOCAB, 0, 1)
    a, b, c = (weights(build_model(cfg, config, seed)) for seed in (3, 3, 4))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], c[n]) for n in a if a[n].is_floating_point() and a[n].std() > 0)


def test_init_seed_overrides_the_run_seed():
    cfg = llama()
    cfg.init_seed = 11
    config = hf_config(cfg, VOCAB, 0, 1)
    a, b = weights(build_model(cfg, config, seed=1)), weights(build_model(cfg, config, seed=2))
    ref = weights(build_model(llama(), config, seed=11))
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], ref[name]), name


def test_build_model_is_the_configured_architecture():
    cfg = llama()
    model = build_model(cfg, hf_config(cfg, VOCAB, 0, 1), seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.get_input_embeddings().weight.shape == (VOCAB, 64)
    assert len(model.model.layers) == 2
    assert model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_an_unusable_attention_is_a_user_error():
    cfg = llama()
    cfg.attn_implementation = "bogus"
    with pytest.raises(UserError, match=r"model.attn_implementation=bogus is not usable here"):
        build_model(cfg, hf_config(cfg, VOCAB, 0, 1), seed=0)


# count_parameters and meta_model


def test_count_parameters_with_and_without_embeddings():
    cfg = llama()
    model = build_model(cfg, hf_config(cfg, VOCAB, 0, 1), seed=0)
    hidden, inter, kv = 64, 128, 2 * 16  # 2 kv heads of head_dim 64/4
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden  # attn, mlp, 2 norms
    embed = VOCAB * hidden
    expected = embed + 2 * layer + hidden + embed  # embeddings, layers, final norm, untied lm_head
    assert count_parameters(model) == expected == sum(p.numel() for p in model.parameters())
    assert count_parameters(model, exclude_embeddings=True) == expected - embed


def test_count_parameters_counts_tied_weights_once():
    cfg = llama(tie_word_embeddings=True)
    untied = build_model(llama(), hf_config(llama(), VOCAB, 0, 1), seed=0)
    tied = build_model(cfg, hf_config(cfg, VOCAB, 0, 1), seed=0)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    assert count_parameters(tied) == count_parameters(untied) - VOCAB * 64


def test_meta_model_builds_without_memory():
    model = meta_model(llama())
    params = list(model.parameters())
    assert params and {p.device.type for p in params} == {"meta"}
    names = {n for n, _ in model.named_modules()}
    assert "model.layers.1.self_attn.q_proj" in names and "model.layers.2.self_attn.q_proj" not in names
    assert count_parameters(model) > 0  # shapes are there, only the storage is not


# degenerate sizes (issue 26)
@pytest.mark.parametrize(("model_type", "sizes", "message"), [
    ("llama", {"num_hidden_layers": 0}, "config.num_hidden_layers=0 must be at least 1"),
    ("gpt2", {"n_layer": 0}, "config.n_layer=0 must be at least 1"),  # named as written, through attribute_map
    ("llama", {"intermediate_size": 0}, "config.intermediate_size=0 must be at least 1"),
    ("llama", {"num_attention_heads": 0}, "config.num_attention_heads=0 must be at least 1"),
    ("llama", {"vocab_size": 0}, "config.vocab_size=0 must be at least 1"),
    ("gpt2", {"n_embd": 100, "n_head": 3}, "config.n_embd=100 is not divisible by config.n_head=3; each head takes "
                                           "hidden_size / heads features: use a multiple"),
    ("llama", {"num_key_value_heads": 3}, "config.num_attention_heads=4 is not divisible by config.num_key_value_heads=3"),
], ids=["no layers", "gpt2 no layers", "no MLP", "no heads", "no vocab", "hidden not divisible by heads",
        "heads not divisible by kv heads"])
def test_degenerate_sizes_are_refused_in_one_line(model_type, sizes, message):
    base = SIZES if model_type == "llama" else {"n_embd": 64, "n_layer": 2, "n_head": 4}
    problems = ModelConfig(model_type=model_type, config={**base, **sizes}).validate()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_a_default_size_is_named_as_the_default():
    problems = ModelConfig(model_type="llama", config={"num_key_value_heads": 5}).validate()
    assert problems == ["config.num_attention_heads=32 (llama's default) is not divisible by config.num_key_value_heads=5; "
                        "each key/value head serves a whole group of query heads"]


def test_head_dim_frees_the_hidden_size_from_the_heads():
    assert ModelConfig(model_type="llama", config={**SIZES, "hidden_size": 60, "head_dim": 16}).validate() == []


def test_an_empty_model_config_is_described_as_transformers_defaults():
    cfg = ModelConfig(model_type="llama", config={})
    model = meta_model(cfg, VOCAB)
    assert model.config.vocab_size == VOCAB
    assert describe_sizes(cfg, model.config) == ("model.config is empty, so transformers' default llama "
                                                 "(hidden_size=4096, num_hidden_layers=32) was taken; it")
    assert describe_sizes(llama(), model.config).startswith("model.config (llama, hidden_size=64, ")


def test_blocks_longer_than_a_sliding_window_are_refused_where_packings_mask_would_drop_it():
    """transformers hands packing's 4-D mask to every layer as it is: under sdpa or eager a sliding layer would see
    the whole block. Gemma 2 (some layers sliding), Mistral v0.1 (all), and not Qwen2 with its window off."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    from toolkit.models.scratch import check_window, sliding_window

    gemma, mistral = Gemma2Config(sliding_window=8), MistralConfig(sliding_window=8)
    assert sliding_window(gemma) == sliding_window(mistral) == 8
    assert sliding_window(Qwen2Config(sliding_window=8, use_sliding_window=False)) is None
    for config in (gemma, mistral):
        for attn in ("sdpa", "eager"):
            with pytest.raises(UserError, match=rf"^data.seq_len=16 is longer than W=8, and model.attn_implementation="
                                                rf"{attn} keeps packed documents apart with a mask that would drop"):
                check_window(config, 16, attn, "W")
        check_window(config, 8, "eager", "W")  # within the window: the mask is the model's own
        check_window(config, 16, "flex_attention", "W")  # transformers builds the window into its BlockMask
    check_window(Qwen2Config(sliding_window=8, use_sliding_window=False), 16, "sdpa", "W")
