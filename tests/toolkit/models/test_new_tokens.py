"""model.new_tokens: the tokens a template needs are added to the tokenizer before any weight loads, the model gets
rows for them at the mean of the existing ones, and they train under a full fine-tune and a LoRA (peft's
trainable_token_indices), whose adapter loads onto the resized base by peft alone and merges to the same logits."""

from __future__ import annotations

import copy

import pytest
import torch
from recipe_runner import CHATML
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.models.adapter import AdapterConfig, apply_adapter, merge
from toolkit.models.base_model import BaseModelConfig, base_tokenizer, load_base_model
from toolkit.models.new_tokens import add_new_tokens, resize_for_new_tokens, template_markers

GEMMA = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture
def plain_tokenizer(tiny_tokenizer):
    """The tiny BPE (no ChatML markers) as a transformers tokenizer with an EOS, as a base folder saves it."""
    tok = PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(tiny_tokenizer.backend_tokenizer),
                                  eos_token=tiny_tokenizer.eos_token)
    return tok


@pytest.fixture
def base_folder(tmp_path, tiny_model, plain_tokenizer):
    def make(tied: bool):
        folder = tmp_path / ("tied" if tied else "untied")
        tiny_model("llama", tokenizer=plain_tokenizer, tie_word_embeddings=tied).save_pretrained(folder)
        plain_tokenizer.save_pretrained(folder)
        return folder
    return make


def test_template_means_the_markers_the_tokenizer_lacks(plain_tokenizer, chat_tokenizer):
    assert template_markers(CHATML) == ["<|im_start|>", "<|im_end|>"]
    assert template_markers(GEMMA) == ["<start_of_turn>", "<end_of_turn>"]
    n = len(plain_tokenizer)
    assert add_new_tokens(plain_tokenizer, ["template"], CHATML, "base") == ["<|im_start|>", "<|im_end|>"]
    assert plain_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [n, n + 1]
    # one token each, special: the rendered turn ends with the id, and decoding can skip it
    assert plain_tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids[0] == n
    assert plain_tokenizer.decode([n, n + 1], skip_special_tokens=True) == ""
    # a template whose markers the tokenizer has: nothing to add
    assert add_new_tokens(copy.deepcopy(chat_tokenizer), ["template"], None, "base") == []


def test_template_with_no_template_to_read_says_what_to_list(plain_tokenizer):
    """A base with no chat template and no data.chat_template (data.format=text, say, which refuses one): the line
    names model.new_tokens and the fix that applies, not only data.chat_template."""
    with pytest.raises(UserError, match=r"^model.new_tokens has template, which reads the markers of the chat template, "
                                        r"and base's tokenizer has none: list the tokens to add"):
        add_new_tokens(copy.deepcopy(plain_tokenizer), ["template"], None, "base")


def test_a_listed_token_the_tokenizer_has_is_refused(chat_tokenizer):
    with pytest.raises(UserError, match=r"model.new_tokens: <\|im_end\|> is already token \d+ of base's tokenizer; drop"):
        add_new_tokens(copy.deepcopy(chat_tokenizer), ["<think>", "<|im_end|>"], None, "base")


@pytest.mark.parametrize("entries", [[""], ["  "]])
def test_a_blank_entry_is_refused_by_the_config(tmp_path, entries):
    (tmp_path / "c.yaml").write_text(f"new_tokens: {entries!r}\n")
    with pytest.raises(ConfigError, match="new_tokens has"):
        load_config(BaseModelConfig, tmp_path / "c.yaml", [])


def test_base_tokenizer_and_load_base_model_add_the_same_tokens(base_folder):
    cfg = BaseModelConfig(path=str(base_folder(tied=True)), new_tokens=["template", "<think>"])
    alone = base_tokenizer(cfg, CHATML)
    model, tokenizer, notes = load_base_model(cfg, chat_template=CHATML)
    assert alone.get_vocab() == tokenizer.get_vocab() and len(tokenizer) == model.get_input_embeddings().num_embeddings
    assert notes[-1] == ("model.new_tokens: added 3 tokens (<|im_start|>, <|im_end|>, <think>), their embedding (tied "
                         "to the head) rows set to the mean of the existing 300")
    # no new_tokens: no resize at all, the base as it was saved
    plain, _, notes = load_base_model(BaseModelConfig(path=cfg.path))
    assert plain.get_input_embeddings().num_embeddings == 300 and not any("new_tokens" in n for n in notes)


