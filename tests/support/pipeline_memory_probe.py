"""Run on 2 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_estimate.py: what a pipeline stage holds, for the
memory model to be compared with. Rank 0 writes to the JSON file argv[1], for each rank: the bytes of
its stage's parameters, of its gradients after one step of MICRO_BATCHES micro-batches through the 1F1B
schedule, of AdamW's state after the update, and of the receive buffers torch keeps (hidden states,
position ids and gradients, per micro-batch).

The model is test_estimate.probe_model()'s with 3 layers (stage 0 takes the remainder: layers 0-1) and a
tied embedding/head (a copy on each end), fp32, as a stage trains (Accelerate adds no autocast to it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from toolkit.strategy.pipeline.stages import Pipeline  # noqa: E402

BATCH, SEQ, MICRO_BATCHES = 2, 32, 3
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=True)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # every rank builds the same model and keeps its stage
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32, attn_implementation="sdpa")
    pipeline = Pipeline(model, dist.get_world_size(), MICRO_BATCHES, "sdpa", torch.device("cpu"))
    params = list(pipeline.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}])
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=generator)
        batches.append({"input_ids": ids, "labels": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)})
    pipeline.step(batches, 1.0 / (MICRO_BATCHES * BATCH * SEQ))
    grads = nbytes(p.grad for p in params)
    optimizer.step()
    stage = pipeline.stage
    received = [info.buffer for infos in stage.args_recv_info.values() for info in infos]
    received += [info.buffer for infos in stage.grad_recv_info.values() for info in infos]
    result = {"stage": pipeline.index, "batch": BATCH, "seq": SEQ, "micro_batches": MICRO_BATCHES,
              "params": nbytes(params), "grads": grads,
              "optimizer": sum(nbytes(s.values()) for s in optimizer.state.values()), "buffers": nbytes(received)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
