"""Base model loading: SmolLM2 from its GGUF becomes an ordinary model that answers, trains, saves
and reloads without the GGUF; bad paths and files fail with one line.

SmolLM2 is parsed from the GGUF once per module (~6 s on 2 shared CPU cores); everything else reuses that
model, its cached copy, or a tiny random one. The GGUF side of it: tests/toolkit/models/test_gguf_base.py.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast
from transformers.trainer_utils import validate_quantization_for_training

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.models import base_model, gguf_base
from toolkit.models.base_model import BaseModelConfig, load_base_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_gguf_path):
    """(model, tokenizer, notes, cfg) from the real GGUF, with the dequantised copy cached in a temp dir."""
    cfg = BaseModelConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    model, tokenizer, notes = load_base_model(cfg)
    model.eval()
    return model, tokenizer, notes, cfg


def _logits(model, tokenizer, text=PROMPT):
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        return model(ids).logits


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


# --- the GGUF becomes an ordinary model ----------------------------------------------------------


def test_gguf_model_is_ordinary(smollm2):
    """No quantizer flag left: the Trainer's check passes and every weight is a trainable float."""
    model, tokenizer, notes, _ = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    assert not hasattr(model.config, "_is_quantized")
    validate_quantization_for_training(model)  # what Trainer runs; raises for a quantized model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert "dequantised SmolLM2-135M-Instruct.Q4_1.gguf" in notes[0] and "ordinary" in notes[0]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_gguf_model_answers_paris(smollm2):
    model, tokenizer, _, _ = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_saved_folder_reloads_without_gguf(smollm2, tmp_path):
    """save_pretrained works, writes no quantization config, and reloads to the same logits."""
    model, tokenizer, _, _ = smollm2
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert not list(tmp_path.glob("*.gguf"))
    reloaded, tok2, notes = load_base_model(BaseModelConfig(path=str(tmp_path)))
    assert "GGUF" not in notes[0]
    torch.testing.assert_close(_logits(reloaded, tok2), _logits(model, tokenizer), atol=1e-5, rtol=0)
    assert tok2.chat_template == tokenizer.chat_template and tok2.eos_token == tokenizer.eos_token


def test_second_load_comes_from_the_cache(smollm2):
    """The dequantised copy loads in well under a second and is the same model."""
    model, tokenizer, _, cfg = smollm2
    cached, tok2, notes = load_base_model(cfg)
    assert "from its dequantised copy" in notes[0]
    assert getattr(cached, "hf_quantizer", None) is None
    torch.testing.assert_close(_logits(cached, tok2), _logits(model, tokenizer), atol=0, rtol=0)


def test_base_config_is_the_loaded_models_without_loading_it(smollm2, tmp_path):
    """What plan.py sizes: the config of the model a fine-tune loads, from the dequantised copy where there is
    one, else parsed from the GGUF once a process (each parse ~3 s: the 49k-token vocabulary)."""
    model, _, _, cfg = smollm2
    gguf_base.gguf_config.cache_clear()

    def facts(config):
        return (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_key_value_heads,
                config.vocab_size, config.tie_word_embeddings, config.intermediate_size)

    assert facts(base_model.base_config(cfg)) == facts(model.config)
    assert gguf_base.gguf_config.cache_info().misses == 0  # read from the copy in cfg's cache
    uncached = BaseModelConfig(cache_dir=cfg.cache_dir, gguf_cache=False)
    first = base_model.base_config(uncached)
    first.hidden_size = 1  # a caller's change stays its own
    assert facts(base_model.base_config(uncached)) == facts(model.config)
    assert gguf_base.gguf_config.cache_info()[:2] == (1, 1)  # (hits, misses): parsed once
    damaged = BaseModelConfig(cache_dir=str(tmp_path))  # a copy whose config.json was cut short: the file says it
    copy = gguf_base.cache_folder(damaged, gguf_base.resolve_gguf(damaged))
    copy.mkdir(parents=True)
    (copy / "config.json").write_text('{"model_type": "lla')
    assert facts(base_model.base_config(damaged)) == facts(model.config)


