"""Context parallelism (toolkit.strategy.context_parallel): how a packed sequence is split (every
position once, targets shifted before the split, mask rows = the packed block-causal mask's rows in
the ranks' order), what cannot be split named in one line, and a tiny LLaMA on packed documents split
over 2 processes giving the whole model's loss, gradients and next loss (CPU gloo; NCCL on 2 GPUs
where there are two: one GPU cannot hold two NCCL ranks, and gloo's functional collectives crash on
CUDA tensors in torch 2.11, both seen on an H100)."""

from __future__ import annotations

import json

import numpy as np
import probe_ranks
import pytest
import torch
from transformers import AutoConfig

from toolkit.data.packing import IGNORE_INDEX, block_causal_mask, collate
from toolkit.strategy.context_parallel import SequenceShard, problems


def packed_batch(length: int = 16) -> dict[str, torch.Tensor]:
    positions = np.stack([np.concatenate([np.arange(5), np.arange(length - 5)]), np.arange(length)])
    columns = {"input_ids": np.arange(2 * length).reshape(2, length) + 100, "position_ids": positions,
               "num_tokens": np.array([length, length - 2])}
    return collate(columns, "sdpa")


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ranks_hold_every_position_once_with_its_target_and_its_mask_rows(cp):
    batch = packed_batch()
    whole_mask = block_causal_mask(batch["position_ids"])[:, 0]
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    held = []
    for rank in range(cp):
        shard = SequenceShard(16, cp, rank, torch.device("cpu"))
        part = shard.split(dict(batch))
        assert part["input_ids"].shape == (2, 16 // cp)
        held += shard.mine.tolist()
        torch.testing.assert_close(part["input_ids"], batch["input_ids"][:, shard.mine])
        torch.testing.assert_close(part["position_ids"], batch["position_ids"][:, shard.mine])
        # the last token of a shard predicts a token another rank holds: shifted before the split
        torch.testing.assert_close(part["shift_labels"], targets[:, shard.mine])
        # keys arrive gathered rank after rank: the columns are the whole sequence in that order
        torch.testing.assert_close(part["attention_mask"][:, 0], whole_mask[:, shard.mine][:, :, shard.order])
    assert sorted(held) == list(range(16))
    # head-tail balance: rank 0 holds the first and the last chunk of the sequence
    first = SequenceShard(16, cp, 0, torch.device("cpu")).mine.tolist()
    chunk = 16 // (2 * cp)
    assert first == list(range(chunk)) + list(range(16 - chunk, 16))


def test_what_cannot_be_split_is_named():
    llama = AutoConfig.for_model("llama")
    assert problems(llama, 1, 66, "flash_attention_2") == []  # cp 1 splits nothing
    assert problems(llama, 2, 64, "sdpa") == []
    assert problems(llama, 2, 66, "flash_attention_2") == [
        "data.seq_len=66 is not divisible by 2 x parallelism_config_cp_size = 4: each rank holds two equal chunks "
        "of every sequence; use a multiple of 4",
        "model.attn_implementation=flash_attention_2 cannot run context parallel here; use sdpa (the gathered keys "
        "and values are attended under packing's block-causal mask)",
    ]
    moe = AutoConfig.for_model("qwen3_moe", num_experts=4)
    assert "context parallel with a mixture of experts (qwen3_moe)" in problems(moe, 2, 64, "sdpa")[0]
    windowed = AutoConfig.for_model("mistral", sliding_window=32)
    assert "sliding-window attention (mistral, sliding_window=32)" in problems(windowed, 2, 64, "sdpa")[0]
    assert problems(AutoConfig.for_model("qwen2"), 2, 64, "sdpa") == []  # a window it does not use


def run_probe(tmp_path, device: str, dtype: str) -> dict:
    out = tmp_path / "result.json"
    proc = probe_ranks.run(probe_ranks.SUPPORT / "context_parallel_probe.py", [out, device, dtype], nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_a_packed_batch_split_over_two_processes_trains_like_the_whole_one(tmp_path):
    result = run_probe(tmp_path, "cpu", "float32")
    assert result["local_tokens"] == [2, 32] and result["mask_rows"] == [2, 1, 32, 64]
    assert_same_numbers(result)


def assert_same_numbers(result: dict) -> None:
    """fp32 summed in another order (u = 2^-24): each of the ~120 token losses is a logsumexp of 512
    logits, off by u sqrt(512) = 1.4e-6 of itself even if all err one way: 1e-5 of the loss; a
    gradient is off by u sqrt(512) of its norm in each computation, 2.7e-6 -> 1e-5. The loss after
    the AdamW step moves by 2 lr |dL/dw| for each weight whose gradient's sign is within its
    rounding (adam_step.py; measured: 0, and 6e-5 with AVX2 kernels, of a bound of 0.024), plus the
    loss's 1e-5; every other weight steps alike."""
    assert result["split"]["loss"] == pytest.approx(result["whole"]["loss"], rel=1e-5)
    assert result["worst_grad_rel"] < 1e-5
    assert result["steps_apart"] == 0
    after = result["split"]["loss_after_step"], result["whole"]["loss_after_step"]
    bound = result["after_step_bound"] + 1e-5 * after[1]
    assert abs(after[0] - after[1]) <= bound, (after, bound)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("dtype", "rel"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_on_a_gpu_the_split_matches_the_whole_model(tmp_path, dtype, rel):
    result = run_probe(tmp_path, "cuda", dtype)
    for key in ("loss", "loss_after_step"):
        assert result["split"][key] == pytest.approx(result["whole"][key], rel=rel), key
    assert result["worst_grad_rel"] < rel * 5
