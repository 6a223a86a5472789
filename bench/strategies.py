"""Run the tiny pretraining recipe under every strategy on 2 CPU processes; print one table.

    python bench/strategies.py [--steps 30] [--nproc 2] [--strategies ddp,fsdp,zero1,zero2,zero3,zero3_offload]

For each accelerate config it launches recipes/pretrain.py (pretrain_tiny.yaml, fp32, no eval,
no checkpoints) and reads what the run measured itself from metrics.jsonl: tokens/s (median
over the steps after the first 5), this rank's parameter / gradient / optimizer-state bytes
held (the `held_bytes` record, measured from the live tensors; DeepSpeed's separate fp32 master
weights in their own column), and each rank's peak RSS.
On a GPU machine use --nproc 1 --extra train.mixed_precision=bf16 for the bf16 figures
(tokens/s, MFU, torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(strategy: str, steps: int, nproc: int, extra: list[str], workdir: Path) -> dict:
    out = workdir / strategy
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
        "--num_processes", str(nproc), "--main_process_port", str(free_port()),
        "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", f"output_dir={out}",
        f"train.max_steps={steps}", "logging.every=1", "eval.every=0", "logging.trackers=[]",
        "checkpoint.every=0", "data.val_fraction=0", "samples.max_new_tokens=0", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{strategy} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "tokens_per_s" in r][5:]
    held = next((r["held_bytes"] for r in rows if "held_bytes" in r), None)
    memory = next(r["peak_memory"] for r in rows if "peak_memory" in r)
    mfu = [r["mfu"] for r in steps_rows if r.get("mfu") is not None]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps_rows),
        "mfu": statistics.median(mfu) if mfu else None,
        "held": held,
        "rss": [m["peak_rss_mb"] for m in memory],
        "cuda": [m.get("cuda_max_allocated_mb") for m in memory],
    }


def mb(values, key: str) -> str:
    if not values:
        return "n/a"
    return " / ".join(f"{v[key] / 2**20:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3,zero3_offload")
    parser.add_argument("--extra", nargs="*", default=[], help="more recipe overrides")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            results[strategy] = run(strategy, args.steps, args.nproc, args.extra, Path(tmp))
            print(f"done: {strategy}", file=sys.stderr)

    print(f"command: python bench/{Path(__file__).name} --steps {args.steps} --nproc {args.nproc}"
          + (f" --extra {' '.join(args.extra)}" if args.extra else ""))
    print()
    print("| strategy | tokens/s | MFU | params MB/rank | grads MB/rank | optimizer state MB/rank | fp32 master MB/rank | peak RSS MB/rank | cuda max alloc MB/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (CPU)"
        cuda = " / ".join(f"{c:.0f}" for c in r["cuda"]) if any(c is not None for c in r["cuda"]) else "n/a"
        print(
            f"| {name} | {r['tokens_per_s']:,.0f} | {mfu} | {mb(r['held'], 'params')} | {mb(r['held'], 'grads')} "
            f"| {mb(r['held'], 'optimizer')} | {mb(r['held'], 'master')} | {' / '.join(f'{x:.0f}' for x in r['rss'])} | {cuda} |"
        )


if __name__ == "__main__":
    main()
