"""final/ as one Hugging Face folder: the dtype rule, tied weights written once, nothing half-written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit.export.hf_folder import write_model_folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_weights_are_cast_to_final_dtype_and_say_so(dtype, tiny_model, tiny_tokenizer, tmp_path):
    model = tiny_model(tokenizer=tiny_tokenizer, tie_word_embeddings=True)
    out = write_model_folder(model, tiny_tokenizer, tmp_path / "final", {"params": 1, "step": 2, "tokens": 3,
                             "recipe": "pretrain", "model_type": "llama", "strategy": "DDP"}, {}, dtype=dtype)
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {getattr(torch, dtype)}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    assert f"| weights | {dtype}, cast from the fp32 master weights" in (out / "README.md").read_text()
    assert "lm_head.weight" not in weights  # tied to the embeddings: stored once
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == getattr(torch, dtype)
    for name, p in model.state_dict().items():  # the values are the source's, rounded to the dtype
        torch.testing.assert_close(reloaded.state_dict()[name], p.to(getattr(torch, dtype)), rtol=0, atol=0)
    assert not (tmp_path / "final.tmp").exists()


def test_without_a_dtype_the_weights_stay_as_they_are(tiny_model, tiny_tokenizer, tmp_path):
    model = tiny_model(tokenizer=tiny_tokenizer).to(torch.bfloat16)
    out = write_model_folder(model, tiny_tokenizer, tmp_path / "export", {}, {}, card="# export\n")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert (out / "README.md").read_text() == "# export\n"


def test_the_folder_carries_a_manifest_that_finds_a_flipped_bit(tiny_model, tiny_tokenizer, tmp_path):
    """So that export tells a damaged final/ from an intact one, as resume does for a checkpoint."""
    from toolkit.run.manifest import check_manifest

    out = write_model_folder(tiny_model(tokenizer=tiny_tokenizer), tiny_tokenizer, tmp_path / "final", {"params": 1,
                             "step": 2, "tokens": 3, "recipe": "pretrain", "model_type": "llama", "strategy": "DDP"}, {})
    assert check_manifest(out) is None
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-8] ^= 1
    (out / "model.safetensors").write_bytes(data)
    assert check_manifest(out).startswith(f"{out}/model.safetensors does not match its checksum")


@pytest.mark.parametrize("card", [None, "# export\n"], ids=["final", "export"])
def test_a_folder_for_inference_generates_with_the_kv_cache(card, tiny_model, tiny_tokenizer, tmp_path):
    """A model as training holds it (use_cache off in its config and in the generation config made from it), written
    as final/ or as an export of a checkpoint: both files turn the cache back on, and generate() uses it."""
    model = tiny_model(tokenizer=tiny_tokenizer)
    assert model.config.use_cache is False and model.generation_config.use_cache is False  # as training has it
    facts = {"params": 1, "step": 2, "tokens": 3, "recipe": "pretrain", "model_type": "llama", "strategy": "DDP"}
    out = write_model_folder(model, tiny_tokenizer, tmp_path / "out", facts, {}, card=card)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "generation_config.json").read_text()).get("use_cache", True) is True
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    generated = reloaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False,
                                  return_dict_in_generate=True)
    assert generated.past_key_values is not None
