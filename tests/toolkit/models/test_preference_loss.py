"""The preference objectives against TRL, and packed against unpacked.

TRL's DPOTrainer computes its loss, rewards and gradients on the same tiny model, pairs and beta from its
own padded batch (its collator, its `compute_loss`, its reference copy of the model); the toolkit's come
from one pair per block (unpacked) and from pairs packed several to a block: all three agree within fp32
rounding. SimPO and ORPO have no reference: packed equals unpacked, and their losses equal TRL's formulas
(its CPO trainer's simpo loss, its ORPO trainer's odds ratio) on the same answers' log-probabilities.
Packed pairs score as they do one to a row under flex_attention and, joined into one row, under varlen attention.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from toolkit.data.packing import block_causal_mask
from toolkit.data.preference import (
    collate_pairs,
    embedded_records,
    pack_pairs,
    tokenize_pairs,
    with_reference,
)
from toolkit.models.preference_loss import PreferenceLoss, sequence_sums, token_logps

BETA = 0.1


@pytest.fixture(scope="module")
def pairs(chat_tokenizer):
    """Six tokenized pairs of the embedded set (multi-turn prompts and non-answers among them)."""
    rows, _ = tokenize_pairs(embedded_records()[:6], chat_tokenizer, None)
    return rows


def blocks_of(rows, seq_len, tok):
    blocks, _ = pack_pairs(rows, seq_len, tok.pad_token_id)
    return blocks


def reference_column(model, blocks, attn: str = "sdpa"):
    """What the reference pass stores: the untrained model's log-probability of each target."""
    with torch.no_grad():
        logps = token_logps(model, collate_pairs(blocks.with_format("numpy")[:], attn))
    return with_reference(blocks, logps.numpy())


def moved_away(model):
    """A copy of `model` a little away from it (a policy some steps from its reference), so that rewards are not 0."""
    policy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return policy


def pair_order(blocks, rows) -> list[int]:
    """Each pair's index in `rows`, in the order sequence_sums gives the pairs of the collated blocks."""
    index = {(tuple(c), tuple(r)): i for i, (c, _, r, _) in enumerate(rows)}
    cols = blocks.with_format("numpy")[:]
    order = []
    for ids, seq, n in zip(cols["input_ids"], cols["sequence"], cols["pairs"], strict=True):
        order += [index[tuple(ids[seq == 2 * k].tolist()), tuple(ids[seq == 2 * k + 1].tolist())] for k in range(n)]
    return order


def alone(model, blocks, rows, loss):
    """(mean DPO loss, per-pair summed log-probabilities in `rows` order) from one pair per row under sdpa."""
    batch = collate_pairs(blocks.with_format("numpy")[:], "sdpa")
    with torch.no_grad():
        total, stats = loss.sums(model, batch)
        logps, _ = sequence_sums(batch, token_logps(model, batch))
    assert stats[3].item() == len(rows)
    by_row = torch.empty_like(logps)
    by_row[pair_order(blocks, rows)] = logps
    return (total / stats[3]).item(), by_row


def toolkit_loss(model, blocks, loss: PreferenceLoss):
    """(mean loss over the pairs, per-pair chosen and rejected rewards, gradients) from the packed blocks."""
    model.zero_grad()
    batch = collate_pairs(blocks.with_format("numpy")[:], "sdpa")
    total, stats = loss.sums(model, batch)
    (total / stats[3]).backward()
    with torch.no_grad():
        logps, counts = sequence_sums(batch, token_logps(model, batch))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (total / stats[3]).item(), stats, logps, counts, grads


