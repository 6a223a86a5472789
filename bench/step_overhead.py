"""Training-loop overhead: recipes/pretrain.py's train() versus a bare Accelerate loop, same model and batches.

    python bench/step_overhead.py                   # 3 rounds x (5 warm-up + 40 timed steps) per side
    python bench/step_overhead.py --threads 1 --rounds 5

Recipe side: `PretrainRecipe` from recipes/pretrain.py (via importlib), setup() from
recipes/configs/pretrain_tiny.yaml (logging.every=1, no eval, checkpoints or trackers), then train(),
one process on CPU. Its step time is its own (metrics.jsonl); the CPU time of that same interval is
read at the two `time.perf_counter()` calls with which the recipe times a step.
Bare side: the same setup() supplies blocks, model config and seed (untimed); a fresh model with the
same initial weights (asserted) trains on the same blocks in the same order (BatchSchedule + collate)
with plain AdamW and `accelerator.backward(model(**batch).loss)` under `accelerator.accumulate`:
no global-batch loss normalisation, no clipping, no scheduler, no metrics.

Each side runs in its own process (in one process the two loops slow each other through the shared
allocator) and rounds alternate which goes first. Other load only adds time and step i is the same
batch on both sides, so each step's best time over the rounds is taken; overhead = median over steps
of recipe / bare - 1. CPU time swings less than wall time on a shared machine (with 2 threads it
counts both threads' work).
"""

from __future__ import annotations

import argparse
import copy
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
WC = ("wall", "cpu")
QUIET = [
    "logging.every=1",
    "eval.every=0",
    "checkpoint.every=0",
    "samples.max_new_tokens=0",
    "logging.trackers=[]",
]


class CpuClock:
    """Stands in for the recipe module's `time`: perf_counter() as usual, plus the CPU time at each call."""

    def __init__(self):
        self.cpu = []

    def perf_counter(self):
        self.cpu.append(time.process_time())
        return time.perf_counter()

    def __getattr__(self, name):
        return getattr(time, name)