@pytest.mark.parametrize("path", ["missing", "a file", "an empty folder", "a run folder"])
def test_base_config_refuses_what_the_fine_tune_refuses_in_its_words(tmp_path, tiny_model, path):
    folder = tmp_path / "model"
    if path == "a file":
        folder.write_text("not a model")
    elif path == "an empty folder":
        folder.mkdir()
    elif path == "a run folder":
        tiny_model("llama").save_pretrained(folder / "final")
    cfg = BaseModelConfig(path=str(folder))
    with pytest.raises(UserError) as planned:
        base_model.base_config(cfg)
    with pytest.raises(UserError) as loaded:
        load_base_model(cfg)
    with pytest.raises(UserError) as tokenizer:
        base_model.base_tokenizer(cfg)
    assert str(planned.value) == str(loaded.value) == str(tokenizer.value) and str(folder) in str(planned.value)


def test_base_tokenizer_is_the_loaded_models_without_loading_it(smollm2):
    """What the data's checks and a preview read before the weights load: the tokenizer load_base_model gives,
    from the dequantised copy, or from the GGUF's metadata where there is none."""
    _, tokenizer, _, cfg = smollm2
    text = "<|im_start|>user\nHi<|im_end|>\n"
    for alone in (base_model.base_tokenizer(cfg), base_model.base_tokenizer(BaseModelConfig(gguf_cache=False))):
        assert (len(alone), alone.eos_token, alone.pad_token, alone.chat_template) == (
            len(tokenizer), tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template)
        assert alone(text).input_ids == tokenizer(text).input_ids


def test_a_dequantised_copy_loads_without_the_gguf_package(smollm2, monkeypatch):
    _, _, _, cfg = smollm2
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_base.importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    _, _, notes = load_base_model(BaseModelConfig(cache_dir=cfg.cache_dir))
    assert "from its dequantised copy" in notes[0]


def test_dtype_is_applied_to_a_gguf(smollm2):
    _, _, _, cfg = smollm2
    model, _, _ = load_base_model(BaseModelConfig(cache_dir=cfg.cache_dir, dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# --- bad inputs: one line each -------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="does not exist; give a Hugging Face model folder") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path / "nope")))
    assert str(tmp_path / "nope") in _one_line_error(exc)


def test_run_folder_instead_of_final(tmp_path, tiny_model):
    tiny_model("llama").save_pretrained(tmp_path / "final")
    with pytest.raises(UserError, match="looks like a run folder; use model.path=.*final") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path)))
    _one_line_error(exc)


def test_tokenizer_without_eos(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model("llama").save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="the tokenizer has no EOS token") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path)))
    assert f"model.path={tmp_path}" in _one_line_error(exc)
    with pytest.raises(UserError) as alone:
        base_model.base_tokenizer(BaseModelConfig(path=str(tmp_path)))
    assert str(alone.value) == str(exc.value)


def test_config_loads_and_validates(tmp_path):
    cfg = load_config(BaseModelConfig, None, ["gguf_file=x.gguf", "dtype=bfloat16", "gguf_cache=false"])
    assert (cfg.path, cfg.gguf_file, cfg.dtype, cfg.gguf_cache) == (None, "x.gguf", "bfloat16", False)
    with pytest.raises(ConfigError, match="dtype='fp8' is not one of") as exc:
        load_config(BaseModelConfig, None, ["dtype=fp8"])
    _one_line_error(exc)


def test_a_hub_model_while_offline_is_one_line_at_once(monkeypatch):
    """model.path a hub id with no network (and no HF_HUB_OFFLINE=1): one line at once, not ~45 s of retries."""
    import socket
    import time

    import huggingface_hub

    from toolkit.data import tokenizer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError(101, "Network is unreachable")))
    tokenizer.hub_unreachable.cache_clear()
    start = time.monotonic()
    try:
        with pytest.raises(UserError) as err:
            load_base_model(BaseModelConfig(path="nobody-org/no-such-model"))
    finally:
        tokenizer.hub_unreachable.cache_clear()
    assert time.monotonic() - start < 5
    assert str(err.value).startswith("model.path=nobody-org/no-such-model is read as a hub id, but the Hub cannot be "
                                     "reached (huggingface.co: Network is unreachable) and it is not in the local hub cache")
