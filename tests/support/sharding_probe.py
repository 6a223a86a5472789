"""Worker for test_sharding.py: one optimizer step of a tiny LLaMA, then each rank's held bytes.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \\
        tests/support/sharding_probe.py OUT.json [qwen3_moe]

(qwen3_moe: a Qwen3-MoE of the same sizes, 4 experts, 2 per token, in place of the LLaMA.)

Builds and prepares the model as recipes/pretrain.py does (build_accelerator, outside_training,
the family's configure, AdamW, prepare), runs one step of 2 micro-batches under
`accelerator.accumulate` inside a GradientMeter, and rank 0 writes every rank's
toolkit.strategy.sharding.held_bytes to OUT.json. Under a config with parallelism_config_sp_size
(zero3_sp.yaml) the attention runs through toolkit.strategy.sequence_parallel and every rank feeds
its part of each sequence, as Strategy.create and apply_model_parallel set a launch up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from toolkit.launch.environment import world_size  # noqa: E402
from toolkit.strategy.accelerator import build_accelerator, launched_family, outside_training  # noqa: E402
from toolkit.strategy.distributed import launched_layout  # noqa: E402
from toolkit.strategy.family import prepare  # noqa: E402
from toolkit.strategy.parallelism import launched_sizes  # noqa: E402
from toolkit.strategy.sharding import GradientMeter, held_bytes  # noqa: E402

MICRO_BATCH, ACCUMULATION, SEQ, VOCAB = 2, 2, 32, 512


def main(out: str, model_type: str = "llama") -> None:
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    sp = launched_sizes(world_size()).get("sp", 1)  # before the Accelerator, which is told nothing of sp
    acc = build_accelerator("no", ACCUMULATION, str(Path(out).parent))
    sizes = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    if model_type == "qwen3_moe":  # a mixture of experts of the same sizes: 4 experts, 2 per token
        config = Qwen3MoeConfig(**sizes, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=32)
    else:
        config = LlamaConfig(**sizes)
    with outside_training(acc):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    sequence = None
    if sp > 1:
        from toolkit.strategy.sequence_parallel import SequenceParallel

        sequence = SequenceParallel(sp, acc.device)
        sequence.apply(model)
    launched_family().configure(acc, MICRO_BATCH, 1.0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    model, optimizer = prepare(acc, model, optimizer)

    torch.manual_seed(1 + acc.process_index // sp)  # a sequence-parallel group reads the same blocks
    meter = GradientMeter(acc, model, optimizer)
    with meter:
        for _ in range(ACCUMULATION):
            ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), device=acc.device)
            with acc.accumulate(model):
                if sequence is None:
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    part = sequence.split({"input_ids": ids, "labels": ids,
                                           "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)})
                    loss = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits.float().mean()
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    held = held_bytes(acc, model, optimizer, meter)
    ranks = gather_object([held])
    if acc.is_main_process:
        Path(out).write_text(json.dumps({
            "strategy": launched_layout(acc, {}, acc.num_processes).accelerate_name, "world_size": acc.num_processes, "n_params": n_params, "ranks": ranks,
        }))
    acc.end_training()


if __name__ == "__main__":
    from toolkit.launch.verdict import exit_process

    main(*sys.argv[1:3])
    exit_process(0)
