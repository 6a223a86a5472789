"""Compilation in place, of each decoder layer or of the whole forward with its loss: the same loss and gradients as
eager."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from toolkit.config.errors import UserError
from toolkit.data.packing import block_causal_mask, labels_for
from toolkit.models.compilation import compile_layers, compile_model, decoder_layers
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.models.loss import forward_loss_sum, put_loss_in_forward

SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def packed_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of 64 tokens holding documents of 20/30/14 and 5/59 tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 64), generator=g)
    pos = torch.stack([torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]),
                       torch.cat([torch.arange(5), torch.arange(59)])])
    return {
        "input_ids": ids, "position_ids": pos, "attention_mask": block_causal_mask(pos),
        "labels": labels_for(ids, pos, torch.tensor([64, 64])),
    }


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = forward_loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# model.compile=layers without recomputation is the layer graph of the first two cases, without their checkpoint
@pytest.mark.parametrize("how, checkpointing", [("model", "none"), ("layers", "full"), ("layers", "selective")])
def test_compiled_layers_give_eager_loss_and_gradients(tiny_model, how, checkpointing):
    # the whole model's graph holds each layer again: one layer, half of its ~40 s of cold compiling
    sizes = SIZES | ({"num_hidden_layers": 1} if how == "model" else {})
    eager = tiny_model("llama", seed=0, **sizes).train()
    compiled = tiny_model("llama", seed=0, **sizes).train()
    for model in (eager, compiled):
        apply_gradient_checkpointing(model, checkpointing)
    names_before = list(compiled.state_dict())
    compile_model(compiled, how)
    # in place: same classes and parameter names, so checkpoints and FSDP wrapping see one model
    assert list(compiled.state_dict()) == names_before
    assert type(compiled).__name__ == "LlamaForCausalLM"
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in decoder_layers(compiled))

    batch = packed_batch(eager.config.vocab_size)
    notices = []  # what torch logs while compiling, past the loggers' filters (its handlers keep stderr of their own)
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logger.addHandler(handler)
    graphs_before = counters["stats"]["unique_graphs"]
    ref_loss, ref_grads = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    assert counters["stats"]["unique_graphs"] > graphs_before  # dynamo really compiled the layers
    # inductor fuses and regroups the sums: fp32 in another order, u sqrt(K) of the scale (u = 2^-24,
    # K the vocabulary), x 4 as in test_loss.py's assert_same_grads. Measured: loss 9e-8, gradients
    # 4.5e-7 of their largest entry
    bound = 4 * 2.0**-24 * eager.config.vocab_size**0.5
    torch.testing.assert_close(loss, ref_loss, rtol=bound, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=bound * scale, msg=name)
    # one compiled graph serves every layer: a second step compiles nothing new
    graphs = counters["stats"]["unique_graphs"]
    with torch.profiler.profile() as step:
        loss_and_grads(compiled, batch)
    assert counters["stats"]["unique_graphs"] == graphs
    # what the backward recomputes, against the matmuls of an eager step without checkpointing: full runs the
    # layers' again, selective must save them under compile too (transformers 5.17 checkpointed outside the
    # compiled layer, where the policy matched nothing: 88 matmuls here against full's 60 and none's 46)
    with torch.profiler.profile() as plain:
        loss_and_grads(tiny_model("llama", seed=0, **sizes).train(), batch)
    plain_mms, step_mms = (sum(e.count for e in p.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
                           for p in (plain, step))
    assert (step_mms > plain_mms) if checkpointing == "full" else (step_mms == plain_mms), (checkpointing, plain_mms, step_mms)
    logger.removeHandler(handler)
    assert not notices  # torch's notice for a policy under compile (cold compiles only): dropped by the toolkit


def test_decoder_layers_found_through_a_peft_wrapper(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", seed=0, **SIZES), LoraConfig(r=4, target_modules=["q_proj"]))
    assert len(decoder_layers(model)) == SIZES["num_hidden_layers"]


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(UserError, match="set model.compile=model or none"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_forward_whose_loss_is_not_the_targets_sum_is_refused_on_its_first_batch(tiny_model, monkeypatch):
    """Some causal LMs compute their own mean and ignore num_items_in_batch and shift_labels (BartForCausalLM):
    model.compile=model would then train on a loss 1/tokens the size. The first batch's loss is checked."""
    model = tiny_model("llama", seed=0, **SIZES)
    put_loss_in_forward(model)  # what compile_model(model, "model") does before it compiles
    batch = packed_batch(model.config.vocab_size)
    summed = forward_loss_sum(model, batch)  # transformers' ForCausalLMLoss: the sum, checked once
    assert summed.item() > 100

    def mean_of_its_own(logits, labels, vocab_size, **kwargs):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), kwargs["shift_labels"].flatten())

    other = tiny_model("llama", seed=0, **SIZES)
    put_loss_in_forward(other)
    monkeypatch.setattr(type(other), "loss_function", property(lambda self: mean_of_its_own))
    with pytest.raises(UserError, match="model.compile=model: LlamaForCausalLM computes another loss in its forward "
                                        "than the sum over the targets it is given .*; use model.compile=layers"):
        forward_loss_sum(other, batch)


def test_compiled_layers_under_a_lora_with_the_head_on_targets_give_eager_loss_and_gradients(tiny_model):
    """The fine-tune YAMLs' auto on a GPU: a LoRA's layers compiled and the head on the target positions alone, against
    the eager LoRA with the head on every position: the adapter's gradients within fp32's summation order."""
    from peft import LoraConfig, get_peft_model

    from toolkit.models.loss import loss_on_targets

    def lora():
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        torch.manual_seed(0)
        return get_peft_model(tiny_model("llama", seed=0, **SIZES), config).train()

    eager, compiled = lora(), lora()
    compile_model(compiled, "layers")
    loss_on_targets(compiled)
    batch = packed_batch(eager.config.vocab_size)
    batch["labels"][:, :16] = -100  # a prompt: positions the head skips
    ref_loss, ref_grads = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    bound = 4 * 2.0**-24 * eager.config.vocab_size**0.5  # as above
    torch.testing.assert_close(loss, ref_loss, rtol=bound, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=bound * ref_grads[name].abs().max().item(),
                                   msg=name)
