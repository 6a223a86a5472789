"""Run on N ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_tensor_parallel.py: a tiny model split over the N
ranks against the same model whole, on every rank, on a packed batch (several documents per row,
packing's block-causal mask): the token loss, every weight's gradient, the loss after one AdamW step,
the hidden states a norm saves. argv: result JSON path, model type (llama: tied embedding and head |
qwen3: per-head q/k norms), attention (sdpa: Megatron's sequence parallel layout | flex_attention:
transformers' plan, the sequence whole between layers). Rank 0 writes the JSON."""

from __future__ import annotations

import json
import sys

import adam_step
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.strategy.tensor_parallel import split

out, model_type, attention = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo")
tp = dist.get_world_size()
L = 64
LR, VOCAB = 1e-2, 4096
# two rows of packed documents: (24, 30, 10) and (5, 59) tokens, the second ending in 3 tokens of padding
positions = np.stack([np.concatenate([np.arange(24), np.arange(30), np.arange(10)]),
                      np.concatenate([np.arange(5), np.arange(59)])])
columns = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, (2, L)), "position_ids": positions,
           "num_tokens": np.array([L, L - 3])}
batch = collate(columns, "sdpa")
# The loss is T = 120 token cross-entropies, each a logsumexp of V = 4096 fp32 logits: in another order
# each is off by ~u sqrt(V) = 4e-6 of itself (u = 2^-24), and T independent errors add to 1/sqrt(T) of
# that in the sum, 3e-7: bounded by 1e-6 of the loss.
LOSS_REL = 1e-6
# the shipped tiny config's widths: torch's fp32 norm of the 4096 x 128 embedding's gradient is 1e-5 off
# its float64 norm, and rounds differently on the split halves (test_tensor_parallel.py)
config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                              tie_word_embeddings=model_type == "llama")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def run(model) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    saved = []
    norm = model.model.layers[1].input_layernorm
    handle = norm.register_forward_hook(lambda _m, args, _o: saved.append(tuple(getattr(args[0], "to_local",
                                                                                        lambda: args[0])().shape)))
    loss = forward_loss_sum(model, batch)
    loss.backward()
    handle.remove()
    grads = {n: whole(p.grad).float().clone() for n, p in model.named_parameters()}
    # torch's fp32 norm of each gradient (of the DTensors on the split model), as clipping takes it
    each = [whole(torch.linalg.vector_norm(p.grad)) for p in model.parameters()]
    norms = {"grad_norm": torch.linalg.vector_norm(torch.stack(each)).item(),
             "exact_grad_norm": sum(g.double().pow(2).sum().item() for g in grads.values()) ** 0.5}
    before = {n: whole(p).detach().float().clone() for n, p in model.named_parameters()}
    optimizer.step()
    steps = {n: whole(p).detach().float() - before[n] for n, p in model.named_parameters()}
    optimizer.zero_grad()
    after = forward_loss_sum(model, batch)
    after.backward()  # the slope after the step, for adam_step.after_step_bound
    slope = {n: whole(p.grad).float() for n, p in model.named_parameters()}
    return {**norms, "loss": loss.item(), "loss_after_step": after.item(), "grads": grads, "steps": steps,
            "slope": slope, "norm_input": saved[0], "kinds": sorted({type(p).__name__ for p in model.parameters()})}


torch.manual_seed(0)
reference = run(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
torch.manual_seed(0)  # the split slices each rank's own copy: the same seed everywhere
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
model = split(model, tp, 1, attention)
tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
got = run(model)
worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in reference["grads"].items())
result = {
    "tp": tp, "sequence_parallel": model.tp_whole_between_layers is None, "tied": tied, "kinds": got["kinds"],
    "loss": [reference["loss"], got["loss"]], "loss_after_step": [reference["loss_after_step"], got["loss_after_step"]],
    "worst_grad_rel": worst, "loss_rel": LOSS_REL,
    "steps_apart": adam_step.steps_apart(got["steps"], reference["steps"], reference["grads"], LR, VOCAB),
    "after_step_bound": adam_step.after_step_bound(reference["grads"], reference["slope"], LR, VOCAB)
    + LOSS_REL * reference["loss_after_step"],
    "grad_norm": [reference["grad_norm"], got["grad_norm"]],
    "exact_grad_norm": [reference["exact_grad_norm"], got["exact_grad_norm"]], "norm_input": [reference["norm_input"], got["norm_input"]],
}
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
