"""Peak memory per rank of one training step (forward + backward) on long packed sequences, whole on
one process vs split over the processes of the launch by context parallel (toolkit.strategy.context_parallel).

    torchrun --nproc_per_node 1 bench/context_parallel_memory.py --seq-len 8192 16384
    torchrun --nproc_per_node 2 bench/context_parallel_memory.py --seq-len 8192 16384

One GPU per rank (NCCL); without GPUs, CPU processes over gloo (no memory figure). Prints one table
row per sequence length from rank 0.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.data.packing import collate
from toolkit.models.loss import forward_loss_sum
from toolkit.strategy.context_parallel import ContextParallel

parser = argparse.ArgumentParser()
parser.add_argument("--seq-len", type=int, nargs="+", default=[8192, 16384])
parser.add_argument("--doc-len", type=int, default=2048, help="tokens per packed document")
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
world, rank = dist.get_world_size(), dist.get_rank()
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max(args.seq_len),
                     attn_implementation="sdpa")
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device, torch.bfloat16).train()
cp = ContextParallel(world, device) if world > 1 else None
if cp is not None:
    cp.apply(model)
if rank == 0:
    print("| seq_len | cp | peak GiB per rank | step s | device |\n|---|---|---|---|---|")
for length in args.seq_len:
    positions = np.arange(length)[None] % args.doc_len
    columns = {"input_ids": np.random.default_rng(0).integers(0, 32000, (1, length)), "position_ids": positions,
               "num_tokens": np.array([length])}
    batch = collate(columns, "sdpa")
    batch = cp.split(batch) if cp is not None else batch
    batch = {k: v.to(device) for k, v in batch.items()}
    for _ in range(2):  # the second step is measured
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        forward_loss_sum(model, batch).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"| {length} | {world} | {max(peaks):.2f} | {seconds:.2f} | {name} |", flush=True)
dist.destroy_process_group()
