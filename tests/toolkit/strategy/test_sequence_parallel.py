"""Sequence parallelism (toolkit.strategy.sequence_parallel, DeepSpeed Ulysses): how a packed sequence
is split (contiguous parts, every position once, targets shifted before the split), what cannot be
split named in one line, and a tiny LLaMA on packed documents split over 2 processes giving the whole
model's loss, gradients and next loss, also with fewer key/value heads than ranks; without the
block-causal mask (DeepSpeed's own registration drops it under sdpa) the loss is not the same."""

from __future__ import annotations

import json

import numpy as np
import probe_ranks
import pytest
import torch
from transformers import AutoConfig

from toolkit.data.packing import IGNORE_INDEX, collate
from toolkit.strategy.sequence_parallel import SequenceParallel, problems


@pytest.mark.parametrize("sp", [2, 4])
def test_the_ranks_hold_contiguous_parts_with_their_targets(sp):
    positions = np.stack([np.concatenate([np.arange(5), np.arange(11)]), np.arange(16)])
    batch = collate({"input_ids": np.arange(32).reshape(2, 16) + 100, "position_ids": positions,
                     "num_tokens": np.array([16, 14])}, "sdpa")
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    held = []
    for rank in range(sp):
        shard = SequenceParallel.__new__(SequenceParallel)  # the split alone: no process group
        shard.sp, shard.sp_rank, shard.device = sp, rank, torch.device("cpu")
        part = shard.split(dict(batch))
        mine = slice(rank * 16 // sp, (rank + 1) * 16 // sp)
        assert sorted(part) == ["input_ids", "position_ids", "shift_labels"]  # no mask: attention rebuilds it
        torch.testing.assert_close(part["input_ids"], batch["input_ids"][:, mine])
        torch.testing.assert_close(part["position_ids"], batch["position_ids"][:, mine])
        # a part's last token predicts the first token of the next rank's part
        torch.testing.assert_close(part["shift_labels"], targets[:, mine])
        held.append(part["input_ids"])
    torch.testing.assert_close(torch.cat(held, dim=1), batch["input_ids"])


def test_what_cannot_be_split_is_named():
    llama = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    assert problems(llama, 1, 66, "flash_attention_2") == []  # sp 1 splits nothing
    assert problems(llama, 2, 64, "sdpa") == []
    assert problems(llama, 4, 64, "sdpa") == []  # key/value heads replicated to the ranks
    assert problems(llama, 2, 65, "flash_attention_2") == [
        "data.seq_len=65 is not divisible by parallelism_config_sp_size=2: each rank holds an equal part of every "
        "sequence; use a multiple of 2",
        "model.attn_implementation=flash_attention_2 cannot run sequence parallel here; use sdpa (the whole "
        "sequence's attention runs under packing's block-causal mask)",
    ]
    assert "has 4 attention heads, not divisible by parallelism_config_sp_size=3" in problems(llama, 3, 66, "sdpa")[0]
    odd_kv = AutoConfig.for_model("llama", hidden_size=384, num_attention_heads=6, num_key_value_heads=3)
    assert "3 key/value heads: parallelism_config_sp_size=2 must divide them" in problems(odd_kv, 2, 64, "sdpa")[0]
    moe = AutoConfig.for_model("qwen3_moe", num_experts=4)
    assert "sequence parallel with a mixture of experts (qwen3_moe)" in problems(moe, 2, 64, "sdpa")[0]
    windowed = AutoConfig.for_model("mistral", sliding_window=32)
    assert "sliding-window attention (mistral, sliding_window=32)" in problems(windowed, 2, 64, "sdpa")[0]
    assert "gpt2 does not pass position ids to its attention" in problems(AutoConfig.for_model("gpt2"), 2, 64, "sdpa")[0]


def run_probe(tmp_path, kv_heads: int, mask: str) -> dict:
    out = tmp_path / "result.json"
    proc = probe_ranks.run(probe_ranks.SUPPORT / "sequence_parallel_probe.py", [out, kv_heads, mask], nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # on CPU, SequenceParallel keeps DeepSpeed's comm from building its shared-memory kernel (~30 s on a new machine)
    assert "shm_comm" not in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: fewer key/value heads than ranks, replicated by the engine
def test_a_packed_batch_split_over_two_processes_trains_like_the_whole_one(tmp_path, kv_heads):
    result = run_probe(tmp_path, kv_heads, "block_causal")
    assert result["local"]["input_ids"] == [2, 32]
    # fp32 in another order, as test_context_parallel.py's assert_same_numbers derives: the loss to 1e-5,
    # the gradients to 1e-5 of their norms, the losses after the AdamW step to within the steps of the
    # weights whose gradient's sign is within its rounding (adam_step.py), every other weight's step alike
    assert result["split"]["loss"] == pytest.approx(result["whole"]["loss"], rel=1e-5)
    assert result["worst_grad_rel"] < 1e-5
    assert result["steps_apart"] == 0
    for key, bound in result["after_step_bound"].items():
        after = result["split"][key], result["whole"][key]
        assert abs(after[0] - after[1]) <= bound + 1e-5 * after[1], (key, after, bound)


@pytest.mark.distributed
def test_without_the_block_causal_mask_packed_documents_see_each_other(tmp_path):
    result = run_probe(tmp_path, 2, "causal")
    # a tiny random model attends almost evenly, so the loss moves little (rel ~2e-4), but far outside
    # the bound the masked split meets (~1e-7); its gradients are plainly wrong
    assert result["split"]["loss"] != pytest.approx(result["whole"]["loss"], rel=1e-5)
    assert result["worst_grad_rel"] > 1e-2, result["worst_grad_rel"]
