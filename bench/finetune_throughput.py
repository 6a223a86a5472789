"""Fine-tuning on one GPU: recipes/finetune.py against transformers.Trainer with peft, and the longest sequence.

    python bench/finetune_throughput.py --out finetune.md       # one GPU: SmolLM2-135M and Llama-3.1-8B shapes
    python bench/finetune_throughput.py --smoke                 # the same code paths on CPU, tiny shapes

The bases: no checkpoint is carried to a lent GPU machine (no network there), so each base is random weights of the
architecture, built once on the GPU in bf16 (an 8B: seconds) and saved as safetensors into the work folder, which
is deleted at the end; the recipe (model.path=FOLDER) and the Trainer load that same folder. SmolLM2-135M's shape
(hidden 576, 30 layers, 9 heads, 3 key/value heads, a tied head of 49,152 rows) and the architecture
recipes/configs/bases/meta-llama/Llama-3.1-8B-Instruct/config.json ships (128,256 rows). The tokenizer is the
cheapest that keeps ids within every vocabulary: a 4,096-token BPE of the CPython docs (pretrain_tiny.yaml's,
toolkit.data.tokenizer.train_bpe), trained in a second and saved into both folders.

Rows, each in a process of its own, the YAML as it ships plus only what the bench needs (model.path, the data,
data.seq_len, the batch, the steps, adapter.merge=false, no eval, samples, trackers or periodic checkpoints):
- throughput: finetune_smollm2_lora.yaml and finetune_smollm2_full.yaml (512 x 16 a step), and
  finetune_llama3.1_8b_lora.yaml and _qlora.yaml (2,048 x 4 a step, one micro-batch), all on the CPython docs as
  plain text (data.format=text: the Trainer gets the same tokens; the 8B YAMLs' UltraChat is on the Hub), the recipe's
  tokens/s from its metrics.jsonl against transformers.Trainer + peft set up as a user does for continued pretraining
  (the Hugging Face examples' run_clm: texts tokenized, concatenated, cut into blocks; the YAML's LoRA, dtype,
  recomputation as gradient checkpointing, learning rate; the 4-bit NF4 base of toolkit.models.adapter for QLoRA,
  prepare_model_for_kbit_training), timed by a callback from the end of step --warmup to the end of the last;
- the longest sequence at micro-batch 1 of the 8B LoRA and QLoRA YAMLs (as shipped: their attention and loss, with
  every layer recomputed, LONGEST): the planner's largest data.seq_len (a multiple of 1,024) that fits this GPU's memory with plan.py's 10 %
  headroom, and the largest within 80 GB (Unsloth's figure is for 80 GB), then 2 steps of the recipe at the first,
  on the CPython docs repeated to fill them: its peak from the run's own metrics (torch.cuda.max_memory_allocated),
  or "out of memory".
Beside each recipe row: the planner's peak for it (toolkit.planner.search, as recipes/plan.py --gpus 1 --micro-batch
MB gives it: the ddp row of the YAML's recomputation). Issue 65's goals: the recipe 1.3x the Trainer or more for
LoRA and full; the 8B QLoRA's longest sequence within 80 GB at least Unsloth's 342,733 tokens (HF + FA2: 28,454).
Time: ~8.5 minutes on an H200 by its own estimate (ESTIMATE, printed first; --budget bounds the longest-sequence
runs); --smoke ~2 minutes on 2 CPU cores, where the SmolLM2 LoRA row is left out (its code is the 8B LoRA row's) and
the QLoRA's longest sequence is planned, not run (its code is the QLoRA row's and the LoRA's longest).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

# bench/: the recipe's logging cadence and its rate over the timed steps, the planner module, a launch's failure line
from gpu_throughput import launch, log_every, plan_module, timed_rate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "configs"
LLAMA_8B = CONFIGS / "bases" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048, "vocab_size": 49152,
           "tie_word_embeddings": True}
# --smoke: each base at a tiny width with its own vocabulary (the 8B's 128,256-row head and its chunked loss kept)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
# (row, YAML, base): the throughput rows
ROWS = [
    ("SmolLM2-135M LoRA", "finetune_smollm2_lora.yaml", "smollm2"),
    ("SmolLM2-135M full", "finetune_smollm2_full.yaml", "smollm2"),
    ("Llama-3.1-8B-shaped LoRA", "finetune_llama3.1_8b_lora.yaml", "llama8b"),
    ("Llama-3.1-8B-shaped QLoRA", "finetune_llama3.1_8b_qlora.yaml", "llama8b"),
]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
          "--num_processes", "1"]  # one GPU, the recipes' own launcher
QUIET = ["data.format=text", "data.val_fraction=0", "eval.every=0", "samples.max_new_tokens=0", "logging.trackers=[]",
         "checkpoint.every=0"]
UNSLOTH = "Unsloth publishes 342,733 tokens for Llama 3.1 8B QLoRA on 80 GB, and 28,454 for HF + FA2"
GB80 = 80 * 10**9
SMOKE_MEMORY = 2 * 10**9  # --smoke: a CPU process's share, small enough for a longest sequence a CPU runs in seconds
# Seconds each part takes on an H200, printed first. Measured (docs/benchmarks.md,
# 2026-11-26 and 2026-11-27): the SmolLM2 base's 2-step pretraining and the four SmolLM2 rows took 118 s, a row with the whole model
# compiled ~35 s more; a launch's setup ~10 s. Estimated for the rest: the pretraining gone (-25 s), a compiled
# layer ~20 s a recipe row; the 8B written once (16 GB from the GPU at ~1 GB/s) and read from the page cache at each
# load (~10 s), a layer compiled ~30 s, 6 steps of 8,192 tokens ~1 s each for LoRA, ~1.5 s for QLoRA (its 4-bit load
# ~20 s); a longest-sequence run: load, compile, the text tokenized (~10 s) and 2 steps of ~110k tokens (~15 s each
# under flex attention; under sdpa's (seq x seq) mask ~2 minutes each: --budget then cuts the runs short).
ESTIMATE = {"bases": 40, "SmolLM2 rows": 120, "8B LoRA rows": 95, "8B QLoRA rows": 110, "longest-sequence runs": 140}


def recipe_overrides(yaml: str, base: Path, data: str, seq_len: int, batch: int, steps: int, warmup: int) -> list[str]:
    """The bench's overrides of a shipped YAML: the base, the data, the shape of a step, the steps, quiet."""
    lora = yaml != "finetune_smollm2_full.yaml"
    return [f"model.path={base}", f"data.path={data}", f"data.seq_len={seq_len}", f"train.global_batch_size={batch}",
            f"train.micro_batch_size={batch}", "train.epochs=null", f"train.max_steps={warmup + steps}", *QUIET, log_every(warmup),
            *(["adapter.merge=false"] if lora else [])]


