"""Worker for test_canary.py: the numerics canary on 2 ranks of a real DDP or ZeRO-2 launch.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 tests/support/canary_probe.py OUT

A tiny LLaMA prepared as the recipes prepare one, with model.loss=chunked (a lever). Each rank checks a batch of its
own, then one optimizer step trains through the strategy: the check wrote no gradient, and the step after it trains
as it does without one. Then rank 1 alone computes a wrong chunked loss: both ranks raise Drifted at that check. Each
rank writes OUT.<rank>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from toolkit.config.load import load_config  # noqa: E402
from toolkit.models import loss as loss_module  # noqa: E402
from toolkit.strategy.accelerator import build_accelerator, launched_family, outside_training  # noqa: E402
from toolkit.strategy.family import prepare  # noqa: E402
from toolkit.training import canary  # noqa: E402
from toolkit.training.recipe_config import PretrainConfig  # noqa: E402
from toolkit.training.step import optimizer_step  # noqa: E402

VOCAB, SEQ = 64, 16


def main(out: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    acc = build_accelerator("no", 1, str(Path(out).parent))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    with outside_training(acc):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    family = launched_family()
    family.configure(acc, 2, 1.0)
    model, optimizer = prepare(acc, model, torch.optim.AdamW(model.parameters(), lr=0.1))
    cfg = load_config(PretrainConfig, None, ["model.loss=chunked", "model.loss_chunk_tokens=8", "train.canary=stop"])
    rows: list[dict] = []
    check = canary.Canary(cfg, acc.unwrap_model(model), None, "no", print, rows.append)
    torch.manual_seed(1 + acc.process_index)  # each rank its own batch
    ids = torch.randint(0, VOCAB, (2, SEQ))
    batch = {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(2, 1), "labels": ids}
    check.check(0, batch, 8)
    untouched = all(p.grad is None for p in model.parameters())
    loss, norm, nonfinite, _ = optimizer_step(acc, model, optimizer, [batch], 1 / (2 * SEQ), 1.0, 8, family=family)
    result = {"rank": acc.process_index, "first": rows[0], "untouched": untouched, "loss": float(loss),
              "stepped": nonfinite is None and norm is not None}
    if acc.process_index == 1:  # rank 1 alone drops its last chunk
        original = loss_module.linear_cross_entropy_sum
        loss_module.linear_cross_entropy_sum = lambda h, w, b, t, n, c=None: original(
            h, w, b, torch.where(torch.arange(t.numel()).view_as(t) >= t.numel() - n, -100, t), n, c)
    try:
        check.check(1, batch, 8)
        result["raised"] = None
    except canary.Drifted as exc:
        result["raised"] = str(exc)
    Path(f"{out}.{acc.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
