"""How long training waits for a checkpoint: blocking saves against checkpoint.async_save, one process on CPU.

    python bench/async_checkpoint.py                  # a 0.2B LLaMA, 16 steps, a checkpoint every 4
    python bench/async_checkpoint.py --hidden 1536 --layers 12 --rounds 2
    python bench/async_checkpoint.py --threads 1      # training on one core, the other free for the writes
    python bench/async_checkpoint.py --smoke          # the tiny model: the harness works, the figures mean nothing

Each mode runs recipes/pretrain.py's PretrainRecipe (recipes/configs/pretrain_tiny.yaml with the sizes below, fp32,
logging every step, no evaluation or samples) in a process of its own, and records the time at which each step's
metrics row is logged. A step's period is the time from the row before: its training, plus whatever the loop did
between the two rows (a blocking save; the copy of an async save; the writes' competition for the cores). The
table gives, per mode: the median period of a step far from any save, the periods of the steps that began a save
(and the step after), the time all saves added to the run (total minus steps x the quiet median), and the run's wall
time. The last save of a run is the end's, which waits for its files either way.

The writes need cores too. On a GPU the step runs on the device and the host's cores are free for them; on a CPU
whose every core trains (the default: torch takes them all), the writes and the training share the cores and an async
save can hide little. `--threads 1` trains on one core, leaving one for the writes, as a GPU run leaves its host's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("blocking", "async")


def worker(mode: str, out: str, cache: str, overrides: list[str]) -> dict:
    sys.path.insert(0, str(ROOT))
    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import PretrainConfig
    from toolkit.training.trainer import Trainer

    spec = importlib.util.spec_from_file_location("pretrain_recipe", ROOT / "recipes" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stamps: list[tuple[int, float]] = []
    log = Trainer.log

    def timed(self, kind, row):
        if kind == "train":
            stamps.append((row["step"], time.perf_counter()))
        return log(self, kind, row)

    Trainer.log = timed
    recipe = module.PretrainRecipe(load_config(PretrainConfig, str(ROOT / "recipes/configs/pretrain_tiny.yaml"), [
        f"output_dir={out}", f"data.cache_dir={cache}", *overrides,
        f"checkpoint.async_save={str(mode == 'async').lower()}"]))
    recipe.setup()
    start = time.perf_counter()
    recipe.train()
    wall = time.perf_counter() - start
    folder = max((Path(out) / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    times = [t for _, t in stamps]
    return {"periods": [b - a for a, b in zip(times[:-1], times[1:], strict=True)], "steps": [s for s, _ in stamps],
            "wall": wall, "checkpoint_bytes": size,
            "params": sum(p.numel() for p in recipe.trainer.accelerator.unwrap_model(recipe.trainer.model).parameters())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating which goes first")
    p.add_argument("--threads", type=int, default=0, help="torch threads for training (0: torch's default, every core)")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 8 steps: the harness, not the figures")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "OUT", "CACHE"), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.smoke:
        args.hidden, args.layers, args.steps, args.every = 64, 2, 8, 2
    overrides = [
        f"model.config.hidden_size={args.hidden}", f"model.config.intermediate_size={4 * args.hidden}",
        f"model.config.num_hidden_layers={args.layers}", f"model.config.num_attention_heads={max(4, args.hidden // 128)}",
        f"model.config.num_key_value_heads={max(2, args.hidden // 512)}", "data.seq_len=128",
        "train.global_batch_size=2", "train.micro_batch_size=1", "train.mixed_precision=no", f"train.max_steps={args.steps}",
        "optim.warmup_steps=2", "logging.every=1", "logging.trackers=[]", "eval.every=0", "samples.max_new_tokens=0",
        f"checkpoint.every={args.every}", "checkpoint.keep_last=1", *rest,
    ]
    if args.worker:
        print(json.dumps(worker(*args.worker, overrides)))
        return 0

    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", mode, f"{tmp}/{mode}-{r}", f"{tmp}/cache"]
                threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), **threads})
                if proc.returncode:
                    sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
                results[mode].append(json.loads(proc.stdout.splitlines()[-1]))
                print(f"  round {r} {mode}: {results[mode][-1]['wall']:.1f} s", file=sys.stderr)

    first = results["blocking"][0]
    saves = list(range(args.every, args.steps, args.every))  # in the loop; the last step's is the end's
    print("\n`" + " ".join(["python", "bench/async_checkpoint.py", *sys.argv[1:]]) + "`")
    print(f"\nLLaMA {first['params'] / 1e6:.1f}M parameters, fp32 + AdamW: a checkpoint of "
          f"{first['checkpoint_bytes'] / 2**30:.2f} GiB; 1 process on CPU ({os.cpu_count()} cores, training on "
          f"{args.threads or 'all'}), {args.steps} steps, "
          f"a save at steps {', '.join(map(str, saves))} and {args.steps}; best of {args.rounds} round(s) per step\n")
    print("| mode | quiet step s | step with a save s | the step after s | added per save s | run wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        runs = results[mode]
        # period i is step i+2's (from step i+1's row to step i+2's)
        best = [min(run["periods"][i] for run in runs) for i in range(len(runs[0]["periods"]))]
        period = {step: best[step - 2] for step in range(2, args.steps + 1)}
        # a save at step s runs after s's row, so it lands in step s+1's period; s+2's shows the writes' competition
        quiet = statistics.median(v for s, v in period.items() if all(s - k not in (1, 2) for k in saves))
        with_save = statistics.mean(period[s + 1] for s in saves)
        after = statistics.mean(period[s + 2] for s in saves if s + 2 in period)
        added = sum(period[s + 1] + period.get(s + 2, quiet) - 2 * quiet for s in saves) / len(saves)
        print(f"| {mode} | {quiet:.2f} | {with_save:.2f} | {after:.2f} | {added:.2f} | "
              f"{min(run['wall'] for run in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
