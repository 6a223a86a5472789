"""One optimizer step over micro-batches (step.optimizer_step + loss.backward_scale) with a real
Accelerator accumulating 2 micro-batches: the update must be the one full-batch step on the mean
token loss over all target tokens, however unevenly the targets fall into micro-batches. A preference
objective's step is likewise the one full-batch step on the mean over all pairs."""

from __future__ import annotations

import copy
import sys

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from toolkit.data.packing import IGNORE_INDEX, collate, pack_documents, target_counts, tokenize_documents
from toolkit.data.preference import (
    collate_pairs,
    embedded_records,
    pack_pairs,
    pair_counts,
    tokenize_pairs,
    with_reference,
)
from toolkit.models.loss import backward_scale
from toolkit.models.preference_loss import PreferenceLoss
from toolkit.models.router import RouterLoss
from toolkit.training.reference import reference_logps
from toolkit.training.step import optimizer_step

SEQ_LEN = 32
ACCUM = 2
LR = 0.5
INIT_RANGE = 0.2  # token losses that differ, so a wrong weighting of micro-batches shows


@pytest.fixture(autouse=True)
def _reset_accelerate(monkeypatch):
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def data(tiny_texts, tiny_tokenizer):
    """Two global batches of 4 blocks, each split into 2 micro-batches with very different target counts."""
    texts = [tiny_texts[2][:400], *"abcdefghijklmnopqrstuvwxyz0123456789", tiny_texts[4][:350], "the end."]
    tokenized = tokenize_documents(datasets.Dataset.from_dict({"text": texts}), tiny_tokenizer)
    blocks = pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id).with_format("numpy")
    counts = target_counts(blocks)
    order = np.argsort(counts, kind="stable")
    steps = []
    for few, many in [(order[0:2], order[-2:]), (order[2:4], order[-4:-2])]:
        micro = [collate(blocks[list(few)], "sdpa"), collate(blocks[list(many)], "sdpa")]
        full = collate(blocks[[*few, *many]], "sdpa")
        steps.append(
            dict(
                micro=micro,
                full=full,
                targets=int(counts[[*few, *many]].sum()),
                micro_targets=[int(counts[few].sum()), int(counts[many].sum())],
            )
        )
    return steps


@pytest.fixture
def make_model(tiny_model, tiny_tokenizer):
    return lambda: tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE)