def worker(side: str, config: str, out: str, cache: str, steps: int) -> dict:
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from toolkit.config.load import load_config
    from toolkit.data.batching import BatchSchedule
    from toolkit.data.packing import collate, column
    from toolkit.training.recipe_config import PretrainConfig

    spec = importlib.util.spec_from_file_location("pretrain_recipe", ROOT / "recipes" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overrides = [f"output_dir={out}", f"data.cache_dir={cache}", f"train.max_steps={steps}", *QUIET]
    recipe = module.PretrainRecipe(load_config(PretrainConfig, config, overrides))
    recipe.setup()
    cfg = recipe.cfg
    if side == "recipe":
        import toolkit.training.trainer as trainer_module  # the loop that times each step

        trainer_module.time = clock = CpuClock()
        recipe.train()
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if "tokens_per_s" in r]
        seen = [0] + [r["tokens"] for r in rows]
        tokens = [b - a for a, b in zip(seen[:-1], seen[1:], strict=True)]
        assert len(clock.cpu) == 2 * steps, "the recipe no longer times a step with two perf_counter() calls"
        wall = [n / r["tokens_per_s"] for n, r in zip(tokens, rows, strict=True)]
        cpu = [b - a for a, b in zip(clock.cpu[::2], clock.cpu[1::2], strict=True)]
        return {"wall": wall, "cpu": cpu, "tokens": tokens, "loss1": rows[0]["loss"]}

    # The bare loop: the recipe's initial model, blocks and batch order, nothing else.
    reference = recipe.trainer.accelerator.unwrap_model(recipe.trainer.model)
    torch.manual_seed(cfg.model.init_seed if cfg.model.init_seed is not None else cfg.seed)
    config = copy.deepcopy(reference.config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.model.attn_implementation)
    ref = reference.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items()), (
        "model differs from the recipe's"
    )
    blocks, attn, t = recipe.trainer.feed.blocks, cfg.model.attn_implementation, cfg.train
    del recipe, reference, ref
    accelerator = Accelerator(gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size, cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    schedule = BatchSchedule(len(blocks), t.global_batch_size, t.micro_batch_size, 1, 0, cfg.seed)
    num_tokens = column(blocks, "num_tokens")
    res = {"wall": [], "cpu": [], "tokens": [], "loss1": None}
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for micro in schedule.micro_batches(step):
            batch = collate(blocks[micro], attn)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        res["wall"].append(time.perf_counter() - t0)
        res["cpu"].append(time.process_time() - c0)
        res["tokens"].append(int(num_tokens[schedule.global_indices(step)].sum()))
        res["loss1"] = loss.item() if res["loss1"] is None else res["loss1"]  # step 1, last micro-batch
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="recipes/configs/pretrain_tiny.yaml", help="recipe config")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every run")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=3, help="runs per side, alternating which goes first")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS, both sides (0 = torch default)")
    p.add_argument("--worker", nargs=3, metavar=("SIDE", "OUT", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    total = args.warmup + args.steps
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.config, *args.worker[1:], total)))
        return 0

    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    base = [sys.executable, __file__, "--config", args.config, "--warmup", str(args.warmup)]
    results = {"recipe": [], "bare": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("recipe", "bare") if r % 2 == 0 else ("bare", "recipe"):
                cmd = [*base, "--steps", str(args.steps), "--worker", side, f"{tmp}/{side}-{r}", f"{tmp}/cache"]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{side} worker failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.splitlines()[-1])
                res = {k: v[args.warmup :] if isinstance(v, list) else v for k, v in res.items()}
                results[side].append(res)
                print(f"  round {r} {side}: {1000 * statistics.median(res['wall']):.0f} ms/step", file=sys.stderr)

    rec, bare = results["recipe"][0], results["bare"][0]
    assert rec["tokens"] == bare["tokens"], "the two loops did not train on the same batches"
    per_step = statistics.mean(rec["tokens"])  # tokens in a step (padding excluded)
    # Other load only ever adds time, and step i trains on the same batch on both sides: take each
    # step's best time over the rounds, then the median over steps (of times, and of per-step ratios).
    best = {(k, m): [min(x[m][i] for x in v) for i in range(args.steps)] for k, v in results.items() for m in WC}
    ratio = {m: statistics.median(r / b for r, b in zip(best["recipe", m], best["bare", m], strict=True)) for m in WC}
    pairs = zip(results["recipe"], results["bare"], strict=True)
    rounds = ", ".join(f"{100 * (statistics.median(r['wall']) / statistics.median(b['wall']) - 1):+.1f}%" for r, b in pairs)

    import torch  # only for the thread count in the header

    threads = args.threads or torch.get_num_threads()
    print("\n`" + " ".join(["python", "bench/step_overhead.py", *sys.argv[1:]]) + "`")
    print(f"\n{args.config}: fp32 on CPU, 1 process, {threads} torch thread(s), {per_step:,.0f} tokens/step; "
          f"steps {args.warmup + 1}..{total}, best of {args.rounds} rounds per step, median over steps\n")
    print("| loop | step ms (wall) | tokens/s (wall) | step CPU ms | overhead (wall) | overhead (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, k in (("bare Accelerate loop", "bare"), ("recipes/pretrain.py train()", "recipe")):
        wall, cpu = statistics.median(best[k, "wall"]), statistics.median(best[k, "cpu"])
        ovh = [f"{100 * (ratio[m] - 1):+.1f}%" if k == "recipe" else "-" for m in WC]
        print(f"| {name} | {1000 * wall:.1f} | {per_step / wall:,.0f} | {1000 * cpu:.1f} | {ovh[0]} | {ovh[1]} |")
    print(f"\nper round (median step, wall): {rounds}; same batches: True; step-1 loss "
          f"recipe {rec['loss1']:.4f}, bare {bare['loss1']:.4f} (its last micro-batch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
