"""Worker for test_deepspeed_step.py: a real DeepSpeed engine, stepped through toolkit.strategy.deepspeed.engine.

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 1 \\
        tests/support/deepspeed_step_probe.py OUT.json

A tiny LLaMA prepared as the recipes prepare one (build_accelerator, the family's configure, AdamW,
prepare), then four optimizer steps of one micro-batch each: a good one, one whose loss the
caller reports as non-finite (its gradients are finite), one with NaN gradients, a good one.
Writes what each returned, the fp32 master weights and Adam moments after each (DeepSpeed's own
accessors), DeepSpeed's step counters, and whether the torch optimizer's step was put back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from toolkit.strategy.accelerator import build_accelerator, launched_family, outside_training  # noqa: E402
from toolkit.strategy.deepspeed.engine import engine_backward, engine_of, engine_step_unless_nonfinite  # noqa: E402
from toolkit.strategy.distributed import launched_layout  # noqa: E402
from toolkit.strategy.family import prepare  # noqa: E402

VOCAB, SEQ = 64, 16


def main(out: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from transformers import AutoModelForCausalLM, LlamaConfig

    acc = build_accelerator("no", 1, str(Path(out).parent))  # the test's tmp_path: nothing left in /tmp
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    with outside_training(acc):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    launched_family().configure(acc, 2, 1.0)
    model, _ = prepare(acc, model, torch.optim.AdamW(model.parameters(), lr=0.1))
    engine = engine_of(acc)
    inner = engine.optimizer.optimizer

    def state() -> dict:
        params = list(engine.module.parameters())
        return {
            "weights": [safe_get_full_fp32_param(p).flatten().tolist() for p in params],
            "exp_avg": [safe_get_full_optimizer_state(p, "exp_avg").flatten().tolist() for p in params],
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "step_restored": "step" not in vars(inner),
        }

    nan_embeddings = lambda module, inputs, output: output * float("nan")  # noqa: E731
    steps = []
    for kind in ("good", "loss", "grad", "good"):
        ids = torch.randint(0, VOCAB, (2, SEQ), device=acc.device)
        hook = engine.module.get_input_embeddings().register_forward_hook(nan_embeddings) if kind == "grad" else None
        engine_backward(engine, model(input_ids=ids, labels=ids).loss, boundary=True)
        if hook is not None:
            hook.remove()
        # "grad": NaN gradients, reported by the norm alone; "loss": finite gradients, the caller's verdict
        found = engine_step_unless_nonfinite(engine, loss_nonfinite=kind == "loss")
        steps.append({"kind": kind, "found": found, **state()})
    Path(out).write_text(json.dumps({"strategy": launched_layout(acc, {}, acc.num_processes).accelerate_name, "steps": steps}))


if __name__ == "__main__":
    main(sys.argv[1])
