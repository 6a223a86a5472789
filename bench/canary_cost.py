"""What the numerics canary (train.canary) costs: the time of one check against the time of a step, and so the share
of a run's time it takes at the default cadence (a check every train.canary_every=100 steps).

    python bench/canary_cost.py            # the 1B YAML on one GPU as it ships (flex attention, compiled layers,
                                           # the chunked loss, the per-step bf16 copy), 64 sequences a step
    python bench/canary_cost.py --smoke    # pretrain_tiny on CPU, its layers compiled and the chunked loss

One launch of recipes/pretrain.py with a check every --every steps; each canary row of metrics.jsonl holds its
check's seconds. A step's time is the median of the steps that ran no check (a check runs inside its step's timing);
the first check is shown apart: it is where a compiled model compiles the canary's one-row shape. The table:
levers, the check's seconds (first, then the median of the rest), the step's seconds, the share at every 100 steps,
the largest drift a healthy check saw, and (--compare) whether a launch without the canary trained the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EVERY = 100  # train.canary_every's default


def command(args, out: Path, canary: bool) -> list[str]:
    model = "recipes/configs/pretrain_tiny.yaml" if args.smoke else "recipes/configs/pretrain_llama_1b.yaml"
    shape = (["model.loss=chunked", "model.loss_chunk_tokens=256", "model.compile=layers"] if args.smoke else
             ["train.global_batch_size=64", "model.config.vocab_size=32768"])  # the YAML's shape, a smaller step
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
        "--num_processes", "1", "recipes/pretrain.py", "--config", model, f"output_dir={out}", "overwrite=true",
        "data.path=null", "data.val_fraction=0", "eval.every=0", "samples.max_new_tokens=0", "logging.trackers=[]",
        "checkpoint.every=0", "logging.every=1", f"train.max_steps={args.steps}",
        f"train.canary={'stop' if canary else 'off'}", f"train.canary_every={args.every}", *shape,
    ]


def launch(args, canary: bool) -> list[dict] | None:
    """metrics.jsonl's rows of one launch, or None where it failed (its output said)."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "run"
        done = subprocess.run(command(args, out, canary), cwd=ROOT, capture_output=True, text=True,
                              env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
            return None
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="pretrain_tiny on CPU")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="steps between two checks in the measured run")
    p.add_argument("--compare", action="store_true", help="also train without the canary: the same losses and "
                   "gradient norms, bit for bit (the last column)")
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    rows = launch(args, canary=True)
    off = launch(args, canary=False) if args.compare else None
    if rows is None or args.compare and off is None:
        return 1
    checks = [r for r in rows if r["kind"] == "canary"]
    checked = {r["step"] + 1 for r in checks}  # a check before step N+1 (N steps done) runs inside its timing
    trains = [r for r in rows if r["kind"] == "train"]
    step_s = statistics.median(  # tokens / tokens_per_s: each row is one step (logging.every=1)
        (r["tokens"] - prev["tokens"]) / r["tokens_per_s"] for prev, r in zip(trains, trains[1:], strict=False)
        if r["step"] not in checked and r["step"] > 2)
    first, rest = checks[0]["seconds"], statistics.median(r["seconds"] for r in checks[1:])
    share = rest / (DEFAULT_EVERY * step_s)
    same = "not run" if off is None else "the same numbers" if curve(off) == curve(rows) else "OTHER NUMBERS"
    table = "\n".join([
        "| levers | checks | first check s | check s (median) | step s (median) | share at every 100 | drifts | "
        "without the canary |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {', '.join(checks[0]['levers'])} | {len(checks)} | {first:.3f} | {rest:.3f} | {step_s:.3f} | "
        f"{100 * share:.2f} % | {max(max(r['loss_drift'], r['grad_drift']) for r in checks):.2g} "
        f"(tolerance {checks[0]['tolerance']:g}) | {same} |",
    ])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if same != "OTHER NUMBERS" else 1


if __name__ == "__main__":
    sys.exit(main())
