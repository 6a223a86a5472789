"""Fine-tuning throughput on one GPU: recipes/finetune.py against transformers.Trainer, LoRA and full.

    python bench/finetune_throughput.py --out finetune.md       # SmolLM2-135M's shape, seq 512, 16 a step
    python bench/finetune_throughput.py --smoke                 # the same code paths on CPU, tiny shapes

The base: the SmolLM2 GGUF is too large to carry to a lent GPU machine, so recipes/pretrain.py first trains a
model of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 key/value heads, a tied head of 49,152 rows)
for a few steps, with its own tokenizer (a BPE of the CPython docs: ~6.7k tokens, ids within those rows). Both sides then fine-tune that base on the same text, the CPython docs embedded in
Python, with the same tokens a step (--batch sequences of --seq-len), the same LoRA (the shipped
finetune_smollm2_lora.yaml's r, alpha, dropout and targets) or all weights, fused AdamW and bf16 on a GPU:

- the recipe: `accelerate launch recipes/finetune.py --config recipes/configs/finetune_smollm2_lora.yaml
  model.path=BASE ...`, its own tokens/s from metrics.jsonl (packed blocks: every token is a useful one), twice: as
  the YAML ships (sdpa, no compilation: what the Trainer runs) and with gpu_throughput.py's whole switches
  (the whole forward and its loss compiled, flex_attention; sdpa with --smoke, CPU having no flex backward);
- transformers.Trainer as a user sets it up for continued pretraining (the Hugging Face examples' run_clm:
  the texts tokenized, concatenated and cut into blocks of --seq-len, so every token is useful there too),
  timed by a callback from the end of step --warmup to the end of the last.
Every row runs in a process of its own. The table gives useful tokens/s per row and the recipe's ratio to the
Trainer per method (issue 41's goal: 1.3x or more on both).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/: the recipe's switches, and the recipe's rate over the timed steps
from gpu_throughput import SWITCHES, log_every, timed_rate

ROOT = Path(__file__).resolve().parents[1]
LORA_YAML = ROOT / "recipes" / "configs" / "finetune_smollm2_lora.yaml"
SMOLLM2_SHAPE = ["model.config.hidden_size=576", "model.config.intermediate_size=1536", "model.config.num_hidden_layers=30",
                 "model.config.num_attention_heads=9", "model.config.num_key_value_heads=3",
                 "model.config.max_position_embeddings=2048", "model.config.vocab_size=49152"]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
          "--num_processes", "1"]  # one GPU, the recipes' own launcher
QUIET = ["data.path=null", "data.val_fraction=0", "eval.every=0", "samples.max_new_tokens=0", "logging.trackers=[]",
         "checkpoint.every=0"]


def base_model(args, work: Path) -> Path:
    """final/ of a few pretraining steps on the base's shape (pretrain_tiny.yaml's own with --smoke, of one layer: the
    whole model compiled holds every layer in its graph, and CPU compiles each ~10 s)."""
    out = work / "base"
    shape = ["model.config.num_hidden_layers=1"] if args.smoke else SMOLLM2_SHAPE
    cmd = [*LAUNCH, "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml",
           f"output_dir={out}", "train.max_steps=2", f"data.seq_len={args.seq_len}", *shape, *QUIET]
    run(cmd, work / "base.log")
    return out / "final"


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    if done.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-20:]
        raise SystemExit(f"{' '.join(cmd[:8])} ... exited {done.returncode}:\n" + "\n".join(tail))


def recipe_row(method: str, base: Path, args, work: Path, switches: list[str]) -> float:
    out = work / f"recipe-{method}"
    cmd = [*LAUNCH, "recipes/finetune.py", "--config", str(LORA_YAML), f"output_dir={out}",
           f"model.path={base}", f"adapter.method={method}", *(["adapter.merge=false"] if method != "full" else []),
           f"data.seq_len={args.seq_len}",
           f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
           f"train.max_steps={args.warmup + args.steps}", "optim.fused=auto", *QUIET, log_every(args.warmup),
           *switches]
    run(cmd, work / f"recipe-{method}{'-fast' if switches else ''}.log")
    from toolkit.training.metrics import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out, ignore_errors=True)
    return timed_rate(records, args.warmup, args.steps)[0]


def trainer_worker(spec: dict) -> dict:
    """transformers.Trainer on the base, as a user sets it up; tokens/s of the steps after the warm-up."""
    from pydoc_data.topics import topics

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import FinetuneConfig

    cuda = torch.cuda.is_available()
    shipped = load_config(FinetuneConfig, LORA_YAML, [])
    tokenizer = AutoTokenizer.from_pretrained(spec["base"])
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    if spec["method"] == "lora":
        a = shipped.adapter
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
        logging_steps=steps, save_strategy="no", report_to=[], dataloader_num_workers=0, seed=shipped.seed,
        disable_tqdm=True,
    )
    Trainer(model=model, args=settings, train_dataset=data, data_collator=default_data_collator, callbacks=[Clock()]).train()
    seconds = stamps[-1] - stamps[spec["warmup"] - 1] if spec["warmup"] else stamps[-1] - stamps[0]
    counted = spec["steps"] if spec["warmup"] else spec["steps"] - 1
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"tokens_per_s": counted * spec["batch"] * seq / seconds, "trainable": trainable, "blocks": len(blocks)}


def trainer_row(method: str, base: Path, args, work: Path) -> float:
    spec = {"method": method, "base": str(base), "seq_len": args.seq_len, "batch": args.batch, "warmup": args.warmup,
            "steps": args.steps, "work": str(work / f"trainer-{method}")}
    log = work / f"trainer-{method}.log"
    with open(log, "w") as err:
        done = subprocess.run([sys.executable, __file__, "--trainer-worker", json.dumps(spec)], cwd=ROOT,
                              capture_output=False, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"the Trainer row ({method}) exited {done.returncode}:\n" + log.read_text()[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="pretrain_tiny's shape, 2 timed steps: the code paths on CPU")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 512; 64 with --smoke)")
    p.add_argument("--batch", type=int, default=None, help="sequences a step (default 16; 4 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--trainer-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer_worker:
        print(json.dumps(trainer_worker(json.loads(args.trainer_worker))))
        return 0
    args.seq_len = args.seq_len or (64 if args.smoke else 512)
    args.batch = args.batch or (4 if args.smoke else 16)
    args.steps = args.steps or (2 if args.smoke else 10)
    if args.smoke:
        args.warmup = min(args.warmup, 1)
    # the whole model compiled: a 135M model's ~0.1 s step is mostly small kernels and their launches, which one
    # graph of the forward and its loss fuses (the Trainer runs eagerly)
    fast = [o for o in SWITCHES["whole"][0] if not (args.smoke and o.startswith("model.attn_implementation="))]
    sides = {"recipe": functools.partial(recipe_row, switches=[]), "recipe fast": functools.partial(recipe_row, switches=fast),
             "Trainer": trainer_row}
    if args.smoke:  # the fast rows run recipe_row's code; the shipped recipe is what the suite fine-tunes most
        del sides["recipe"]
    results: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="finetune-throughput-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        base = base_model(args, work)
        print(f"[base] {base} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        for method in ("lora", "full"):
            for side, row in sides.items():
                t0 = time.perf_counter()
                results[side, method] = row(method, base, args, work)
                print(f"[{side} {method}] {results[side, method]:,.0f} tokens/s ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr)
    def rate(side: str, m: str) -> str:
        return f"{results[side, m]:,.0f}" if (side, m) in results else "-"

    def ratio(side: str, m: str) -> str:
        return f"{results[side, m] / results['Trainer', m]:.2f}x" if (side, m) in results else "-"

    lines = [
        f"`python bench/finetune_throughput.py {' '.join(sys.argv[1:])}`: {args.batch} sequences of {args.seq_len} "
        f"tokens a step, steps {args.warmup + 1}..{args.warmup + args.steps} timed",
        "",
        "| method | recipes/finetune.py tokens/s | the recipe, whole model compiled | transformers.Trainer tokens/s | "
        "recipe / Trainer | fast / Trainer |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {m} | {rate('recipe', m)} | {rate('recipe fast', m)} | {rate('Trainer', m)} | {ratio('recipe', m)} | "
          f"{ratio('recipe fast', m)} |" for m in ("lora", "full")),
        "",
        f"fast switches: {' '.join(fast)}",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
