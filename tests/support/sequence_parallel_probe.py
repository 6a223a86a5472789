"""Run on 2 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_sequence_parallel.py: a tiny LLaMA on a packed
batch (several documents per row) whole on every rank, and split over the 2 ranks by
toolkit.strategy.sequence_parallel (DeepSpeed Ulysses): the summed token loss, the gradient of every
weight, the loss after one AdamW step, and the loss of a batch of another size (evaluation's).
argv: result JSON path, key/value heads, mask (block_causal: the toolkit's | causal: what DeepSpeed's
own registration keeps, packed documents seeing each other)."""

from __future__ import annotations

import json
import sys

import adam_step
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import toolkit.strategy.sequence_parallel as sequence_parallel
from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.parallelism import device_mesh

out, kv_heads, mask = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo")
device = torch.device("cpu")
L = 64
LR, VOCAB = 1e-2, 512
# two rows of packed documents: (24, 30, 10) and (5, 59) tokens
positions = np.stack([np.concatenate([np.arange(24), np.arange(30), np.arange(10)]),
                      np.concatenate([np.arange(5), np.arange(59)])])
columns = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, (2, L)), "position_ids": positions,
           "num_tokens": np.array([L, L - 3])}  # the second row ends in 3 tokens of padding
batch = collate(columns, "sdpa")
single = {k: v[:1] for k, v in batch.items()}  # a batch of one row: the engine's shapes change
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv_heads, max_position_embeddings=128, attn_implementation="sdpa")


def causal_only(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def summed(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if split:
        dist.all_reduce(value)
    return value.item()


def run(model, batch, single) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = forward_loss_sum(model, batch)
    loss.backward()
    total = summed(loss)
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    if split:
        for g in grads.values():
            dist.all_reduce(g)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    steps = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    optimizer.zero_grad()
    # the slopes after the step of the two losses compared, for adam_step.after_step_bound
    after = forward_loss_sum(model, batch)
    after.backward()
    slopes = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    other = forward_loss_sum(model.eval(), single)
    other.backward()
    single_slopes = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": total, "loss_after_step": summed(after), "single_row": summed(other), "grads": grads,
            "steps": steps, "slopes": slopes, "single_slopes": single_slopes}


torch.manual_seed(0)
split = False
whole = run(LlamaForCausalLM(config).train(), batch, single)
torch.manual_seed(0)
model = LlamaForCausalLM(config).train()
mesh = device_mesh(ParallelLayout("fsdp", 2, sp=2), device.type)  # the launch's one mesh, as Strategy.launch builds it
assert mesh.mesh_dim_names == ("dp", "sp") and mesh.shape == (1, 2)
sp = sequence_parallel.SequenceParallel(2, device, mesh)
assert sp.mesh.mesh_dim_names == ("sp",) and dist.get_process_group_ranks(sp.group) == [0, 1]  # its axis of it
if mask == "causal":
    sequence_parallel.block_causal_attention = causal_only
sp.apply(model)
split = True
part = sp.split(batch)
parts = run(model, part, sp.split(single))
errors = {n: ((parts["grads"][n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in whole["grads"].items()}
if dist.get_rank() == 0:
    json.dump({"whole": {k: whole[k] for k in ("loss", "loss_after_step", "single_row")},
               "split": {k: parts[k] for k in ("loss", "loss_after_step", "single_row")},
               "local": {k: list(v.shape) for k, v in part.items()}, "worst_grad_rel": max(errors.values()),
               "steps_apart": adam_step.steps_apart(parts["steps"], whole["steps"], whole["grads"], LR, VOCAB),
               "after_step_bound": {key: adam_step.after_step_bound(whole["grads"], whole[slopes], LR, VOCAB)
                                    for key, slopes in (("loss_after_step", "slopes"), ("single_row", "single_slopes"))}},
              open(out, "w"))
dist.destroy_process_group()
