"""model.cast_weights=per_step: the bf16 copy of the weights made once per optimizer step computes what
autocast's copies at every forward compute, bit for bit, with gradient accumulation and recomputation;
the copies exist only while a step runs; the state dict is the model's; where it cannot apply it is refused."""

from __future__ import annotations

import contextlib

import datasets
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from toolkit.data.packing import collate, pack_documents, tokenize_documents
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.models.loss import backward_scale
from toolkit.models.weight_cast import WeightCast, applies, weight_cast
from toolkit.parallel_layout import ParallelLayout
from toolkit.training.step import optimizer_step

SEQ_LEN, ACCUM = 32, 2


@pytest.fixture(autouse=True)
def _reset_accelerate(monkeypatch):
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def steps(tiny_texts, tiny_tokenizer):
    """Three optimizer steps of 2 micro-batches of 2 blocks."""
    tokenized = tokenize_documents(datasets.Dataset.from_dict({"text": tiny_texts[:6]}), tiny_tokenizer)
    blocks = pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id).with_format("numpy")
    return [[collate(blocks[[4 * s + 2 * m, 4 * s + 2 * m + 1]], "sdpa") for m in range(ACCUM)] for s in range(3)]


def train(model, steps, cast: bool):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM)
    copies = WeightCast(model, torch.bfloat16) if cast else None
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.train()
    losses = []
    for micro in steps:
        targets = sum(int((b["labels"] != -100).sum()) for b in micro)
        with copies.step() if copies else contextlib.nullcontext():
            if copies:
                assert all(m.step_weight.dtype == torch.bfloat16 for m in copies.linears)
            loss_sum, _, nonfinite, _ = optimizer_step(accelerator, model, optimizer, micro,
                                                       backward_scale(targets, 1, ACCUM), 1.0, weight_cast=copies)
            if copies:  # released after the last backward, before the update
                assert all(m.step_weight is None for m in copies.linears)
        assert nonfinite is None
        losses.append(loss_sum.item())
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerator.unwrap_model(model), losses, copies


# without recomputation: each step's first forward here, and 20 steps in test_trainer.py (issue 40's budget: ~5 CPU-s)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_copy_per_step_trains_as_autocasts_copy_per_forward(tiny_model, tiny_tokenizer, steps, recompute):
    """Tied embeddings (the head and the embedding share one weight, cast once), 2 micro-batches a step, and under
    recomputation a second forward of each layer reading the same copy (selective: its matmuls' outputs kept)."""
    models = []
    for cast in (False, True):
        model = tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, tie_word_embeddings=True)
        apply_gradient_checkpointing(model, recompute)
        models.append(train(model, steps, cast))
    (eager, eager_losses, _), (cast, cast_losses, copies) = models
    assert cast_losses == eager_losses
    for (name, a), b in zip(eager.named_parameters(), cast.parameters(), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), name
    assert len(copies.linears) == 2 * 7  # q, k, v, o, gate, up, down per layer; the head is left to autocast
    assert all(m.step_weight is None for m in copies.linears)  # nothing held between steps
    assert eager.state_dict().keys() == cast.state_dict().keys()


LAYOUTS = {  # where the copy cannot be made once per step, and why
    "fp32": (ParallelLayout("ddp", 2), None, "the run computes in fp32"),
    "fsdp": (ParallelLayout("fsdp", 2), torch.bfloat16, "FSDP2 casts the weights its own way"),
    "zero3": (ParallelLayout("deepspeed", 2, zero_stage=3), torch.bfloat16, "DeepSpeed casts the weights"),
    "tensor parallel": (ParallelLayout("fsdp", 2, tp=2), torch.bfloat16, "FSDP2 casts"),
    "context parallel": (ParallelLayout("ddp", 2, cp=2), torch.bfloat16, "context parallel"),
    "pipeline": (ParallelLayout("ddp", 2, pp=2), torch.bfloat16, "pipelines compute under autocast"),
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_auto_falls_back_where_per_step_cannot_apply(tiny_model, case):
    """(per_step there is refused at launch: tests/toolkit/config/test_combinations.py)"""
    layout, dtype, why = LAYOUTS[case]
    model = tiny_model("llama")
    assert why in applies(layout, dtype)
    assert weight_cast("auto", model, layout, dtype) is None
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_auto_casts_once_per_step_on_one_process_and_ddp(tiny_model):
    for layout in (ParallelLayout("single", 1), ParallelLayout("ddp", 2)):
        assert isinstance(weight_cast("auto", tiny_model("llama"), layout, torch.bfloat16), WeightCast)
        assert weight_cast("per_forward", tiny_model("llama"), layout, torch.bfloat16) is None
    # the whole model compiled under DDP of several ranks: auto leaves it to autocast (dynamo splits that graph at
    # the parameters for the all-reduce); one process, or asked for, it casts once per step
    ddp = ParallelLayout("ddp", 2)
    assert weight_cast("auto", tiny_model("llama"), ddp, torch.bfloat16, "model") is None
    assert weight_cast("auto", tiny_model("llama"), ddp, torch.bfloat16, "layers") is not None
    assert weight_cast("auto", tiny_model("llama"), ParallelLayout("ddp", 1), torch.bfloat16, "model") is not None
    assert weight_cast("per_step", tiny_model("llama"), ddp, torch.bfloat16, "model") is not None


def test_a_weight_already_in_the_compute_dtype_is_left_to_compute_with_itself(tiny_model):
    """A LoRA over a bf16 base: the base's bf16 weights are no copies to make; the fp32 ones still are."""
    model = tiny_model("llama")
    model.model.layers[0].mlp.to(torch.bfloat16)
    copies = WeightCast(model, torch.bfloat16)
    mlp = model.model.layers[0].mlp
    assert not {mlp.gate_proj, mlp.up_proj, mlp.down_proj} & set(copies.linears) and copies.linears
    for _ in range(2):  # a second step is where a copy taken for a parameter was refused
        with copies.step():
            assert all(m.step_weight.dtype == torch.bfloat16 for m in copies.linears)
        assert all(m.step_weight is None for m in copies.linears)
