"""Training throughput on one GPU: recipes/pretrain.py against a plain PyTorch loop, same model and shapes.

    python bench/gpu_throughput.py                        # --configs quick, the 1B LLaMA, seq 2048
    python bench/gpu_throughput.py --configs full --out runs/gpu_throughput.md
    python bench/gpu_throughput.py --profile 2            # and where 2 more steps of each row spend their time
    python bench/gpu_throughput.py --model recipes/configs/pretrain_tiny.yaml --configs quick \\
        --steps 3 --warmup 1 --seq-len 128 --switches shipped --peer-variants a     # CPU smoke check

What it measures, per config (strategy x gradient checkpointing x micro-batch x switches), in one run:
tokens/s (total tokens / total time over the steps after --warmup, which compile), MFU (tokens/s x
FLOPs per token / the GPU's bf16 peak; FLOPs per token from `toolkit.training.trainer.model_size`,
the function the recipe itself uses, so both sides share one formula), and peak memory
(`torch.cuda.max_memory_allocated`, the largest rank's; on CPU the peak RSS instead).

- Recipe rows launch the real recipe: `accelerate launch --config_file accelerate_configs/<strategy>.yaml
  --num_processes N recipes/pretrain.py --config <--model> data.path=null ...` with the row's micro-batch,
  `model.gradient_checkpointing` and switches, and read what the run measured itself from its
  metrics.jsonl (`tokens`, `tokens_per_s` and `mfu`, logged every --warmup steps; `peak_memory` at the end). Eval,
  samples, trackers and periodic checkpoints are off; the end-of-run checkpoint and final/ cannot be
  turned off and are written after the timed steps, then deleted. `data.path=null` trains on the CPython
  docs embedded in Python (~106k tokens, 51 blocks of 2048), whose BPE has only ~6.7k tokens, so
  `model.config.vocab_size` is set to the YAML's tokenizer.vocab_size: both sides train the YAML's shape.
- Plain-loop rows are this file's own ~60-line textbook loop (`peer_worker`): the same transformers
  model from the same YAML, random tokens in documents of log-uniform random length (seq_len/32 to
  4 x seq_len, cut at block ends) packed into seq_len blocks with position ids restarting per document,
  the same sequences per optimizer step, fused AdamW, clipping at 1.0. Variants:
  (a) bf16 autocast over fp32 weights, sdpa with a 4-D block-causal mask;
  (b) (a) + torch.compile(model) + flex_attention (transformers builds the document BlockMask itself
      from position_ids when no attention_mask is passed);
  (c) bf16 weights (no autocast) + torch.compile(model) + flex_attention.
Every row runs in a process of its own (fresh CUDA memory, compile caches and peak statistics).
With --profile N, each row then trains N more steps under torch.profiler (the recipe's `logging.profile`, the
loop through the same toolkit.training.profiling) and a table per row follows the throughput table: device busy
share, the longest idle gaps with the host work under each, the top kernels. The traces stay on the machine.

On a GPU machine without internet, with the wheels it installs offline in .gpu/ (docs/gpu.md), the command

    source .gpu/setup.sh && python3 bench/gpu_throughput.py --configs quick --workdir /tmp/runs \
        --save $OUT/quick.json --out $OUT/quick.md

Measured on one H100 (docs/benchmarks.md, "Pretraining the 1B YAML on one GPU"): with --steps 10 --warmup 3 a 1B recipe row
took 95-114 s and a plain-loop row 36-91 s, so `quick` (5 rows) took 7.6 minutes, inside one 10-minute
device command; `full` (23 rows) takes about an hour.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_NOTE = ("CPU: MFU unknown (no peak FLOP/s), peak memory is RSS; the recipe trains fp32 here, the loops bf16; "
            "flex_attention is sdpa here (no CPU backward)")

# The recipe's switches per row: name -> (overrides, what the table says).
SWITCHES = {
    "shipped": ([], "as the YAML ships"),
    "fast": (
        ["model.compile=layers", "model.attn_implementation=flex_attention", "model.loss=chunked", "optim.fused=auto"],
        "compiled layers, flex_attention, chunked loss, fused AdamW",
    ),
    "whole": (
        ["model.compile=model", "model.attn_implementation=flex_attention", "model.loss=full", "optim.fused=auto"],
        "the whole forward and its loss compiled, flex_attention, fused AdamW",
    ),
}
PEER_VARIANTS = {
    "a": "(a) bf16 autocast, sdpa + 4-D mask, fused AdamW",
    "b": "(b) bf16 autocast, torch.compile, flex_attention, fused AdamW",
    "c": "(c) bf16 weights, torch.compile, flex_attention, fused AdamW",
}
# Off for the timed part: eval, samples, trackers, periodic checkpoints. A recipe row logs every --warmup steps
# (log_every): a logged step waits for the device, and a run logging every step would hide what a step that
# never waits (train.step_sync) gains.
QUIET = [
    "data.path=null", "data.val_fraction=0", "eval.every=0", "samples.max_new_tokens=0", "logging.trackers=[]",
    "checkpoint.every=0", "checkpoint.final_dtype=bfloat16", "overwrite=true",
]


def log_every(warmup: int) -> str:
    """The logging cadence of a recipe row: every --warmup steps, so that the untimed steps end at a logged one."""
    return f"logging.every={max(1, warmup)}"


FP8 = "train.mixed_precision=fp8"


@dataclass(frozen=True)
class Row:
    kind: str  # "recipe" or "peer"
    strategy: str  # an accelerate_configs/ name; "-" for the plain loop
    checkpointing: str  # none, full, every_k, selective
    micro_batch: int
    switches: str  # a SWITCHES name, or a PEER_VARIANTS letter
    processes: int = 1  # ranks (GPUs) it trains on
    extra: str = ""  # --extra recipe overrides, shown with the switches


def preset(name: str) -> list[Row]:
    peers = [Row("peer", "-", "none", 8, v) for v in "abc"]
    shipped = Row("recipe", "ddp", "none", 16, "shipped")  # as pretrain_llama_1b.yaml ships: plan.py's fastest on 80 GB
    if name == "quick":
        return [shipped, Row("recipe", "ddp", "full", 8, "fast"), Row("recipe", "ddp", "selective", 8, "fast")] + peers
    if name == "check":  # bench/gpu_check.sh: the shipped YAML, and the whole model compiled (the loop's way)
        return [shipped, Row("recipe", "ddp", "none", 8, "whole")] + peers
    if name == "smoke":  # gpu_check.sh --smoke: check's rows on a small YAML, the first with the 1B YAML's switches
        return [replace(shipped, switches="fast"), Row("recipe", "ddp", "none", 8, "whole")] + peers
    if name == "fp8":  # issue 46: the YAML as shipped in bf16, then in fp8 (torchao tensorwise; the others: fp8-variants)
        return [shipped, replace(shipped, extra=FP8)]
    if name == "fp8-variants":  # the layers issue 46 asks about: the MLP's alone, and rowwise; bf16 and auto beside
        return [shipped, replace(shipped, extra=FP8), replace(shipped, extra=f"{FP8} train.fp8_layers=mlp"),
                replace(shipped, extra=f"{FP8} train.fp8_recipe=rowwise")]
    if name == "fp8-smoke":  # gpu_check.sh --smoke: fp8's rows on a small YAML, its casts emulated on CPU
        return [replace(shipped, switches="fast"), replace(shipped, switches="fast", extra=FP8),
                replace(shipped, switches="fast", extra=f"{FP8} train.fp8_layers=mlp"),
                replace(shipped, switches="fast", extra=f"{FP8} train.fp8_recipe=rowwise")]
    if name == "levers":  # what each of issue 41's switches adds: the whole model compiled, then each one taken off
        whole = Row("recipe", "ddp", "none", 8, "whole")
        return [whole, replace(whole, extra="train.step_sync=host"), replace(whole, extra="model.cast_weights=per_forward"),
                peers[2]]
    if name == "full":
        grid = itertools.product(("ddp", "fsdp", "zero2", "zero3"), ("none", "full"), (8, 16))
        return [shipped] + [Row("recipe", *g, "fast") for g in grid] + peers + [Row("peer", "-", "full", 8, v) for v in "abc"]
    raise SystemExit(f"--configs {name}: use quick, check, smoke, fp8, fp8-variants, fp8-smoke, levers or full")


# ---------------------------------------------------------------- the plain-loop peer (its own code)
def packed_blocks(n: int, seq_len: int, vocab: int, seed: int):
    """n blocks of random tokens: documents of log-uniform length, position ids restarting per document."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab, size=(n, seq_len))
    position_ids = np.empty((n, seq_len), dtype=np.int64)
    lo, hi = max(1, seq_len // 32), 4 * seq_len
    for row in position_ids:
        start = 0
        while start < seq_len:
            length = min(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))), seq_len - start)
            row[start : start + length] = np.arange(length)
            start += length
    return torch.as_tensor(input_ids), torch.as_tensor(position_ids)