@pytest.mark.parametrize("tied", [True, False])
def test_new_rows_are_the_mean_and_a_tied_head_stays_tied(tiny_model, plain_tokenizer, tied):
    model = tiny_model("llama", tokenizer=plain_tokenizer, tie_word_embeddings=tied)
    old_embed = model.get_input_embeddings().weight.detach().clone()
    old_head = model.get_output_embeddings().weight.detach().clone()
    added = add_new_tokens(plain_tokenizer, ["<|im_start|>", "<|im_end|>"], None, "base")
    resize_for_new_tokens(model, plain_tokenizer, added)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.shape[0] == head.shape[0] == model.config.vocab_size == 302
    torch.testing.assert_close(embed[300:], old_embed.mean(0).expand(2, -1))
    torch.testing.assert_close(head[300:], old_head.mean(0).expand(2, -1))
    torch.testing.assert_close(embed[:300], old_embed)
    assert (head is embed) == tied


def _one_step(model, ids) -> None:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad


@pytest.mark.parametrize("tied", [True, False])
def test_full_fine_tune_trains_the_new_rows(tiny_model, plain_tokenizer, tied):
    model = tiny_model("llama", tokenizer=plain_tokenizer, tie_word_embeddings=tied)
    resize_for_new_tokens(model, plain_tokenizer, add_new_tokens(plain_tokenizer, ["<|im_end|>"], None, "base"))
    ids = torch.tensor([[5, 6, 300, 7, 300]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.get_input_embeddings().weight.grad[300].abs().sum() > 0
    assert model.get_output_embeddings().weight.grad[300].abs().sum() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_lora_trains_the_new_rows_and_peft_alone_loads_and_merges_the_adapter(base_folder, tmp_path, tied):
    """What a user does with adapter/: resize the base to the adapter's tokenizer, then PeftModel.from_pretrained."""
    from peft import PeftModel

    folder = base_folder(tied)
    cfg = BaseModelConfig(path=str(folder), new_tokens=["template"])
    model, tokenizer, _ = load_base_model(cfg, chat_template=CHATML)
    peft_model, note = apply_adapter(model, AdapterConfig(method="lora", r=4))
    assert "the rows of model.new_tokens on embed_tokens" + ("" if tied else " and lm_head") in note
    ids = torch.tensor([[300, 5, 6, 301, 7, 300, 8, 301]])
    before = peft_model(input_ids=ids).logits.detach()
    torch.manual_seed(0)
    _one_step(peft_model, ids)
    trained = peft_model.eval()(input_ids=ids).logits.detach()
    assert not torch.allclose(trained[0, :, 300:], before[0, :, 300:])  # the new head rows moved
    peft_model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    tokenizer.save_pretrained(tmp_path / "adapter")

    base = AutoModelForCausalLM.from_pretrained(folder)
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(tmp_path / "adapter")))
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained, atol=1e-5, rtol=0)

    base = AutoModelForCausalLM.from_pretrained(folder)
    base.resize_token_embeddings(302)
    merged = merge(base, tmp_path / "adapter")
    torch.testing.assert_close(merged(input_ids=ids).logits, trained, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_the_chunked_loss_sees_the_trained_token_rows(base_folder, tied):
    """model.loss=chunked computes in the head that peft's trainable tokens wrap: the same loss and row gradients as
    the full logits (the default loss on a LoRA run with model.new_tokens)."""
    from toolkit.models.loss import forward_loss_sum

    model, _, _ = load_base_model(BaseModelConfig(path=str(base_folder(tied)), new_tokens=["template"]),
                                  chat_template=CHATML)
    peft_model, _ = apply_adapter(model, AdapterConfig(method="lora", r=4))
    ids = torch.tensor([[300, 5, 6, 301, 7, 300, 8, 301]])
    _one_step(peft_model, ids)  # the new rows differ from the base's
    batch = {"input_ids": ids, "labels": ids}
    grads = []
    for chunk in (0, 3):
        peft_model.zero_grad()
        loss = forward_loss_sum(peft_model, batch, chunk)
        loss.backward()
        delta = next(p for n, p in peft_model.named_parameters() if "trainable_tokens_delta" in n)
        grads.append((loss.detach(), delta.grad.clone()))
    torch.testing.assert_close(grads[0], grads[1])


def test_a_token_the_base_has_is_refused_before_its_weights_load(base_folder, monkeypatch):
    from toolkit.models import base_model

    monkeypatch.setattr(base_model, "_load_folder", lambda *a, **k: pytest.fail("the weights were loaded"))
    folder = base_folder(tied=True)
    eos = AutoTokenizer.from_pretrained(folder).eos_token
    with pytest.raises(UserError, match=f"model.new_tokens: {eos} is already token"):
        load_base_model(BaseModelConfig(path=str(folder), new_tokens=[eos]))
    with pytest.raises(UserError, match="model.new_tokens has template, .* tokenizer has none: list the tokens"):
        load_base_model(BaseModelConfig(path=str(folder), new_tokens=["template"]))
