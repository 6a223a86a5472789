"""Consolidating a ZeRO-3 checkpoint offline: time and peak memory against model size; one table.

    python bench/export.py [--models tiny,smollm2] [--workdir DIR]

For each model it first makes a ZeRO-3 checkpoint with a 1-step, 2-process CPU run (the tiny
LLaMA of pretrain_tiny.yaml from scratch; SmolLM2-135M by a full fine-tune), then runs the
consolidation (`toolkit.export.consolidate.load_model`: DeepSpeed's zero_to_fp32 writes safetensors
shards, lazily gathered, then transformers loads them) in a fresh process and reads that
process's peak RSS (file-backed pages included). The goal: no more than ~2x the fp32 model size
above the baseline of a process that has imported the same libraries (measured, subtracted).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "tiny": ["recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", "samples.max_new_tokens=0",
             "train.global_batch_size=2", "train.micro_batch_size=1"],
    "smollm2": ["recipes/finetune.py", "--config", "recipes/configs/finetune_smollm2_full.yaml", "data.format=text", "data.seq_len=32",
                "train.global_batch_size=2", "train.micro_batch_size=1", "samples.max_new_tokens=0",
                "data.val_fraction=0"],
}
COMMON = ["train.max_steps=1", "checkpoint.every=1", "logging.trackers=[]", "eval.every=0"]

PROBE = """
import json, resource, sys, time
import torch, transformers, accelerate, peft, deepspeed.utils.zero_to_fp32  # what every consolidation imports
from toolkit.export.consolidate import load_model, resolve_source
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if sys.argv[1] != "baseline":
    model, _, _ = load_model(resolve_source(sys.argv[1], "step-1"))
    n = sum(p.numel() for p in model.parameters())
else:
    n = 0
print(json.dumps({"seconds": time.perf_counter() - t, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "import_kb": base, "params": n}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(name: str, workdir: Path) -> Path:
    out = workdir / name
    if (out / "checkpoints" / "step-1" / "trainer_state.json").is_file():
        return out
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml",
           "--num_processes", "2", "--main_process_port", str(free_port()), *RUNS[name], *COMMON,
           f"output_dir={out}", "overwrite=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out


def probe(target: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, target], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"consolidation of {target} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--workdir", default=None, help="keep the checkpoints here (default: a temporary folder)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))
    baseline = probe("baseline")["peak_kb"] / 1024
    rows = []
    for name in args.models.split(","):
        run = make_checkpoint(name, workdir)
        got = probe(str(run))
        fp32_mb = got["params"] * 4 / 2**20
        extra = got["peak_kb"] / 1024 - baseline
        rows.append((name, got["params"], fp32_mb, got["seconds"], got["peak_kb"] / 1024, extra, extra / fp32_mb))
    print(f"ZeRO-3 checkpoint (2 ranks) -> one model in one process; baseline RSS after imports {baseline:.0f} MB")
    head = f"{'model':<10}{'params':>14}{'fp32 MB':>10}{'seconds':>10}{'peak RSS MB':>13}{'above base':>12}{'x fp32':>8}"
    print(head)
    print("-" * len(head))
    for name, n, mb, s, peak, extra, ratio in rows:
        print(f"{name:<10}{n:>14,}{mb:>10.1f}{s:>10.2f}{peak:>13.0f}{extra:>12.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
