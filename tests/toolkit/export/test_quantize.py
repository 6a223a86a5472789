"""Int8/int4 weight-only export: the folder loads with plain `from_pretrained`, its linear weights
are really torchao-quantised, it generates, and its held-out perplexity stays within 2 % (int8) /
15 % (int4) of the float source; bad input fails with one line.

Two models: SmolLM2-135M, the real check, and a tiny LLaMA (untied head) trained for 60 steps so
that its perplexity is not the flat ~vocabulary of random weights. ~15 s on 2 idle CPU cores
(~50 s shared), most of it SmolLM2 (loaded from the toolkit's dequantised-GGUF cache, quantised
twice).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math

import installed
import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.config.errors import UserError
from toolkit.export import quantize
from toolkit.export.quantize import DEVICES, HF_QUANTS, check_device, devices, quantize_folder

TOLERANCE = {"int8": 0.02, "int4": 0.15}
EVAL_TOKENS = 300
HELD_OUT = ("assert", "assignment", "augassign")  # pydoc topics; the tiny model never trains on them
PROMPT = "The capital of France is"

needs_torchao = pytest.mark.usefixtures("torchao")


@pytest.fixture
def torchao():
    return installed.module("torchao", "quant")  # a failure, not a skip, where install.sh was not run


def _held_out_ids(tokenizer) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in HELD_OUT)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :EVAL_TOKENS]
    assert ids.shape[1] == EVAL_TOKENS
    return ids


@torch.no_grad()
def _perplexity(model, ids: torch.Tensor) -> float:
    model.eval()
    return math.exp(model(ids, labels=ids).loss.item())


def _weights_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def smollm2_source(tmp_path_factory, smollm2_gguf_path):
    """(folder, source perplexity, tokenizer): SmolLM2 dequantised from its GGUF, saved as fp32."""
    from toolkit.models.base_model import BaseModelConfig, load_base_model

    model, tokenizer, _ = load_base_model(BaseModelConfig())  # the toolkit cache makes reloads ~1 s
    folder = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, _perplexity(model, _held_out_ids(tokenizer)), tokenizer


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory, tiny_model, tiny_tokenizer, tiny_texts):
    """(folder, source perplexity, tokenizer): a tiny LLaMA (untied head) trained 60 steps on pydoc."""
    from pydoc_data.topics import topics

    model = tiny_model("llama", tokenizer=tiny_tokenizer)
    train_text = "".join(topics[k] for k in sorted(topics) if k not in HELD_OUT)
    ids = tiny_tokenizer(train_text, return_tensors="pt").input_ids[0, : 64 * 128].view(64, 128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for _ in range(60):
        batch = ids[torch.randint(0, 64, (8,))]
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder, _perplexity(model, _held_out_ids(tiny_tokenizer)), tiny_tokenizer


# --- the quantised folder ------------------------------------------------------------------------


@needs_torchao
@pytest.mark.parametrize("scheme", HF_QUANTS)
@pytest.mark.parametrize("source", ["tiny_source", "smollm2_source"])
def test_quantised_folder_loads_generates_and_keeps_perplexity(source, scheme, request, tmp_path):
    src, src_ppl, tokenizer = request.getfixturevalue(source)
    out, notes = quantize_folder(src, tmp_path / f"model-{scheme}", scheme)
    assert out == tmp_path / f"model-{scheme}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # the temporary sibling is gone
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    # for inference: the KV cache on, in both files, whatever the source (a training folder has it off)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "generation_config.json").read_text()).get("use_cache", True) is True

    model = AutoModelForCausalLM.from_pretrained(out)  # plain: no quantization_config, no device_map

    # every decoder linear is a torchao tensor with int8 storage; the embedding and head stay float
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    kinds = {type(m.weight).__name__ for m in linears.values()}
    assert kinds == ({"Int8Tensor"} if scheme == "int8" else {"Int8Tensor", "IntxUnpackedToInt8Tensor"})
    assert all(m.weight.qdata.dtype == torch.int8 for m in linears.values())
    for name, m in linears.items():
        if scheme == "int4" and not name.endswith(("v_proj", "down_proj")):
            w = m.weight
            assert type(w).__name__ == "IntxUnpackedToInt8Tensor" and w.target_dtype == torch.int4, name
            assert -8 <= int(w.qdata.min()) and int(w.qdata.max()) <= 7, name
    assert type(model.lm_head.weight) is torch.nn.Parameter and model.lm_head.weight.dtype == torch.float32
    assert type(model.get_input_embeddings().weight) is torch.nn.Parameter

    # on disk: at least 60 % of the linears' fp32 bytes are gone (1 byte per weight plus scales)
    linear_fp32 = 4 * sum(m.in_features * m.out_features for m in linears.values())
    assert _weights_bytes(out) < _weights_bytes(src) - 0.6 * linear_fp32

    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert gen.shape[1] == ids.shape[1] + 4 and int(gen.max()) < len(tokenizer)
    if source == "smollm2_source":  # the real model still knows its facts
        assert "Paris" in tokenizer.decode(gen[0, ids.shape[1] :])

    ppl = _perplexity(model, _held_out_ids(tokenizer))
    print(
        f"{source} {scheme}: perplexity {src_ppl:.3f} -> {ppl:.3f} ({ppl / src_ppl - 1:+.2%}); "
        f"{_weights_bytes(src) / 1e6:.1f} MB -> {_weights_bytes(out) / 1e6:.1f} MB"
    )
    assert ppl <= src_ppl * (1 + TOLERANCE[scheme]), (src_ppl, ppl)

    assert f"{len(linears)} linear layers" in notes[0] and "TorchAoConfig" in notes[0]
    assert "lm_head" in notes[1] and "kept in float32" in notes[1]
    assert "safetensors" in notes[-1]


@needs_torchao
def test_existing_output_is_replaced_whole(tiny_source, tmp_path):
    src, _, _ = tiny_source
    out = tmp_path / "q"
    quantize_folder(src, out, "int4")
    (out / "stale.txt").write_text("from an earlier export")
    quantize_folder(src, out, "int8")
    assert not (out / "stale.txt").exists()
    assert (
        type(AutoModelForCausalLM.from_pretrained(out).model.layers[0].mlp.up_proj.weight).__name__
        == "Int8Tensor"
    )


@needs_torchao
def test_int4_linears_that_do_not_split_into_groups_go_int8(tmp_path, tiny_model, tiny_tokenizer):
    """hidden 80 is not a multiple of the int4 group (32): those linears fall back to int8, by name."""
    tiny_model("llama", tokenizer=tiny_tokenizer, hidden_size=80, num_attention_heads=4).save_pretrained(
        tmp_path / "src"
    )
    tiny_tokenizer.save_pretrained(tmp_path / "src")
    out, notes = quantize_folder(tmp_path / "src", tmp_path / "out", "int4")
    model = AutoModelForCausalLM.from_pretrained(out)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj.weight).__name__ == "Int8Tensor"  # in_features 80
    assert type(layer.mlp.up_proj.weight).__name__ == "Int8Tensor"  # in_features 80
    assert any("not a multiple of 32 and went int8 instead of int4" in n for n in notes)
    ids = torch.arange(20)[None]
    assert model(ids).logits.isfinite().all()


def test_device_table():
    assert set(DEVICES) == set(HF_QUANTS) == {"int8", "int4"}
    assert devices("int8") == devices("int4") == ("cpu", "cuda")
    check_device("int4", "cpu")
    check_device("int8", "cuda:1")


# --- bad inputs: one line each -------------------------------------------------------------------


def test_unknown_scheme(tmp_path):
    with pytest.raises(
        UserError, match=r"quantization 'nf4' is not offered; choose one of int8, int4"
    ) as exc:
        quantize_folder(tmp_path, tmp_path / "out", "nf4")
    _one_line_error(exc)
    with pytest.raises(UserError, match="not offered"):
        devices("int2")


def test_device_the_scheme_does_not_run_on():
    with pytest.raises(UserError, match="quantization int4 runs on cpu or cuda, not on mps") as exc:
        check_device("int4", "mps")
    _one_line_error(exc)


@pytest.mark.parametrize("found", [None, "0.14.1"])
def test_torchao_missing_or_too_old(monkeypatch, tmp_path, found):
    real = importlib.metadata.version

    def version(name):
        if name != "torchao":
            return real(name)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(quantize.importlib.metadata, "version", version)
    with pytest.raises(UserError, match=r"needs torchao.*pip install 'llm-toolkit\[quant\]'") as exc:
        quantize_folder(tmp_path, tmp_path / "out", "int8")
    assert ("not installed" if found is None else "found 0.14.1") in _one_line_error(exc)


@needs_torchao
def test_folder_without_config(tmp_path, tiny_model):
    tiny_model("llama").save_pretrained(tmp_path / "run" / "final")
    with pytest.raises(
        UserError, match=r"has no config.json: give a Hugging Face model folder; use .*final"
    ) as exc:
        quantize_folder(tmp_path / "run", tmp_path / "out", "int8")
    _one_line_error(exc)
    assert not (tmp_path / "out").exists()


@needs_torchao
def test_already_quantised_source(tiny_source, tmp_path):
    src, _, _ = tiny_source
    once, _ = quantize_folder(src, tmp_path / "once", "int8")
    with pytest.raises(
        UserError, match=r"is already quantised \(torchao\); quantise the float folder"
    ) as exc:
        quantize_folder(once, tmp_path / "twice", "int4")
    _one_line_error(exc)


@needs_torchao
def test_output_onto_its_source_or_a_foreign_folder(tiny_source, tmp_path):
    src, _, _ = tiny_source
    with pytest.raises(UserError, match="would overwrite its source"):
        quantize_folder(src, src, "int8")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a model folder") as exc:
        quantize_folder(src, tmp_path / "notes", "int8")
    _one_line_error(exc)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


@needs_torchao
def test_model_without_linear_layers(tmp_path, tiny_model):
    """GPT-2's projections are Conv1D, which torchao's transformers integration does not quantise."""
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(
        UserError, match=r"\(gpt2\) has no nn.Linear layer that torchao could quantise"
    ) as exc:
        quantize_folder(tmp_path / "gpt2", tmp_path / "out", "int8")
    _one_line_error(exc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]  # nothing half-written