def planned(yaml: str, overrides: list[str], memory: int, gpu: bool) -> dict:
    """The planner's ddp row for the YAML with `overrides` at its own micro-batch and recomputation (plan.py --gpus 1)."""
    plan = plan_module()
    _, cfg = plan.load_recipe_config(str(CONFIGS / yaml), overrides)
    rows, _, _ = plan.search.plan("finetune", cfg, 1, memory, 0.1, (cfg.train.micro_batch_size,), not gpu)
    return next(r for r in rows if r["strategy"] == "ddp" and r["gradient_checkpointing"] == cfg.model.gradient_checkpointing)


def planned_gib(yaml: str, overrides: list[str], memory: int, gpu: bool) -> float:
    """The planned peak in GiB, as measured: the tensors' (max_memory_allocated) on a GPU, with the runtime and the
    allocator's free memory on CPU (the peak RSS)."""
    row = planned(yaml, overrides, memory, gpu)
    return (row["peak_bytes"] + (0 if gpu else row["reserve_bytes"])) / 2**30


# the longest sequence is searched with every layer recomputed (the least a step holds: Unsloth's figure recomputes too),
# whatever recomputation the YAML ships for its own sequence length
LONGEST = ["model.gradient_checkpointing=full"]


def longest(yaml: str, base: Path, memory: int, gpu: bool, step: int) -> int:
    """The planner's largest data.seq_len (a multiple of `step`) that fits `memory` at micro-batch 1, 0 if none."""
    lo, hi = 0, 1 << 21  # 2M tokens: beyond any GPU's memory for these shapes
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        fits = planned(yaml, [*recipe_overrides(yaml, base, "null", mid, 1, 1, 0), *LONGEST], memory, gpu)["fits"]
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def run_recipe(yaml: str, overrides: list[str], work: Path, name: str, timeout: float = 600) -> dict:
    """tokens/s of the timed steps and the run's peak (GiB), or why it did not run."""
    out = work / name
    cmd = [*LAUNCH, "recipes/finetune.py", "--config", str(CONFIGS / yaml), f"output_dir={out}", *overrides]
    rc, why = launch(cmd, work / name, timeout)
    from toolkit.training.metrics import read_metrics

    records = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    shutil.rmtree(out, ignore_errors=True)
    if rc:  # the recipe's own refusal is a line that starts "error:"; a refusal or an OOM is the row's finding
        if why.startswith("error:"):
            return {"said": f"refused: {why.removeprefix('error: ').split(';')[0]}"}
        return {"said": why} if why == "out of memory" else {"failed": why}
    memory = next(r["peak_memory"][0] for r in records if "peak_memory" in r)
    peak = memory.get("cuda_max_allocated_mb", memory.get("peak_rss_mb"))
    warmup = int(next(o for o in overrides if o.startswith("logging.every=")).split("=")[1])
    steps = int(next(o for o in overrides if o.startswith("train.max_steps=")).split("=")[1]) - warmup
    return {"tokens_per_s": timed_rate(records, warmup, steps)[0], "peak_gib": peak / 1024}