def trl_loss(model, reference, tokenizer, rows, tmp_path):
    """TRL's DPOTrainer on the same pairs, as its collator pads them: (loss, rewards/chosen mean, grads)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    examples = []
    for ids_c, lab_c, ids_r, lab_r in rows:
        start_c = next(i for i, x in enumerate(lab_c) if x != -100)
        start_r = next(i for i, x in enumerate(lab_r) if x != -100)
        assert start_c == start_r and ids_c[:start_c] == ids_r[:start_r]  # one prompt, then each answer
        examples.append({"prompt_ids": ids_c[:start_c], "chosen_ids": ids_c[start_c:], "rejected_ids": ids_r[start_r:]})
    args = DPOConfig(output_dir=str(tmp_path), beta=BETA, report_to=[], per_device_train_batch_size=len(rows),
                     use_cpu=True, bf16=False, max_length=None, disable_tqdm=True)
    dataset = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # unread: the batch is built below
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, processing_class=tokenizer,
                         train_dataset=dataset)
    batch = trainer.data_collator(examples)
    model.zero_grad()
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_dpo_equals_trl_unpacked_and_packed(tiny_model, chat_tokenizer, pairs, tmp_path):
    torch.manual_seed(0)
    reference = tiny_model("llama", tokenizer=chat_tokenizer)
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # the policy a little away from its reference, so that rewards are not 0
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    loss = PreferenceLoss("dpo", BETA)
    longest = max(len(a) + len(c) for a, _, c, _ in pairs)
    unpacked = reference_column(reference, blocks_of(pairs, longest, chat_tokenizer))
    packed = reference_column(reference, blocks_of(pairs, 4 * longest, chat_tokenizer))
    assert len(unpacked) == len(pairs) > len(packed)  # one pair a block, against several

    ours = toolkit_loss(policy, unpacked, loss)
    ours_packed = toolkit_loss(policy, packed, loss)
    theirs, metrics, their_grads = trl_loss(policy, reference, chat_tokenizer, pairs, tmp_path)

    # TRL sums each answer's ~100 log-probabilities in fp32, the toolkit in fp64: 5e-6 apart here, while a token
    # counted on the wrong side or a prompt token counted moves the loss by ~1e-2
    assert ours[0] == pytest.approx(theirs, rel=2e-5)
    assert ours_packed[0] == pytest.approx(ours[0], rel=1e-6)
    pairs_n = ours[1][3].item()
    assert pairs_n == len(pairs)
    # a reward is beta x the difference of two such sums: the same fp32 rounding, in absolute terms
    assert ours[1][0].item() / pairs_n == pytest.approx(metrics["rewards/chosen"], abs=2e-5)
    assert ours[1][1].item() / pairs_n == pytest.approx(metrics["rewards/rejected"], abs=2e-5)
    assert ours[1][2].item() / pairs_n == pytest.approx(metrics["rewards/accuracies"])
    assert abs(metrics["rewards/margins"]) > 1e-4  # a real difference was compared
    for name, grad in their_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(ours[4][name], grad, rtol=1e-3, atol=2e-5 * scale, msg=name)
        torch.testing.assert_close(ours_packed[4][name], ours[4][name], rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_reference_free_objectives_packed_equal_unpacked_and_their_formula(objective, tiny_model, chat_tokenizer,
                                                                            pairs):
    model = tiny_model("llama", tokenizer=chat_tokenizer)
    loss = PreferenceLoss(objective, beta=2.0, gamma=0.5, orpo_lambda=0.3)
    longest = max(len(a) + len(c) for a, _, c, _ in pairs)
    unpacked = toolkit_loss(model, blocks_of(pairs, longest, chat_tokenizer), loss)
    packed = toolkit_loss(model, blocks_of(pairs, 4 * longest, chat_tokenizer), loss)
    assert packed[0] == pytest.approx(unpacked[0], rel=1e-5)
    for name, grad in unpacked[4].items():
        torch.testing.assert_close(packed[4][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # the formula is TRL's (its CPO trainer's simpo loss, its ORPO trainer's odds-ratio term), given the same
    # length-normalised log-probabilities of each answer; ORPO's first term is each pair's mean loss on its chosen
    # answer (docs/preference.md)
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    mean = (unpacked[2] / unpacked[3]).float()
    device = SimpleNamespace(device="cpu")
    if objective == "simpo":
        trl = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=0.0,
                              accelerator=device)
        expected, chosen, _ = CPOTrainer.cpo_loss(trl, mean[:, 0], mean[:, 1])
    else:
        odds, chosen, *_ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.3, accelerator=device), mean[:, 0],
                                                       mean[:, 1])
        expected = -mean[:, 0] - odds
    assert unpacked[0] == pytest.approx(expected.mean().item(), rel=1e-5)
    if objective == "simpo":  # ORPO's rewards are TRL's at its beta, which is the toolkit's lambda: not compared
        assert unpacked[1][0].item() == pytest.approx(chosen.sum().item(), rel=1e-5)


def test_a_policy_equal_to_its_reference_has_loss_log2_and_no_reward(tiny_model, chat_tokenizer, pairs):
    model = tiny_model("llama", tokenizer=chat_tokenizer)
    blocks = reference_column(model, blocks_of(pairs, 512, chat_tokenizer))
    loss, stats, *_ = toolkit_loss(model, blocks, PreferenceLoss("dpo", BETA))
    assert loss == pytest.approx(math.log(2), rel=1e-6)
    assert stats.tolist() == [0.0, 0.0, 0.0, len(pairs)]


def test_packed_pairs_under_flex_attention_score_as_one_pair_a_row(tiny_model, chat_tokenizer, pairs):
    """flex_attention (forward only: torch has no CPU backward for it) keeps a block's answers apart from each other
    as sdpa's mask does: each answer's summed log-probability and DPO's loss, the reference pass run under flex
    too, equal those of one pair per row under sdpa."""
    reference = tiny_model("llama", tokenizer=chat_tokenizer)
    policy = moved_away(reference)
    loss = PreferenceLoss("dpo", BETA)
    longest = max(len(a) + len(c) for a, _, c, _ in pairs)
    unpacked = reference_column(reference, blocks_of(pairs, longest, chat_tokenizer))
    expected_loss, expected = alone(policy, unpacked, pairs, loss)

    packed = blocks_of(pairs, 2 * longest, chat_tokenizer)
    assert len(packed) < len(pairs)
    for model in (reference, policy):
        model.set_attn_implementation("flex_attention")
    packed = reference_column(reference, packed, "flex_attention")
    batch = collate_pairs(packed.with_format("numpy")[:], "flex_attention")
    assert "attention_mask" not in batch and policy.config._attn_implementation == "flex_attention"
    with torch.no_grad():
        total, stats = loss.sums(policy, batch)
        logps, _ = sequence_sums(batch, token_logps(policy, batch))
        # Control: sdpa with a causal mask that lets a block's answers see each other gives other sums
        policy.set_attn_implementation("sdpa")
        causal = torch.ones(batch["input_ids"].shape[1], batch["input_ids"].shape[1], dtype=torch.bool).tril()
        leaky, _ = sequence_sums(batch, token_logps(policy, batch | {"attention_mask": causal.expand(
            len(packed), 1, *causal.shape)}))
    order = pair_order(packed, pairs)
    assert stats[3].item() == len(pairs)
    torch.testing.assert_close(logps, expected[order], rtol=1e-6, atol=1e-4)
    assert (total / stats[3]).item() == pytest.approx(expected_loss, rel=1e-5)
    assert (leaky - expected[order]).abs().max() > 1e-1


def test_packed_pairs_joined_into_one_row_for_varlen_attention_score_as_row_by_row(tiny_model, chat_tokenizer,
                                                                                    pairs):
    """Varlen attention (flash_attention_2) gets the micro-batch's rows joined into one, documents read from position
    ids that restart at each answer: the reference pass, each answer's summed log-probability, DPO's loss and its
    gradients equal those of the rows apart, and of one pair per row. (flash-attention needs CUDA: the joined row
    goes through sdpa with the mask its own position ids give, which is what varlen attention computes.)"""
    reference = tiny_model("llama", tokenizer=chat_tokenizer)
    policy = moved_away(reference)
    loss = PreferenceLoss("dpo", BETA)
    longest = max(len(a) + len(c) for a, _, c, _ in pairs)
    _, alone_logps = alone(policy, reference_column(reference, blocks_of(pairs, longest, chat_tokenizer)), pairs, loss)
    packed = blocks_of(pairs, 2 * longest, chat_tokenizer)
    rows, seq_len = len(packed), len(packed[0]["input_ids"])
    assert 1 < rows < len(pairs)

    def joined(blocks):
        flat = collate_pairs(blocks.with_format("numpy")[:], "flash_attention_2")
        assert {k: tuple(v.shape) for k, v in flat.items()} == {k: (1, rows * seq_len) for k in flat}
        return flat | {"attention_mask": block_causal_mask(flat["position_ids"])}

    # the reference pass under varlen attention: one row's log-probabilities, cut back into the blocks' rows
    with torch.no_grad():
        flat_reference = token_logps(reference, joined(packed)).reshape(rows, seq_len)
    packed = reference_column(reference, packed)
    torch.testing.assert_close(torch.as_tensor(packed.with_format("numpy")[:]["ref_logps"]), flat_reference,
                               rtol=0, atol=1e-5)

    results = []
    for batch in (collate_pairs(packed.with_format("numpy")[:], "sdpa"), joined(packed)):
        policy.zero_grad()
        total, stats = loss.sums(policy, batch)
        (total / stats[3]).backward()
        with torch.no_grad():
            logps, _ = sequence_sums(batch, token_logps(policy, batch))
        results.append((total.item(), stats, logps, {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (row_total, row_stats, row_logps, row_grads), (flat_total, flat_stats, flat_logps, flat_grads) = results
    assert flat_stats[3].item() == row_stats[3].item() == len(pairs)
    torch.testing.assert_close(flat_logps, row_logps, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(flat_logps, alone_logps[pair_order(packed, pairs)], rtol=1e-6, atol=1e-4)
    assert flat_total == pytest.approx(row_total, rel=1e-5)
    torch.testing.assert_close(flat_stats, row_stats, rtol=1e-5, atol=1e-6)
    for name, grad in row_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item(), msg=name)
    # Control: the joined row under a plain causal mask, each answer seeing the rows and answers before it
    flat = joined(packed)
    causal = torch.ones(rows * seq_len, rows * seq_len, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        leaky, _ = sequence_sums(flat, token_logps(policy, flat | {"attention_mask": causal}))
    assert (leaky - row_logps).abs().max() > 1e-1
