"""Run on 2 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_context_parallel.py: a tiny LLaMA on a packed batch
(several documents per row, 4-D block-causal mask) whole on every rank, and split over the 2 ranks by
toolkit.strategy.context_parallel: the summed token loss, the gradient of every weight, the loss after
one AdamW step. argv: result JSON path, device (cpu: gloo | cuda: a GPU per rank, NCCL), dtype
(float32 | bfloat16)."""

from __future__ import annotations

import json
import sys

import adam_step
import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.strategy.context_parallel import ContextParallel

out, dtype = sys.argv[1], getattr(torch, sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("nccl" if sys.argv[2] == "cuda" else "gloo")
device = torch.device("cuda", dist.get_rank()) if sys.argv[2] == "cuda" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
L = 64
LR, VOCAB = 1e-2, 512
# two rows of packed documents: (24, 30, 10) and (5, 59) tokens
positions = np.stack([np.concatenate([np.arange(24), np.arange(30), np.arange(10)]),
                      np.concatenate([np.arange(5), np.arange(59)])])
columns = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, (2, L)), "position_ids": positions,
           "num_tokens": np.array([L, L - 3])}  # the second row ends in 3 tokens of padding
batch = collate(columns, "sdpa")
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")


def run(model, batch) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = forward_loss_sum(model, {k: v.to(device) for k, v in batch.items()})
    loss.backward()
    total = loss.detach().float().clone()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    if split:
        dist.all_reduce(total)
        for g in grads.values():
            dist.all_reduce(g)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    optimizer.step()
    steps = {n: p.detach().float() - before[n] for n, p in model.named_parameters()}
    optimizer.zero_grad()
    after = forward_loss_sum(model, {k: v.to(device) for k, v in batch.items()})
    after.backward()  # the slope after the step, for adam_step.after_step_bound
    after = after.detach().float()
    if split:
        dist.all_reduce(after)
    slopes = {n: p.grad.float() for n, p in model.named_parameters()}
    return {"loss": total.item(), "loss_after_step": after.item(), "grads": grads, "steps": steps,
            "slopes": slopes}


torch.manual_seed(0)
split = False
whole = run(LlamaForCausalLM(config).to(device, dtype).train(), batch)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device, dtype).train()
cp = ContextParallel(2, device)
cp.apply(model)
split = True
shard = cp.split(batch)
parts = run(model, shard)
errors = {n: ((parts["grads"][n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in whole["grads"].items()}
if dist.get_rank() == 0:
    json.dump({"whole": {k: whole[k] for k in ("loss", "loss_after_step")},
               "split": {k: parts[k] for k in ("loss", "loss_after_step")},
               "local_tokens": list(shard["input_ids"].shape), "mask_rows": list(shard["attention_mask"].shape),
               "worst_grad_rel": max(errors.values()),
               "steps_apart": adam_step.steps_apart(parts["steps"], whole["steps"], whole["grads"], LR, VOCAB),
               "after_step_bound": adam_step.after_step_bound(whole["grads"], whole["slopes"], LR, VOCAB),
               "device": str(device), "dtype": str(dtype)}, open(out, "w"))
dist.destroy_process_group()
