"""The output head on target positions alone (model.loss_positions=targets) against every position, on the shipped chat
LoRA (finetune_smollm2_chat_lora.yaml: SmolLM2-135M-Instruct, the embedded Python Q&A, ChatML, chunked loss).

    python bench/loss_positions.py                 # 12 steps a row, the first 2 untimed
    python bench/loss_positions.py --smoke         # 3 steps a row

Each row is one process of recipes/finetune.py as the YAML ships but for the steps, the row's loss_positions and no
samples, checkpoints or held-out loss (they would time other things). Prints one table: tokens/s over the timed steps,
the process's peak resident memory, the share of positions the head skips (the data's positions without a target,
from --preview), and the loss at the last step (the same to fp32 rounding, or a row is wrong).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_throughput import log_every, timed_rate  # bench/: the recipe's rate over the timed steps

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "configs" / "finetune_smollm2_chat_lora.yaml"
QUIET = ["samples.max_new_tokens=0", "eval.every=0", "data.val_fraction=0", "checkpoint.every=0",
         "logging.trackers=[]"]


def row(positions: str, args, work: Path) -> dict:
    out = work / positions
    cmd = [sys.executable, "recipes/finetune.py", "--config", str(YAML), f"output_dir={out}",
           f"train.max_steps={args.warmup + args.steps}", f"model.loss_positions={positions}", *QUIET,
           log_every(args.warmup)]
    with open(work / f"{positions}.log", "w") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the largest of every row's
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{positions}: exited {os.waitstatus_to_exitcode(status)}; see {work / positions}.log")
    from toolkit.training.metrics import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    rate, _ = timed_rate(records, args.warmup, args.steps)
    loss = [r["loss"] for r in records if r.get("kind") == "train"][-1]
    return {"rate": rate, "rss_gb": usage.ru_maxrss / 2**20, "loss": loss}


def skipped_share() -> str:
    """The block positions without a target (prompts, padding), from what --preview counts of the rows' data."""
    shown = subprocess.run([sys.executable, "recipes/finetune.py", "--config", str(YAML), "--preview", "1", *QUIET],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    targets = re.search(r"tokens with loss\s+[\d.]+% \(([\d,]+) of", shown)
    blocks = re.search(r"training blocks\s+([\d,]+) of ([\d,]+) tokens", shown)
    if not (targets and blocks):
        return "?"
    loss = int(targets.group(1).replace(",", ""))
    total = int(blocks.group(1).replace(",", "")) * int(blocks.group(2).replace(",", ""))
    return f"{1 - loss / total:.1%} ({total - loss:,} of {total:,})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="2 timed steps after 1")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        rows = {p: row(p, args, Path(tmp)) for p in ("all", "targets")}
    share = skipped_share()
    print(f"| model.loss_positions | tokens/s | peak RSS GB | positions the head skips | loss at step "
          f"{args.warmup + args.steps} |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['rate']:,.0f} ({r['rate'] / rows['all']['rate']:.2f}x) | {r['rss_gb']:.2f} | "
              f"{share if name == 'targets' else 'none'} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
