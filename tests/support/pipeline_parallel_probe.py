"""Run by tests/toolkit/strategy/pipeline/test_stages.py on 2, 3 or 4 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py): a tiny LLaMA on a
global batch of packed rows (several documents each, 4-D block-causal mask) trained one step whole in
every process (the reference: micro-batches accumulated, clipped, AdamW) and cut into pipeline
stages by toolkit.strategy.pipeline.stages (processes = replicas x stages). Compared: the summed
token loss, every weight's gradient (by its name in the whole model), the gradient norm, and the
loss after the step. argv: result JSON path, stages, tied (0/1), max_grad_norm."""

from __future__ import annotations

import itertools
import json
import sys

import adam_step
import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.strategy.pipeline.stages import Pipeline

out, stages, tied, max_norm = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
replicas = world // stages
ROWS, L = 8, 32
LR, VOCAB = 1e-2, 512
rng = np.random.default_rng(0)
positions = []
for _ in range(ROWS):  # each row a run of documents of random lengths, as packing leaves them
    lengths = rng.integers(3, 20, 6).cumsum()
    cuts = [0, *lengths[lengths < L].tolist(), L]
    positions.append(np.concatenate([np.arange(b - a) for a, b in itertools.pairwise(cuts)]))
columns = {"input_ids": rng.integers(0, VOCAB, (ROWS, L)), "position_ids": np.stack(positions),
           "num_tokens": np.array([L] * (ROWS - 1) + [L - 4])}  # the last row ends in padding
rows = [collate({k: v[i:i + 1] for k, v in columns.items()}, "sdpa") for i in range(ROWS)]
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
                     attn_implementation="sdpa")
targets = sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)
scale = 1.0 / targets  # every micro-batch's token loss sum, over the global batch's targets


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


# the reference: the whole model, every row of the global batch accumulated in one process
whole = model()
opt = torch.optim.AdamW(whole.parameters(), lr=LR)
loss = 0.0
for r in rows:
    token_sum = forward_loss_sum(whole, r)
    (token_sum * scale).backward()
    loss += token_sum.item()
grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
if tied:  # one weight: its gradient is the embedding's and the head's together
    grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm or float("inf"))
before = {n: p.detach().clone() for n, p in whole.named_parameters()}
opt.step()
steps = {n: p.detach() - before[n] for n, p in whole.named_parameters()}
opt.zero_grad()
after = sum(forward_loss_sum(whole, r).double() for r in rows)
after.backward()  # the slope after the step, for adam_step.after_step_bound
slopes = {n: p.grad for n, p in whole.named_parameters()}
if tied:  # the last stage's copy of the one weight steps as it does
    steps["lm_head.weight"] = steps["model.embed_tokens.weight"]
after = after.detach()

# the pipeline: this replica's rows, cut into its micro-batches
replica = rank // stages
mine = rows[replica * ROWS // replicas:(replica + 1) * ROWS // replicas]
pipe = Pipeline(model(), stages, len(mine), "sdpa", torch.device("cpu"))
opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
pp_loss = pipe.step(mine, scale)
errors = {n: ((p.grad - grads[n]).norm() / grads[n].norm().clamp(min=1e-12)).item() for n, p in pipe.named_parameters()}
pp_norm = pipe.clip_grad_norm_(max_norm)
before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
opt.step()
apart = adam_step.steps_apart({n: p.detach() - before[n] for n, p in pipe.named_parameters()}, steps, grads, LR, VOCAB)
opt.zero_grad()
pp_after = pipe.loss_sum(mine)
for value in (pp_loss, pp_after):
    dist.all_reduce(value)  # the last stage of each replica holds its rows' sum; the others 0
held = [None] * world
dist.all_gather_object(held, (rank, sorted(errors), max(errors.values()), apart))
if rank == 0:
    names = [n for _, got, *_ in held for n in got]
    json.dump({"whole": {"loss": loss, "grad_norm": norm.item(), "loss_after_step": after.item()},
               "pipeline": {"loss": pp_loss.item(), "grad_norm": pp_norm.item(), "loss_after_step": pp_after.item()},
               "worst_grad_rel": max(e for _, _, e, _ in held), "steps_apart": sum(a for *_, a in held),
               "after_step_bound": adam_step.after_step_bound(grads, slopes, LR, VOCAB),
               "names_held": sorted(set(names)), "names_whole": sorted(grads), "held_per_rank": [len(g) for _, g, *_ in held]},
              open(out, "w"))
dist.destroy_process_group()