def base_worker(spec: dict) -> dict:
    """Random weights of each of spec's architectures, built on the GPU if there is one, in bf16, saved with the
    tokenizer into a folder of that name."""
    from pydoc_data.topics import topics

    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.data.tokenizer import train_bpe

    tokenizer = train_bpe(datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]}), 4096)
    gpu = torch.cuda.is_available()
    params = {}
    for folder, fields in spec["bases"].items():
        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        # the base's own special ids (128,000 and on for Llama 3.1) are no tokens of this tokenizer
        config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(0)
        with torch.device("cuda" if gpu else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        params[Path(folder).name] = sum(p.numel() for p in model.parameters())
        del model  # the 8B's 16 GB, before the next
    return {"params": params, "memory": torch.cuda.get_device_properties(0).total_memory if gpu else 0}


def write_long_text(base: Path, tokens: int, path: Path) -> None:
    """The CPython docs, as often as `tokens` of the base's tokenizer need (the recipe splits them into paragraphs)."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = "\n\n".join(topics[k] for k in sorted(topics))
    per_copy = len(AutoTokenizer.from_pretrained(base)(text)["input_ids"])
    path.write_text("\n\n".join([text] * (tokens // per_copy + 1)))


def trainer_worker(spec: dict) -> dict:
    """transformers.Trainer + peft on the base, as a user sets it up from the YAML; tokens/s after the warm-up."""
    from pydoc_data.topics import topics

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from toolkit.config.load import load_config
    from toolkit.config.switches import Machine, resolve
    from toolkit.models.adapter import quantization_config
    from toolkit.parallel_layout import ParallelLayout
    from toolkit.training.recipe_config import FinetuneConfig

    cuda = torch.cuda.is_available()
    shipped = load_config(FinetuneConfig, CONFIGS / spec["yaml"], [])
    precision = "bf16" if cuda else "no"
    resolve(shipped, Machine("cuda" if cuda else "cpu", precision, ParallelLayout("ddp", 1)))  # as the recipe's launch
    a, recompute = shipped.adapter, shipped.model.gradient_checkpointing != "none"
    tokenizer = AutoTokenizer.from_pretrained(spec["base"])
    dtype = "auto" if shipped.model.dtype == "auto" else getattr(torch, shipped.model.dtype)  # as the recipe reads it
    extra = {"quantization_config": quantization_config(a, cuda, precision), "device_map": {"": 0} if cuda else None} if a.method == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=dtype, **extra)
    if a.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recompute)
    if a.is_lora:
        model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,
                                                 target_modules=list(a.target_modules), task_type="CAUSAL_LM"))
    # run_clm's group_texts: every text's tokens and an end of text, concatenated, cut into blocks
    ids = [t for key in sorted(topics) for t in [*tokenizer(topics[key])["input_ids"], tokenizer.eos_token_id]]
    seq = spec["seq_len"]
    blocks = [ids[i : i + seq] for i in range(0, len(ids) - seq + 1, seq)]
    data = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    steps = spec["warmup"] + spec["steps"]
    settings = TrainingArguments(
        output_dir=spec["work"], per_device_train_batch_size=spec["batch"], max_steps=steps,
        learning_rate=shipped.optim.lr, weight_decay=shipped.optim.weight_decay, max_grad_norm=shipped.optim.max_grad_norm,
        lr_scheduler_type="cosine", optim="adamw_torch_fused" if cuda else "adamw_torch", bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=recompute, gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=steps, save_strategy="no", report_to=[], dataloader_num_workers=0, seed=shipped.seed,
        disable_tqdm=True,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=settings, train_dataset=data, data_collator=default_data_collator, callbacks=[Clock()]).train()
    seconds = stamps[-1] - stamps[spec["warmup"] - 1] if spec["warmup"] else stamps[-1] - stamps[0]
    counted = spec["steps"] if spec["warmup"] else spec["steps"] - 1
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"tokens_per_s": counted * spec["batch"] * seq / seconds, "peak_gib": peak / 2**30, "trainable": trainable,
            "blocks": len(blocks)}


def worker(kind: str, spec: dict, work: Path, name: str) -> dict:
    """A worker of this file in a process of its own: its result, or why it failed."""
    log = work / name
    rc, why = launch([sys.executable, __file__, f"--{kind}-worker", json.dumps(spec)], log, 1200)
    if rc:
        return {"failed": why}
    return json.loads(log.with_suffix(".out").read_text().strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 timed steps: the code paths on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed steps a throughput row (default 4; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (1 with --smoke)")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole: the longest-sequence runs share "
                   "what is left of it, each cut short (and saying so) at its share")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--base-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trainer-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for kind, fn in (("base", base_worker), ("trainer", trainer_worker)):
        if getattr(args, f"{kind}_worker"):
            print(json.dumps(fn(json.loads(getattr(args, f"{kind}_worker")))))
            return 0
    args.steps = args.steps or (2 if args.smoke else 4)
    args.warmup = min(args.warmup, 1) if args.smoke else args.warmup
    # (seq_len, sequences a step) per base
    shapes = {"smollm2": (64, 4), "llama8b": (64, 4)} if args.smoke else {"smollm2": (512, 16), "llama8b": (2048, 4)}
    if not args.smoke:
        print("[estimate] on an H200: " + ", ".join(f"{k} ~{v} s" for k, v in ESTIMATE.items())
              + f": ~{sum(ESTIMATE.values())} s in all", file=sys.stderr)
    from toolkit.models.adapter import leave_out_bitsandbytes

    leave_out_bitsandbytes()  # this process plans the QLoRA on the meta device; its workers load bitsandbytes
    llama = {**json.loads(LLAMA_8B.read_text()), **(TINY if args.smoke else {})}
    configs = {"smollm2": {**SMOLLM2, **(TINY if args.smoke else {})}, "llama8b": llama}
    results: dict[str, dict] = {}
    deadline = time.perf_counter() + args.budget
    with tempfile.TemporaryDirectory(prefix="finetune-throughput-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        spec = {"bases": {str(work / name): config for name, config in configs.items()}}
        made = worker("base", spec, work, "bases")
        if "failed" in made:
            raise SystemExit(f"the bases: {made['failed']}")
        memory, gpu = made["memory"] or SMOKE_MEMORY, bool(made["memory"])
        print(f"[bases] {made['params']} parameters ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        # --smoke: the SmolLM2 LoRA row's code is the 8B LoRA row's (the recipe and the Trainer with peft)
        for row, yaml, base in ROWS[1:] if args.smoke else ROWS:
            seq_len, batch = shapes[base]
            overrides = recipe_overrides(yaml, work / base, "null", seq_len, batch, args.steps, args.warmup)
            t0 = time.perf_counter()
            recipe = run_recipe(yaml, overrides, work, f"recipe-{len(results)}")
            trainer = worker("trainer", {"yaml": yaml, "base": str(work / base), "seq_len": seq_len, "batch": batch,
                                         "warmup": args.warmup, "steps": args.steps, "work": str(work / "trainer")},
                             work, f"trainer-{len(results)}")
            results[row] = {"shape": f"{seq_len} x {batch}", "recipe": recipe, "trainer": trainer,
                            "planned_gib": planned_gib(yaml, overrides, memory, gpu)}
            print(f"[{row}] {json.dumps(results[row])} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        # the longest sequence: planned for this GPU and for 80 GB, confirmed on this GPU by 2 steps
        step = 64 if args.smoke else 1024
        for left, (row, yaml, base) in zip((2, 1), ROWS[2:], strict=True):
            t0 = time.perf_counter()
            length, within_80 = longest(yaml, work / base, memory, gpu, step), longest(yaml, work / base, GB80, gpu, step)
            long_text = work / f"long-{len(results)}.txt"  # a file of its own: the recipe caches what it tokenized
            write_long_text(work / base, 2 * length, long_text)  # the 2 steps' blocks
            overrides = [*recipe_overrides(yaml, work / base, str(long_text), length, 1, 1, 1), *LONGEST]
            if not length:
                recipe = {"said": "nothing fits"}
            elif args.smoke and "qlora" in yaml:  # its code: the QLoRA row's and the LoRA longest's
                recipe = {"said": "planned only with --smoke"}
            else:  # a step of ~110k tokens: seconds under flex attention, minutes under sdpa's (seq x seq) mask
                share = max(60.0, (deadline - time.perf_counter()) / left)
                recipe = run_recipe(yaml, overrides, work, f"recipe-{len(results)}", share)
                if recipe.get("failed", "").startswith("timed out"):  # not confirmed: the row's finding
                    recipe = {"said": f"not confirmed: {recipe['failed']}"}
            results[f"{row}, longest"] = {
                "shape": f"{length:,} x 1", "recipe": recipe, "trainer": {}, "within_80": within_80,
                "planned_gib": planned_gib(yaml, overrides, memory, gpu) if length else None}
            print(f"[{row}, longest] {json.dumps(results[f'{row}, longest'])} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)

    def rate(res: dict) -> str:
        said = res.get("said") or (f"**failed: {res['failed']}**" if "failed" in res else "-")
        return f"{res['tokens_per_s']:,.0f}" if "tokens_per_s" in res else said.replace("|", "/")

    def gib(res: dict) -> str:
        return f"{res['peak_gib']:.1f}" if "peak_gib" in res else "-"

    def ratio(res: dict) -> str:
        ok = "tokens_per_s" in res["recipe"] and "tokens_per_s" in res["trainer"]
        return f"{res['recipe']['tokens_per_s'] / res['trainer']['tokens_per_s']:.2f}x" if ok else "-"

    where = f"this GPU's {memory / 1e9:.0f} GB" if gpu else f"a CPU process of {memory / 1e9:.0f} GB (--smoke)"
    lines = [
        f"`python bench/finetune_throughput.py {' '.join(sys.argv[1:])}`: tokens x sequences a step as each row says, "
        f"steps {args.warmup + 1}..{args.warmup + args.steps} timed; longest: micro-batch 1, 2 steps, the 2nd timed",
        "",
        "| row | tokens x sequences | recipes/finetune.py tokens/s | transformers.Trainer tokens/s | recipe / Trainer | "
        "recipe peak GiB | planned GiB | Trainer peak GiB | longest within 80 GB (planned) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {row} | {res['shape']} | {rate(res['recipe'])} | {rate(res['trainer'])} | {ratio(res)} | "
          f"{gib(res['recipe'])} | {gib({'peak_gib': res['planned_gib']} if res['planned_gib'] else {})} | "
          f"{gib(res['trainer'])} | {format(res['within_80'], ',') if 'within_80' in res else ''} |"
          for row, res in results.items()),
        "",
        f"longest: the planner's largest data.seq_len at micro-batch 1 that fits {where} (plan.py's 10 % headroom), "
        f"every layer recomputed, run 2 steps; recipe peak: the run's torch.cuda.max_memory_allocated (on CPU its peak RSS); "
        f"planned: toolkit.planner's ddp row of the run's recomputation; {UNSLOTH}",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if any("failed" in res["recipe"] or "failed" in res["trainer"] for res in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
