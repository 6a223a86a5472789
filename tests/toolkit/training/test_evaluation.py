"""Held-out loss in one process with a real Accelerator: the mean next-token loss over the blocks'
documents, computed here by hand one document piece at a time (no packing mask involved)."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from toolkit.data.packing import IGNORE_INDEX, collate, column, packed_dataset, target_counts
from toolkit.training.evaluation import evaluate

SEQ_LEN = 32
# A wider init than the default 0.02 makes token losses differ, so a wrong weighting shows.
INIT_RANGE = 0.2


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory) -> datasets.Dataset:
    """~12 packed blocks: long and very short documents, the last block padded."""
    texts = [tiny_texts[1][:500], "a", "x = 1", tiny_texts[6][:200], "Hi.", tiny_texts[8][:130]]
    docs = datasets.Dataset.from_dict({"text": texts})
    cache = tmp_path_factory.mktemp("packed")
    out = packed_dataset(docs, tiny_tokenizer, SEQ_LEN, cache, source_fingerprint="eval-test")
    assert 8 <= len(out) <= 40 and int(column(out, "num_tokens")[-1]) < SEQ_LEN
    return out


@pytest.fixture
def model(tiny_model, tiny_tokenizer):
    return tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE)


def hand_loss(model, blocks: datasets.Dataset, n: int) -> tuple[float, int]:
    """(sum of next-token losses, number of targets) over the first n blocks, one document piece at
    a time: each run of tokens between position-id restarts, before the padding, on its own."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            ids = torch.as_tensor(column(blocks, "input_ids")[i], dtype=torch.long)
            pos = column(blocks, "position_ids")[i]
            real = int(column(blocks, "num_tokens")[i])
            starts = [t for t in range(real) if pos[t] == 0] + [real]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                if b - a < 2:
                    continue
                logits = model(input_ids=ids[None, a:b]).logits[0].double()
                logp = F.log_softmax(logits[:-1], dim=-1)
                total += -logp.gather(1, ids[a + 1 : b, None]).sum().item()
                count += b - a - 1
    return total, count


def run(model, blocks, micro_batch: int, max_blocks: int, **kwargs) -> dict[str, float]:
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model)
    return evaluate(accelerator, prepared, blocks, micro_batch, max_blocks, "sdpa", **kwargs)


def test_eval_loss_is_the_mean_token_loss_over_all_blocks(model, blocks):
    total, count = hand_loss(model.eval(), blocks, len(blocks))
    assert count == int(target_counts(blocks).sum())
    result = run(model, blocks, micro_batch=4, max_blocks=0)
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["eval_ppl"] == pytest.approx(math.exp(result["eval_loss"]), rel=1e-12)
    assert 1 < result["eval_loss"] < 20


@pytest.mark.parametrize("micro_batch", [1, 3, 5])
def test_the_micro_batch_does_not_change_the_loss(model, blocks, micro_batch):
    reference = run(model, blocks, micro_batch=len(blocks), max_blocks=0)["eval_loss"]
    assert run(model, blocks, micro_batch=micro_batch, max_blocks=0)["eval_loss"] == pytest.approx(
        reference, rel=1e-6
    )


def test_max_blocks_takes_the_first_blocks(model, blocks):
    total, count = hand_loss(model.eval(), blocks, 5)
    assert count == int(target_counts(blocks)[:5].sum())
    result = run(model, blocks, micro_batch=2, max_blocks=5)
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    everything = run(model, blocks, micro_batch=2, max_blocks=0)["eval_loss"]
    assert result["eval_loss"] != pytest.approx(everything, rel=1e-4)  # 5 blocks really are fewer
    # more than there are: all of them
    assert run(model, blocks, micro_batch=2, max_blocks=len(blocks) + 10)["eval_loss"] == pytest.approx(
        everything, rel=1e-9
    )


def test_evaluate_leaves_the_model_training_without_gradients(model, blocks):
    model.train()
    run(model, blocks, micro_batch=4, max_blocks=3)
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_evaluation_runs_in_eval_mode(tiny_model, tiny_tokenizer, blocks):
    """With dropout on, a train-mode forward would be random; evaluate gives one answer."""
    model = tiny_model(
        "llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE, attention_dropout=0.5
    )
    total, count = hand_loss(model.eval(), blocks, 4)
    model.train()
    results = {run(model, blocks, micro_batch=2, max_blocks=4)["eval_loss"] for _ in range(2)}
    assert len(results) == 1
    assert results.pop() == pytest.approx(total / count, rel=1e-5)


