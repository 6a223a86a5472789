"""Launched on N processes (torchrun, gloo) by test_tensor_parallel.py: a tiny LLaMA split over the N
ranks against the same model whole, on every rank, on a fixed batch: the loss, the gradient norm, and
the loss after one AdamW step. Rank 0 writes them to the JSON file named by argv[1]."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from toolkit.strategy.tensor_parallel import split

torch.set_num_threads(1)
dist.init_process_group("gloo")
tp = dist.get_world_size()
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


def run(model) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    return {"loss": loss.item(), "grad_norm": norm.item(), "loss_after_step": after.item(), "kinds": kinds}


torch.manual_seed(0)
whole = run(AutoModelForCausalLM.from_config(config))
torch.manual_seed(0)  # the split slices each rank's own copy: the same seed everywhere
model = split(AutoModelForCausalLM.from_config(config), tp)
q = model.model.layers[0].self_attn.q_proj.weight
tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
result = {"tp": tp, "whole": whole, "split": run(model), "q_local_rows": q.to_local().shape[0], "tied": tied}
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
