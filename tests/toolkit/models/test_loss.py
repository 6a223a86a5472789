"""Loss normalisation: accumulation and data parallelism must not change the loss or the gradient.

The recipe's path (recipes/pretrain.py): every micro-batch backwards
`forward_loss_sum(model, batch) * backward_scale(global_targets, world_size, accum)` under
`accelerator.accumulate(model)`. Micro-batches here hold DIFFERENT numbers of target tokens,
which is exactly where averaging per micro-batch (transformers issue #34191) goes wrong.
"""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from toolkit.data.packing import IGNORE_INDEX, collate, pack_documents, target_counts, tokenize_documents
from toolkit.models.loss import backward_scale, forward_loss_sum, token_loss_sum

SEQ_LEN = 32
MICRO = 2
ACCUM = 4
# A wider init than the default 0.02 makes token losses vary (a default-init model predicts ~uniformly,
# so every micro-batch mean is ~log(vocab) and mean-of-means would hide behind the tolerance).
INIT_RANGE = 0.2


@pytest.fixture(scope="module")
def setup(tiny_texts, tiny_tokenizer):
    """8 packed blocks ordered so that the 4 micro-batches of 2 have very different target counts."""
    long_doc = tiny_texts[2][:300]  # fills several blocks with one document: 31 targets per block
    tiny_docs = list("abcdefghijklmnopqrstuvwxyz0123456789ABCD")  # 2 tokens each: 1 target, 1 start
    texts = [long_doc, *tiny_docs, tiny_texts[4][:350], "the end."]
    tokenized = tokenize_documents(datasets.Dataset.from_dict({"text": texts}), tiny_tokenizer)
    blocks = pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id).with_format("numpy")
    counts = target_counts(blocks)
    order = np.argsort(counts, kind="stable")
    # micro-batch 0: the two blocks with the fewest targets; 1: the two with the most; 2 and 3 mixed
    chosen = [order[0], order[1], order[-1], order[-2], order[2], order[-3], order[3], order[-4]]
    micro_idx = [chosen[i : i + MICRO] for i in range(0, len(chosen), MICRO)]
    micro_batches = [collate(blocks[list(idx)], "sdpa") for idx in micro_idx]
    full_batch = collate(blocks[list(chosen)], "sdpa")
    global_targets = int(counts[chosen].sum())
    micro_targets = [int(counts[idx].sum()) for idx in micro_idx]
    return dict(
        micro=micro_batches, full=full_batch, global_targets=global_targets, micro_targets=micro_targets
    )


@pytest.fixture(scope="module")
def make_model(tiny_model, tiny_tokenizer):
    """The same initial weights every call (seeded): a 2-layer LLaMA, hidden 64, fp32."""
    return lambda: tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE)


def fresh_accelerator(accum: int) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=accum)


@pytest.fixture(autouse=True)
def _reset_accelerate(monkeypatch):
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_step(make_model, batches, global_targets: int, accum: int, world_size: int = 1):
    """One optimizer step exactly as recipes/pretrain.py runs it; returns (loss, grads at sync)."""
    acc = fresh_accelerator(accum)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = acc.prepare(model, optimizer)
    model.train()
    scale = backward_scale(global_targets, world_size, accum)
    loss_sum = torch.zeros((), dtype=torch.float64)
    grads, syncs = None, []
    for batch in batches:
        with acc.accumulate(model):
            micro_loss = forward_loss_sum(model, batch)
            acc.backward(micro_loss * scale)
            loss_sum += micro_loss.detach().double()
            syncs.append(acc.sync_gradients)
            if acc.sync_gradients:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert syncs == [False] * (accum - 1) + [True]  # one optimizer step, after the last micro-batch
    return loss_sum.item() / global_targets, grads


def assert_grads_close(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_micro_batches_have_unequal_targets(setup):
    micro_targets = setup["micro_targets"]
    assert sum(micro_targets) == setup["global_targets"]
    assert max(micro_targets) >= 1.5 * min(micro_targets), micro_targets
    # target_counts agrees with the labels the loss actually uses (after the shift)
    for batch, n in zip(setup["micro"], micro_targets, strict=True):
        assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == n


def test_accumulation_matches_one_big_batch(setup, make_model):
    loss_acc, grads_acc = train_step(make_model, setup["micro"], setup["global_targets"], ACCUM)
    loss_ref, grads_ref = train_step(make_model, [setup["full"]], setup["global_targets"], 1)
    assert loss_acc == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_close(grads_acc, grads_ref)


def test_data_parallel_split_matches_one_big_batch(setup, make_model):
    """2 ranks x 2 micro-batches, gradients averaged as DDP does, equal the 1-process batch of 8."""
    world = 2
    per_rank = ACCUM // world
    losses, grads = [], []
    for rank in range(world):
        mine = setup["micro"][rank * per_rank : (rank + 1) * per_rank]
        loss, g = train_step(make_model, mine, setup["global_targets"], per_rank, world_size=world)
        losses.append(loss)
        grads.append(g)
    averaged = {n: sum(g[n] for g in grads) / world for n in grads[0]}  # DDP all-reduce mean
    loss_ref, grads_ref = train_step(make_model, [setup["full"]], setup["global_targets"], 1)
    assert sum(losses) == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_close(averaged, grads_ref)


def test_naive_mean_of_means_differs(setup, make_model):
    """Negative control: the per-micro-batch mean (#34191) is measurably wrong on this data."""
    model = make_model().train()
    sums = [forward_loss_sum(model, b) for b in setup["micro"]]
    correct = sum(sums) / setup["global_targets"]
    naive = sum(s / n for s, n in zip(sums, setup["micro_targets"], strict=True)) / len(sums)
    assert abs(naive.item() - correct.item()) > 1e-3 * correct.item()

    # and its gradient differs from the correct one far beyond the tolerance used above
    model.zero_grad()
    correct.backward(retain_graph=True)
    g_correct = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    naive.backward()
    g_naive = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (g_naive - g_correct).norm() > 1e-2 * g_correct.norm()


def test_token_loss_sum_is_shifted_sum():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX, 4], [IGNORE_INDEX, 6, 0, 3, IGNORE_INDEX]])
    expected = sum(
        -torch.log_softmax(logits[b, t - 1], -1)[labels[b, t]]
        for b in range(2)
        for t in range(1, 5)
        if labels[b, t] != IGNORE_INDEX
    )
    torch.testing.assert_close(token_loss_sum(logits, labels), expected)