def test_a_custom_collate_counts_only_its_labels(model, blocks):
    """Chat blocks keep only some targets (collate_chat); the mean is over those alone."""

    def second_half_only(columns: dict, attn: str) -> dict[str, torch.Tensor]:
        batch = collate(columns, attn)
        batch["labels"][:, : SEQ_LEN // 2] = IGNORE_INDEX
        return batch

    model.eval()
    with torch.no_grad():
        total, count = 0.0, 0
        for i in range(6):
            batch = second_half_only(blocks[[i]], "sdpa")
            logp = F.log_softmax(
                model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0].double(), -1
            )
            for t in range(1, SEQ_LEN):
                if batch["labels"][0, t] != IGNORE_INDEX:
                    total -= logp[t - 1, batch["labels"][0, t]].item()
                    count += 1
    result = run(model, blocks, micro_batch=4, max_blocks=6, collate_fn=second_half_only)
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_a_mixtures_held_out_loss_is_each_sources_and_their_token_weighted_mean(model, blocks):
    """data.sources: eval_loss/<name> per source, and eval_loss over all of them, which is their mean weighted by
    each source's targets (the first max_blocks blocks of each)."""
    first, second = blocks.select(range(0, 5)), blocks.select(range(5, len(blocks)))
    (l1, t1), (l2, t2) = hand_loss(model.eval(), first, 4), hand_loss(model.eval(), second, 4)
    result = run(model, {"web": first, "code": second}, micro_batch=2, max_blocks=4)
    assert set(result) == {"eval_loss", "eval_ppl", "eval_loss/web", "eval_loss/code", "eval_tokens/web",
                           "eval_tokens/code"}
    assert (result["eval_tokens/web"], result["eval_tokens/code"]) == (t1, t2)
    assert result["eval_loss/web"] == pytest.approx(l1 / t1, rel=1e-5)
    assert result["eval_loss/code"] == pytest.approx(l2 / t2, rel=1e-5)
    assert abs(result["eval_loss/web"] - result["eval_loss/code"]) > 0.01  # the weighting below can show
    assert result["eval_loss"] == pytest.approx((l1 + l2) / (t1 + t2), rel=1e-5)
    assert result["eval_ppl"] == pytest.approx(math.exp(result["eval_loss"]), rel=1e-12)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_a_rank_short_of_blocks_counts_no_filler_row(model, blocks, attn):
    """Rank 1 of 2 over 5 blocks holds blocks 1 and 3; with micro-batch 3 it runs a third row (block 0) that must
    count for nothing, also where varlen attention has joined the rows into one (the collate's layout is what is
    checked: the model here runs sdpa either way)."""
    from toolkit.training.evaluation import held_out_sums

    _, targets = held_out_sums(Accelerator(cpu=True), model, blocks, 3, 5, attn, data_ranks=(2, 1))
    assert targets == int(target_counts(blocks)[[1, 3]].sum())


class Counted:
    """A pass's bar that counts its updates."""

    def __init__(self):
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


@pytest.mark.parametrize(("micro_batch", "max_blocks", "ranks"), [(2, 0, (1, 0)), (3, 5, (2, 1)), (4, 7, (3, 2)),
                                                                   (5, 4, (1, 0))])
def test_an_evaluation_s_bar_reaches_the_total_its_phase_was_given(model, blocks, micro_batch, max_blocks, ranks):
    """Trainer.evaluate gives the bar forwards(...) as its total: the ETA is right only if the pass updates it that
    many times, on each rank (a mixture: over every source)."""
    from toolkit.training.evaluation import forwards, held_out_sums

    bar = Counted()
    held_out_sums(Accelerator(cpu=True), model, blocks, micro_batch, max_blocks, "sdpa", data_ranks=ranks, bar=bar)
    assert bar.n == forwards(blocks, micro_batch, max_blocks, ranks[0]) > 0
    mixture, bar = {"web": blocks, "code": blocks.select(range(3))}, Counted()
    evaluate(Accelerator(cpu=True), model, mixture, micro_batch, max_blocks, "sdpa", data_ranks=ranks, bar=bar)
    assert bar.n == forwards(mixture, micro_batch, max_blocks, ranks[0]) > forwards(blocks, micro_batch, max_blocks,
                                                                                       ranks[0])
