"""recipes/plan.py as a user runs it: a table and a launch line, or --json rows; one line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# context and tensor parallel (a parallelism_config) are not modelled yet
STRATEGIES = sorted(
    p.stem for p in (ROOT / "accelerate_configs").glob("*.yaml")
    if not p.stem.startswith("multinode") and "parallelism_config" not in yaml.safe_load(p.read_text())
)


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "recipes/plan.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_1b_config_on_eight_80gb_gpus_gets_rows_and_a_launch_line():
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "80GB", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert sorted({r["strategy"] for r in rows}) == STRATEGIES
    assert {r["gradient_checkpointing"] for r in rows} == {"none", "every_k", "full"}
    for r in rows:
        assert {"strategy", "gradient_checkpointing", "micro_batch_size", "peak_bytes", "fits"} <= set(r)
        assert 512 % (r["micro_batch_size"] * 8) == 0, "the global batch stays the recipe's"
        parts = sum(r[f"{k}_bytes"] for k in ("params", "grads", "optimizer", "master", "activations", "logits_loss", "buffers"))
        assert parts == r["peak_bytes"]
    # 8 x 80 GB holds the 1B model many ways, but not DDP without checkpointing at micro-batch 32
    assert any(r["fits"] for r in rows)
    ddp_32 = next(r for r in rows if (r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]) == ("ddp", "none", 32))
    assert not ddp_32["fits"] and ddp_32["peak_bytes"] > 80e9

    text = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "80GB")
    assert text.returncode == 0, text.stderr
    line = text.stdout.strip().splitlines()[-1]
    assert line.startswith("accelerate launch --config_file accelerate_configs/") and "--num_processes 8" in line
    assert "recipes/pretrain.py --config recipes/configs/pretrain_llama_1b.yaml" in line
    best = text.stdout.strip().splitlines()[-2]
    assert best.startswith("fastest that fits:")


def test_a_small_gpu_makes_it_shard_and_recompute():
    rows = json.loads(plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "16GB",
                           "--json").stdout)
    fitting = {(r["strategy"], r["gradient_checkpointing"]) for r in rows if r["fits"]}
    assert ("ddp", "none") not in fitting, "DDP holds 16 bytes per parameter (16.6 GB) before any activation"
    assert ("zero3", "full") in fitting and ("fsdp", "full") in fitting


def test_lora_needs_a_small_optimizer_and_no_base_gradients():
    config = "recipes/configs/finetune_smollm2_lora.yaml"
    lora = json.loads(plan("--config", config, "--gpus", "1", "--gpu-memory", "24GB", "--json").stdout)
    full = json.loads(plan("--config", config, "--gpus", "1", "--gpu-memory", "24GB", "--json", "adapter.method=full").stdout)

    def ddp(rows):
        return next(r for r in rows if (r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]) == ("ddp", "none", 4))

    assert ddp(full)["params_bytes"] < ddp(lora)["params_bytes"] < 1.05 * ddp(full)["params_bytes"], "the frozen base is still held"
    assert ddp(lora)["optimizer_bytes"] < ddp(full)["optimizer_bytes"] / 20
    assert ddp(lora)["grads_bytes"] < ddp(full)["grads_bytes"] / 20


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu-memory", "lots"], "is not a size"),
        (["train.nonsense=1"], "nonsense"),
        (["--gpus", "3"], "divides train.global_batch_size=512"),
    ],
)
def test_bad_input_is_one_line(args, message):
    extra = ["--micro-batch", "8"] if "--gpus" in args else []
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", *args, *extra)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