def peer_worker(spec: dict) -> dict:
    import contextlib
    import resource

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.training.metrics import estimate_mfu, model_size, peak_flops
    from toolkit.training.profiling import StepProfiler

    variant, mb, seq_len, accum = spec["variant"], spec["micro_batch"], spec["seq_len"], spec["accumulation"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.for_model(spec["model_type"], **{**spec["sizes"], "vocab_size": spec["vocab"]})
    config.use_cache = False
    torch.manual_seed(spec["seed"])
    with device:
        attn = "sdpa" if variant == "a" else "flex_attention"
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    if variant == "c":
        model.to(torch.bfloat16)
    model.train()
    if spec["checkpointing"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params, flops_token = model_size(model, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    forward = torch.compile(model) if variant in "bc" else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if variant in "ab" else contextlib.nullcontext()

    steps, warmup, profiled = spec["steps"], spec["warmup"], spec.get("profile", 0)
    timed_end = warmup + steps
    profiler = StepProfiler([timed_end + 1, timed_end + profiled] if profiled else [], Path(spec["workdir"]), True, device,
                            say=lambda line: None)
    input_ids, position_ids = packed_blocks((timed_end + profiled) * accum * mb, seq_len, spec["vocab"], spec["seed"])
    labels = input_ids.masked_fill(position_ids == 0, -100)  # no target across a document boundary
    if device.type == "cuda":
        input_ids, position_ids, labels = input_ids.pin_memory(), position_ids.pin_memory(), labels.pin_memory()
        torch.cuda.reset_peak_memory_stats()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    losses, t0 = [], time.perf_counter()
    for step in range(timed_end + profiled):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        profiler.begin(step + 1)
        for micro in range(accum):
            rows = slice((step * accum + micro) * mb, (step * accum + micro + 1) * mb)
            batch = {
                "input_ids": input_ids[rows].to(device, non_blocking=True),
                "position_ids": position_ids[rows].to(device, non_blocking=True),
                "labels": labels[rows].to(device, non_blocking=True),
            }
            if variant == "a":  # sdpa keeps documents apart only with a mask: causal within a document
                doc = torch.cumsum(batch["position_ids"] == 0, dim=1)
                causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
                batch["attention_mask"] = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
            with autocast:
                loss = forward(**batch, use_cache=False).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach() * accum)
        profiler.end(step + 1)
        if step + 1 == timed_end:  # the clock stops before any profiled step
            sync()
            elapsed = time.perf_counter() - t0
    tps = steps * accum * mb * seq_len / elapsed
    if device.type == "cuda":
        memory = {"cuda_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
    else:
        memory = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {
        "tokens_per_s": tps, "mfu": estimate_mfu(tps, flops_token, 1, peak_flops(device)), **memory,
        "params": n_params, "flops_per_token": flops_token,
        "loss_first": losses[0].item(), "loss_last": losses[timed_end - 1].item(),
        **({"profile": profiler.summary} if profiler.summary else {}),
    }


# ---------------------------------------------------------------- running the rows
def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run cmd in a session of its own (a timeout kills every rank it started); (exit code, why it failed)."""
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, start_new_session=True)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return -1, f"timed out after {timeout:.0f} s"
    if rc == 0:
        return 0, ""
    lines = [ln.strip() for ln in log.with_suffix(".err").read_text(errors="replace").splitlines() if ln.strip()]
    print("\n".join(lines[-30:]), file=sys.stderr)
    if any("out of memory" in ln.lower() for ln in lines):
        return rc, "out of memory"
    why = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
    why = why or next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else f"exit code {rc}")
    return rc, why[:160]


def switch_overrides(name: str, gpu: bool) -> list[str]:
    """A row's switches as overrides; without a GPU flex_attention is sdpa (CPU has no flex_attention backward)."""
    return [s if gpu else s.replace("=flex_attention", "=sdpa") for s in SWITCHES[name][0]]


def recipe_overrides(row: Row, args, vocab: int, out: Path) -> list[str]:
    return [
        f"output_dir={out}", f"data.seq_len={args.seq_len}", f"model.config.vocab_size={vocab}",
        f"train.max_steps={args.warmup + args.steps + args.profile}", f"train.micro_batch_size={row.micro_batch}",
        f"train.global_batch_size={args.global_batch}", f"model.gradient_checkpointing={row.checkpointing}",
        *QUIET, log_every(args.warmup), *switch_overrides(row.switches, on_gpu()), *row.extra.split(),
        *([f"logging.profile=[{args.warmup + args.steps + 1}, {args.warmup + args.steps + args.profile}]"]
          if args.profile else []),
    ]


def recipe_command(row: Row, args, vocab: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"accelerate_configs/{row.strategy}.yaml",
        "--num_processes", str(row.processes), "--main_process_port", str(free_port()),
        "recipes/pretrain.py", "--config", str(Path(args.model).resolve()), *recipe_overrides(row, args, vocab, out),
    ]


@functools.cache
def plan_module():
    """recipes/plan.py, loaded once for every row's estimate."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan", ROOT / "recipes" / "plan.py")
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    return plan


def planned_gib(row: Row, args, vocab: int) -> float | None:
    """The peak recipes/plan.py estimates for the row (its --json row of the same strategy, checkpointing and
    micro-batch), in GiB like the measured column; None where plan.py lists no such row."""
    import contextlib
    import io

    argv = ["--config", str(Path(args.model).resolve()), "--gpus", str(row.processes), "--micro-batch",
            str(row.micro_batch), "--json", *recipe_overrides(row, args, vocab, Path("runs/planned"))]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_module().main(argv)
    if code:
        print(f"plan.py {' '.join(argv)}: {err.getvalue().strip()[-300:]}", file=sys.stderr)
        return None
    same = [r for r in json.loads(out.getvalue()) if (r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"])
            == (row.strategy, row.checkpointing, row.micro_batch)]
    return same[0]["peak_bytes"] / 2**30 if same else None


def timed_rate(records: list[dict], warmup: int, steps: int) -> tuple[float, dict]:
    """(tokens/s, the first timed record) over steps warmup+1 .. warmup+steps of a recipe's metrics.jsonl, logged
    at least at step `warmup` (log_every): each logged row's tokens since the row before, over the rate the recipe
    measured for them."""
    logged = [r for r in records if "tokens_per_s" in r]
    seen = [0] + [r["tokens"] for r in logged]
    windows = [(b - a, r) for a, b, r in zip(seen[:-1], seen[1:], logged, strict=True)]
    timed = [(n, r) for n, r in windows if warmup < r["step"] <= warmup + steps]
    return sum(n for n, _ in timed) / sum(n / r["tokens_per_s"] for n, r in timed), timed[0][1]


def run_recipe(row: Row, args, vocab: int, workdir: Path) -> dict:
    out = workdir / "run"
    rc, why = launch(recipe_command(row, args, vocab, out), workdir / "log", args.row_timeout)
    from toolkit.training.metrics import read_metrics

    records, profile = [], None
    if (out / "metrics.jsonl").exists():
        records = read_metrics(out / "metrics.jsonl")
    if (out / "profile" / "summary.json").exists():
        profile = json.loads((out / "profile" / "summary.json").read_text())
    shutil.rmtree(out, ignore_errors=True)  # a 1B run leaves ~17 GB (and its trace, too large to bring back)
    if rc:
        return {"failed": why}
    tps, first = timed_rate(records, args.warmup, args.steps)
    # every step's mfu / tokens_per_s is FLOPs per token / (peak x world size)
    mfu = None if first["mfu"] is None else tps * first["mfu"] / first["tokens_per_s"]
    memory = next(r["peak_memory"] for r in records if "peak_memory" in r)
    peak = {k: max(m[k] for m in memory) for k in ("cuda_max_allocated_mb", "peak_rss_mb") if k in memory[0]}
    planned = planned_gib(row, args, vocab)
    losses = [[r["step"], r["loss"]] for r in records if r.get("kind") == "train"]
    converted = next((line for line in (workdir / "log.out").read_text(errors="replace").splitlines()
                      if "] fp8: " in line), None) if (workdir / "log.out").exists() else None
    return {"tokens_per_s": tps, "mfu": mfu, **peak, **({"planned_gib": planned} if planned else {}),
            **({"profile": profile} if profile else {}), "losses": losses,
            **({"fp8": converted.split("] ", 1)[1]} if converted else {})}


def run_peer(row: Row, args, facts: dict, workdir: Path) -> dict:
    accumulation = args.global_batch // (args.nproc * row.micro_batch)  # one rank's share of the optimizer step
    spec = {
        **facts, "variant": row.switches, "micro_batch": row.micro_batch, "checkpointing": row.checkpointing,
        "seq_len": args.seq_len, "accumulation": accumulation, "steps": args.steps, "warmup": args.warmup,
        "profile": args.profile, "workdir": str(workdir),
    }
    if row.switches in "bc" and not on_gpu():
        return {"skipped": "not run: torch's flex_attention has no backward on CPU"}
    log = workdir / "log"
    rc, why = launch([sys.executable, __file__, "--peer-worker", json.dumps(spec)], log, args.row_timeout)
    if rc:
        return {"failed": why}
    return json.loads(log.with_suffix(".out").read_text().splitlines()[-1])


# ---------------------------------------------------------------- the table
def machine() -> str:
    import torch
    import transformers

    from toolkit.training.metrics import peak_flops

    def read(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = read(["git", "rev-parse", "--short", "HEAD"]) or "unknown (no git)"
    if commit[0] != "u" and read(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " + uncommitted changes"
    if torch.cuda.is_available():
        device = torch.device("cuda")
        peak = peak_flops(device)
        driver = read(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
        gpu = torch.cuda.get_device_name() + (f" (bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else "")
        gpu += f", driver {driver or '?'}, CUDA {torch.version.cuda}"
    else:
        gpu = f"no GPU: CPU, {os.cpu_count()} cores"
    return f"{gpu}; torch {torch.__version__}, transformers {transformers.__version__}; commit {commit}"


def cell(result: dict, key: str, best_peer: float | None, processes: int) -> str:
    if "tokens_per_s" not in result:  # failed or skipped
        return "-"
    if key == "tokens_per_s":
        return f"{result[key]:,.0f}"
    if key == "mfu":
        return "-" if result["mfu"] is None else f"{result['mfu']:.1%}"
    if key == "planned":  # recipes/plan.py's estimate of the peak, and how far the measured one is from it
        if "planned_gib" not in result or "cuda_max_allocated_mb" not in result:
            return f"{result['planned_gib']:.1f}" if "planned_gib" in result else "-"
        measured = result["cuda_max_allocated_mb"] / 1024
        return f"{result['planned_gib']:.1f} ({result['planned_gib'] / measured - 1:+.0%})"
    if key == "memory":
        if "cuda_max_allocated_mb" in result:
            return f"{result['cuda_max_allocated_mb'] / 1024:.1f}"
        return f"{result['peak_rss_mb'] / 1024:.2f} (RSS)" if "peak_rss_mb" in result else "-"
    return f"{result['tokens_per_s'] / processes / best_peer:.2f}x" if best_peer else "-"


def table(rows: list[Row], results: list[dict]) -> list[str]:
    pairs = zip(rows, results, strict=True)
    best = max((r["tokens_per_s"] for row, r in pairs if row.kind == "peer" and "tokens_per_s" in r), default=None)
    lines = [
        "| what ran | strategy | checkpointing | micro-batch | switches | tokens/s | MFU | peak GB | planned GB | ratio to best peer |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row, res in zip(rows, results, strict=True):
        what = "recipes/pretrain.py" if row.kind == "recipe" else "plain loop"
        switches = SWITCHES[row.switches][1] if row.kind == "recipe" else PEER_VARIANTS[row.switches]
        strategy = f"{row.strategy} x{row.processes}" if row.kind == "recipe" else "1 process"
        switches += f"; then {row.extra}" if row.extra else ""
        if "failed" in res:
            switches += f" — **failed: {res['failed'].replace('|', '/')}**"
        elif "skipped" in res:
            switches += f" — {res['skipped']}"
        cells = " | ".join(cell(res, k, best, row.processes) for k in ("tokens_per_s", "mfu", "memory", "planned", "ratio"))
        lines.append(f"| {what} | {strategy} | {row.checkpointing} | {row.micro_batch} | {switches} | {cells} |")
    return lines


def profiles(rows: list[Row], results: list[dict]) -> list[str]:
    """One table per profiled row (toolkit.training.profiling's), after the throughput table."""
    from toolkit.training.profiling import table as profile_table

    lines = []
    for row, res in zip(rows, results, strict=True):
        if "profile" in res:
            what = "recipes/pretrain.py" if row.kind == "recipe" else "plain loop"
            switches = SWITCHES[row.switches][1] if row.kind == "recipe" else PEER_VARIANTS[row.switches]
            lines += ["", f"### Profile: {what}, {row.strategy}, {row.checkpointing}, micro-batch {row.micro_batch}, "
                          f"{switches}", "", *profile_table(res["profile"])]
    return lines


def curves(rows: list[Row], results: list[dict]) -> list[str]:
    """The recipe rows' logged training losses side by side, and each row's largest distance from the first row's
    (the fp8 rows against bf16's: the same data, seed and steps), where more than one row logged them."""
    logged = [(row, res) for row, res in zip(rows, results, strict=True) if res.get("losses")]
    if len(logged) < 2:
        return []
    names = [row.extra or "as configured" for row, _ in logged]
    by_step = [dict(map(tuple, res["losses"])) for _, res in logged]
    steps = sorted(set(by_step[0]).intersection(*by_step[1:]))
    lines = ["", "### Training loss of the recipe rows (logged steps)", "",
             "| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    lines += [f"| {step} | " + " | ".join(f"{losses[step]:.4f}" for losses in by_step) + " |" for step in steps]
    lines.append("")
    for name, res, losses in zip(names[1:], [r for _, r in logged[1:]], by_step[1:], strict=True):
        gaps = [abs(losses[s] - by_step[0][s]) / by_step[0][s] for s in steps]
        lines.append(f"- {name}: largest relative distance from the first row {max(gaps):.2%} (step "
                     f"{steps[gaps.index(max(gaps))]}), last step {gaps[-1]:.2%}" + (f"; {res['fp8']}" if "fp8" in res else ""))
    return lines


def select_rows(args) -> list[Row]:
    rows = [r for r in preset(args.configs) if r.kind == "recipe" or r.switches in args.peer_variants]
    names = args.switches.split(",") if args.switches else None
    if names and set(names) - set(SWITCHES):
        raise SystemExit(f"--switches {args.switches}: use {' and/or '.join(SWITCHES)}")
    recipe = [
        replace(r, switches=s, processes=args.nproc, extra=" ".join(filter(None, [r.extra, *args.extra])))
        for r in rows if r.kind == "recipe" for s in names or [r.switches]
    ]
    rows = list(dict.fromkeys(recipe)) + [r for r in rows if r.kind == "peer"]
    if args.strategies:
        rows = [r for r in rows if r.kind == "peer" or r.strategy in args.strategies.split(",")]
    rows = [r for r in rows if not (args.peer_only and r.kind == "recipe" or args.recipe_only and r.kind == "peer")]
    for r in rows:
        if args.global_batch % (args.nproc * r.micro_batch):
            raise SystemExit(
                f"--global-batch {args.global_batch} is not a multiple of micro-batch {r.micro_batch} x --nproc "
                f"{args.nproc}; use a multiple of {args.nproc * r.micro_batch}, or set --nproc"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="quick",
                   help="preset rows: quick (2 recipe + 3 loop rows), check (2 + 3: the YAML as shipped and the whole "
                        "model compiled), smoke (check's rows on a small YAML, the first with the 1B YAML's "
                        "switches), levers (the whole model compiled, then without each of train.step_sync "
                        "and model.cast_weights, + loop c) or full (17 + 6)")
    p.add_argument("--model", default="recipes/configs/pretrain_llama_1b.yaml", help="pretraining YAML: shape, vocab")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per block (default: the YAML's data.seq_len)")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step, every row")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per recipe row; a loop uses one")
    p.add_argument("--switches", default=None, help="replace the recipe rows' switches: any of shipped, fast, whole (comma)")
    p.add_argument("--strategies", default=None, help="keep only the recipe rows of these strategies (comma)")
    p.add_argument("--peer-variants", default="abc", help="which plain loops run: any of a, b, c")
    p.add_argument("--peer-only", action="store_true", help="only the plain-loop rows")
    p.add_argument("--recipe-only", action="store_true", help="only the recipe rows")
    p.add_argument("--extra", nargs="*", default=[], help="more recipe overrides, after the row's own")
    p.add_argument("--workdir", default=None, help="where runs go (each deleted once read); default: a temp dir")
    p.add_argument("--row-timeout", type=float, default=1800, help="seconds before a row is killed (failed)")
    p.add_argument("--out", default=None, help="also write the header and table to this markdown file")
    p.add_argument("--save", default=None, help="also write the results, after every row, to this JSON file")
    p.add_argument("--merge", nargs="+", default=None, help="run nothing: one table from earlier --save files")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, trace this many more with torch.profiler (logging.profile) and print "
                        "one table per row: device busy %%, longest idle gaps, top kernels (0 = off)")
    p.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer_worker:
        print(json.dumps(peer_worker(json.loads(args.peer_worker))))
        return 0
    if args.merge:
        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        done = [r for s in saved for r in s["rows"]]
        header = [f"`{s['command']}`" for s in saved] + ["", *dict.fromkeys(s["header"] for s in saved)]
        return report(header, [Row(**r["row"]) for r in done], [r["result"] for r in done], args.out)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config.load import load_config
    from toolkit.training.metrics import model_size
    from toolkit.training.recipe_config import PretrainConfig

    if args.steps < 1 or args.warmup < 0 or args.profile < 0:
        raise SystemExit(f"--steps {args.steps} --warmup {args.warmup} --profile {args.profile}: time at least 1 "
                         "step, warm up and profile 0 or more")
    cfg = load_config(PretrainConfig, args.model, [])
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    args.seq_len = args.seq_len or cfg.data.seq_len
    rows = select_rows(args)
    # The model both sides train: the YAML's architecture with the YAML's tokenizer.vocab_size.
    vocab = cfg.tokenizer.vocab_size
    facts = {"model_type": cfg.model.model_type, "sizes": cfg.model.config, "vocab": vocab, "seed": cfg.seed}
    with torch.device("meta"):
        config = AutoConfig.for_model(cfg.model.model_type, **{**cfg.model.config, "vocab_size": vocab})
        n_params, flops_token = model_size(AutoModelForCausalLM.from_config(config), args.seq_len)
    header = [
        f"`python bench/gpu_throughput.py {' '.join(sys.argv[1:])}`",
        "",
        machine(),
        f"{args.model}: {cfg.model.model_type}, {n_params:,} parameters, vocab {vocab}, seq_len {args.seq_len}, "
        f"{flops_token / 1e9:.2f} GFLOP/token; {args.global_batch} sequences "
        f"({args.global_batch * args.seq_len:,} tokens) per optimizer step; "
        f"steps {args.warmup + 1}..{args.warmup + args.steps} timed",
    ]

    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-", dir=args.workdir) as tmp:
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            workdir = Path(tmp) / f"row-{i}"
            workdir.mkdir()
            if row.kind == "recipe":
                res = run_recipe(row, args, vocab, workdir)
            else:
                res = run_peer(row, args, facts, workdir)
            results.append(res)
            said = res.get("failed") or res.get("skipped") or f"{res['tokens_per_s']:,.0f} tokens/s"
            if "loss_first" in res:  # the loop's sanity check: random tokens stay near ln(vocab)
                said += f", loss {res['loss_first']:.3f} -> {res['loss_last']:.3f}"
            print(f"[{i + 1}/{len(rows)}] {row.kind} {row.strategy} {row.checkpointing} mb {row.micro_batch} "
                  f"{row.switches}: {said} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            if args.save:  # after every row: a command cut off by a time limit keeps what it measured
                done = [{"row": asdict(r), "result": x} for r, x in zip(rows, results, strict=False)]
                record = {"command": header[0].strip("`"), "header": "\n".join(header[2:]), "rows": done}
                Path(args.save).write_text(json.dumps(record, indent=1))
    return report(header, rows, results, args.out)


def report(header: list[str], rows: list[Row], results: list[dict], out: str | None) -> int:
    on_cpu = any("peak_rss_mb" in r and "cuda_max_allocated_mb" not in r for r in results)
    notes = [
        "tokens/s: all ranks' tokens / wall time of the timed steps; ratio: tokens/s per GPU over the best "
        "plain loop's; peak GB: torch.cuda.max_memory_allocated of the largest rank; planned GB: recipes/plan.py's "
        "peak for the row (GiB, as the peak), and its distance from the measured one"
        + (f". {CPU_NOTE}" if on_cpu else ""),
        f"recipe rows: accelerate launch ... recipes/pretrain.py --config MODEL {' '.join(QUIET)} logging.every=WARMUP "
        "and the row's "
        "model.gradient_checkpointing, train.micro_batch_size and switches "
        f"(fast: {' '.join(SWITCHES['fast'][0])})",
    ]
    text = "\n".join([*header, "", *table(rows, results), "", *notes, *curves(rows, results), *profiles(rows, results)])
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