def hand_token_losses(model, batch) -> torch.Tensor:
    """Every target's next-token loss, written out: logits at t predict the label at t + 1."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    return F.cross_entropy(logits[keep], labels[keep], reduction="none")


def reference_steps(make_model, steps, optimizer_cls, max_grad_norm: float | None):
    """Plain PyTorch, no Accelerate: one full batch per step, loss = mean over its target tokens."""
    model = make_model().train()
    optimizer = optimizer_cls(model.parameters())
    losses, norms, grads = [], [], []
    for step in steps:
        token_losses = hand_token_losses(model, step["full"])
        assert token_losses.numel() == step["targets"]
        token_losses.mean().backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf")))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(token_losses.double().sum().item())
    return model, optimizer, losses, norms, grads


def toolkit_steps(make_model, steps, optimizer_cls, max_grad_norm: float | None):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = make_model()
    model, optimizer = accelerator.prepare(model, optimizer_cls(model.parameters()))
    model.train()
    losses, norms = [], []
    for step in steps:
        scale = backward_scale(step["targets"], accelerator.num_processes, ACCUM)
        loss_sum, grad_norm, nonfinite, _ = optimizer_step(
            accelerator, model, optimizer, step["micro"], scale, max_grad_norm
        )
        assert nonfinite is None
        assert loss_sum.dtype == torch.float64
        losses.append(loss_sum.item())
        norms.append(grad_norm)
    return accelerator.unwrap_model(model), optimizer, losses, norms


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def assert_same_weights(actual, expected):
    a, e = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert a.keys() == e.keys()
    for name in e:
        assert torch.allclose(a[name], e[name], rtol=1e-5, atol=1e-6), name


def test_micro_batches_are_uneven(data):
    for step in data:
        few, many = step["micro_targets"]
        assert few + many == step["targets"]
        assert many >= 1.2 * few, step["micro_targets"]  # a mean of micro-batch means would be off


def test_accumulated_step_equals_one_full_batch_step(make_model, data):
    step = data[0]
    ref_model, _, ref_losses, ref_norms, ref_grads = reference_steps(make_model, [step], sgd, None)
    model, _, losses, norms = toolkit_steps(make_model, [step], sgd, None)
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert norms[0] is not None and float(norms[0]) == pytest.approx(float(ref_norms[0]), rel=1e-5)
    assert_same_weights(model, ref_model)
    # SGD: the weights moved by exactly -lr * (the full-batch gradient)
    initial = dict(make_model().named_parameters())
    for name, p in model.named_parameters():
        grad = (initial[name] - p) / LR
        assert torch.allclose(grad, ref_grads[0][name], rtol=1e-4, atol=1e-6), name
    assert any(g.abs().max() > 1e-3 for g in ref_grads[0].values())  # and the gradient is not ~0


def test_loss_sum_is_the_sum_of_token_losses(make_model, data, monkeypatch):
    step = data[0]
    model = make_model().train()
    with torch.no_grad():
        per_micro = [hand_token_losses(model, b).double().sum().item() for b in step["micro"]]
    # and every batch tensor goes to the device without waiting for it (a blocking copy drains a GPU's queue first)
    batch_tensors, copies, to = {id(v) for b in step["micro"] for v in b.values()}, [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: (
        copies.append(kw.get("non_blocking", False)) if id(self) in batch_tensors else None, to(self, *a, **kw))[1])
    _, _, losses, _ = toolkit_steps(make_model, [step], sgd, None)
    monkeypatch.undo()
    assert copies == [True] * len(batch_tensors)
    assert losses[0] == pytest.approx(sum(per_micro), rel=1e-6)
    # the mean token loss is loss_sum / targets, not the mean of the two micro-batch means
    mean = losses[0] / step["targets"]
    naive = sum(s / n for s, n in zip(per_micro, step["micro_targets"], strict=True)) / ACCUM
    assert abs(mean - naive) > 1e-3 * mean


def test_two_steps_with_clipping_and_adamw(make_model, data):
    """Two optimizer steps of 2 micro-batches each: AdamW stepped exactly twice, gradients clipped
    once per step on the accumulated gradient, the same weights as two clipped full-batch steps."""

    def adamw(params):
        # eps well above the float32 noise of a near-zero gradient entry: with the default 1e-8 Adam
        # turns that noise into a full-size step (m / sqrt(v) ~ sign), on both paths alike
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)

    max_norm = 0.05
    ref_model, ref_opt, ref_losses, ref_norms, _ = reference_steps(make_model, data, adamw, max_norm)
    assert all(float(n) > max_norm for n in ref_norms)  # clipping really happens
    model, optimizer, losses, norms = toolkit_steps(make_model, data, adamw, max_norm)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert [float(n) for n in norms] == pytest.approx([float(n) for n in ref_norms], rel=1e-4)
    steps = {int(s["step"]) for s in optimizer.optimizer.state.values()}
    assert steps == {2}
    assert_same_weights(model, ref_model)


@pytest.mark.parametrize(("injected_kind", "found"), [("batch", "loss"), ("loss", "loss"), ("grad", "grad")])
def test_a_nonfinite_loss_or_gradient_is_not_stepped(make_model, data, monkeypatch, injected_kind, found):
    """One good AdamW step, then one whose loss and/or gradients are NaN (the test-only injection):
    it is reported, and weights, Adam's moments and step count are exactly as before it, with the
    gradients cleared; the step after it trains again."""
    from toolkit.run.faults import NONFINITE_ENV as ENV
    from toolkit.run.faults import injected

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.train()
    monkeypatch.setenv(ENV, f"{injected_kind}@2")

    def step(number: int, batch: dict):
        scale = backward_scale(batch["targets"], accelerator.num_processes, ACCUM)
        with injected(model, number):
            return optimizer_step(accelerator, model, optimizer, batch["micro"], scale, 1.0)

    assert step(1, data[0])[2] is None
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.optimizer.state.items()}

    loss_sum, grad_norm, nonfinite, _ = step(2, data[1])
    assert nonfinite == found
    assert bool(torch.isfinite(loss_sum)) == (injected_kind == "grad")
    if injected_kind == "loss":
        assert torch.isfinite(grad_norm)  # found by the loss alone
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
        assert p.grad is None, name
    assert optimizer.optimizer.state.keys() == state.keys()
    for key, saved in state.items():
        for name, value in saved.items():
            assert torch.equal(optimizer.optimizer.state[key][name], value), name

    assert step(3, data[1])[2] is None
    assert {int(s["step"]) for s in optimizer.optimizer.state.values()} == {2}
    assert any(not torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_a_moe_router_loss_is_weighted_once_per_global_batch(data, tiny_model, tiny_tokenizer):
    """A mixture of experts: the step's gradient is that of the mean token loss over the global batch
    plus router_aux_loss_coef x the mean of the micro-batches' router losses, whatever the accumulation
    (the reference: plain autograd, the router logits from the base model, transformers' own loss)."""
    coef = 0.5  # large, so that a wrong weighting of the router loss shows in the update

    def make():
        return tiny_model("qwen3_moe", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE,
                          router_aux_loss_coef=coef)

    step = data[0]
    reference = make().train()
    aux_fn = sys.modules[type(reference).__module__].load_balancing_loss_func
    routers = []
    for micro in step["micro"]:
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        logits = reference.model(**inputs, output_router_logits=True).router_logits
        routers.append(aux_fn(logits, 4, 2, None))
    objective = hand_token_losses(reference, step["full"]).mean() + coef * torch.stack(routers).mean()
    objective.backward()
    torch.optim.SGD(reference.parameters(), lr=LR).step()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = make()
    router = RouterLoss.of(model)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    model.train()
    scale = backward_scale(step["targets"], accelerator.num_processes, ACCUM)
    _, _, nonfinite, (router_sum,) = optimizer_step(accelerator, model, optimizer, step["micro"], scale, 0.0, 0, router)
    assert nonfinite is None
    assert router_sum.item() == pytest.approx(sum(r.item() for r in routers), rel=1e-6)
    assert_same_weights(accelerator.unwrap_model(model), reference)


# ---------------------------------------------------------------------------------- preference pairs
@pytest.fixture(scope="module")
def pair_blocks(chat_tokenizer):
    """One global batch of 4 blocks holding the embedded set's 6 shortest pairs, 2, 2, 1 and 1 to a block."""
    rows, _ = tokenize_pairs(embedded_records(), chat_tokenizer, None)
    rows = sorted(rows, key=lambda r: len(r[0]) + len(r[2]))[:6]
    blocks, stats = pack_pairs(rows, 448, chat_tokenizer.pad_token_id)
    assert stats.kept == 6 and stats.truncated == 0
    return blocks.select(np.argsort(-pair_counts(blocks), kind="stable").tolist())


@pytest.mark.parametrize("blocks_per_micro", [1, 2, 4])
def test_a_dpo_step_is_the_mean_over_the_global_batch_pairs_whatever_the_accumulation(
        blocks_per_micro, pair_blocks, tiny_model, chat_tokenizer):
    """DPO on pairs packed unevenly into blocks, one global batch cut into micro-batches of 1, 2 or 4 blocks: the
    accumulated gradient is that of the mean loss over all its pairs (one plain-autograd forward of the whole
    batch), not a mean of the micro-batches' means, which weights a pair of a sparse micro-batch more."""
    objective = PreferenceLoss("dpo", beta=0.1)
    reference = tiny_model("llama", seed=0, tokenizer=chat_tokenizer, initializer_range=INIT_RANGE)

    def make_policy():  # moved away from its reference, so that the pairs' losses differ
        policy = copy.deepcopy(reference)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        return policy.train()

    accumulation = len(pair_blocks) // blocks_per_micro
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    # the reference pass as the trainer runs it, before the policy is prepared
    blocks = with_reference(pair_blocks, reference_logps(accelerator, reference, pair_blocks, 2, "sdpa"))
    blocks = blocks.with_format("numpy")
    counts = pair_counts(blocks)
    pairs = int(counts.sum())
    cuts = range(0, len(blocks), blocks_per_micro)
    micro = [collate_pairs(blocks[i:i + blocks_per_micro], "sdpa") for i in cuts]
    micro_pairs = [int(counts[i:i + blocks_per_micro].sum()) for i in cuts]
    assert counts.tolist() == [2, 2, 1, 1] and len(micro) == accumulation
    assert accumulation == 1 or len(set(micro_pairs)) > 1, micro_pairs  # a mean of micro-batch means would be off

    expected_model = make_policy()
    expected_sum, expected_stats = objective.sums(expected_model, collate_pairs(blocks[:], "sdpa"))
    assert expected_stats[3].item() == pairs == 6
    (expected_sum / pairs).backward()
    expected = {n: p.grad.clone() for n, p in expected_model.named_parameters()}
    tolerance = 1e-5 * max(g.abs().max().item() for g in expected.values())
    if accumulation > 1:  # the per-micro-batch mean this step must not be
        naive_model = make_policy()
        for batch, n in zip(micro, micro_pairs, strict=True):
            (objective.sums(naive_model, batch)[0] / n / accumulation).backward()
        off = max((p.grad - expected[name]).abs().max().item() for name, p in naive_model.named_parameters())
        assert off > 100 * tolerance, (off, tolerance)

    model = make_policy()
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    scale = backward_scale(pairs, accelerator.num_processes, accumulation)
    loss_sum, _, nonfinite, extras = optimizer_step(accelerator, model, optimizer, micro, scale, 0.0,
                                                    objective=objective)
    assert nonfinite is None
    assert loss_sum.item() == pytest.approx(expected_sum.item(), rel=1e-6)
    assert extras[1:].tolist() == pytest.approx(expected_stats.tolist(), rel=1e-6)  # after the router's sum
    # SGD: the weights moved by exactly -lr * (the accumulated gradient)
    initial = dict(make_policy().named_parameters())
    for name, p in accelerator.unwrap_model(model).named_parameters():
        torch.testing.assert_close((initial[name] - p) / LR, expected[name], rtol=1e-4, atol=tolerance,
                                   msg=lambda m, name=name: f"{name}: {m}")
