"""Record the parity matrix's curves, or compare them with a recording; print one table.

    python bench/parity_curves.py --save runs/parity-before.json      # before a change to the loop
    python bench/parity_curves.py --compare runs/parity-before.json   # after it: bit-equal or not

A change that should not change behaviour (a refactor of the loop, the strategy setup or the
checkpoints) must leave every number a run logs bit-identical on CPU. This launches the runs of
the strategy matrix the way tests/recipes/test_strategies.py and test_finetune_strategies.py do
(tiny LLaMA, fp32, 2 CPU processes for each strategy, accumulation 2, gradient checkpointing,
evaluation and checkpoints on), the fine-tunes on the tiny base the pretraining wrote, and the
model-parallel layouts (a pipeline of 2 stages, tensor, context and sequence parallel, a mixture
of experts split over tensor-parallel ranks), then resumes from step 3: under the strategy that
saved it and converted to another (ZeRO-3 to FSDP2, FSDP2 to ZeRO-2, ZeRO-2 to one process, a
pipeline to DDP and back). It keeps every logged record except wall-clock figures (tokens/s, MFU, peak memory): losses,
learning rates, gradient norms, held-out losses, bytes held per rank and the bit-level parameter
digests at the end. Values of the keys both recordings have must be equal; a key that one has
and the other lacks (a new label) is listed, not failed.
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
TIMING = {"tokens_per_s", "mfu", "peak_memory"}

TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "tokenizer.vocab_size=512",
    "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2",
    "logging.every=1", "eval.every=3", "eval.blocks=8", "logging.trackers=[]", "checkpoint.every=3",
]
FT_TINY = [
    "data.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.lr=3e-3",
    "optim.warmup_steps=1", "logging.every=1", "eval.every=2", "eval.blocks=4", "logging.trackers=[]",
    "checkpoint.every=3",
]
MOE = ["model.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
       "model.config.moe_intermediate_size=64", "model.config.decoder_sparse_step=1",
       "model.config.router_aux_loss_coef=0.05"]
# ChatML's layout with the tiny BPE's EOS ending each turn: that tokenizer has no <|im_end|>, and a template whose
# answers end with no stop token is refused before the model loads (toolkit.data.template_check)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: str, config: str, overrides: list[str], strategy: str | None, env: dict) -> None:
    script = [f"recipes/{recipe}.py", "--config", f"recipes/configs/{config}", *overrides]
    if strategy is None:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
            "--num_processes", "2", "--main_process_port", str(free_port()), *script,
        ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")


def records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def record_all(work: Path, only: set[str] | None) -> dict[str, list[dict]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLM_TOOLKIT_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    chatml = work / "chatml.jinja"
    chatml.write_text(CHATML)
    base = work / "base"
    launch("pretrain", "pretrain_tiny.yaml", [*TINY, "train.max_steps=4", "checkpoint.every=0",
                                              "samples.max_new_tokens=0", f"output_dir={base}"], None, env)
    pre = [*TINY, "train.max_steps=6", "samples.max_new_tokens=0"]
    lora = [*FT_TINY, f"model.path={base / 'final'}", "data.format=chat", f"data.chat_template={chatml}",
            "adapter.dropout=0", "adapter.r=8", "train.max_steps=4", "samples.max_new_tokens=0"]
    full = [*FT_TINY, f"model.path={base / 'final'}", "adapter.method=full", "train.max_steps=4",
            "samples.max_new_tokens=0"]
    runs = {
        "pretrain 1 process": ("pretrain", "pretrain_tiny.yaml", pre, None),
        **{f"pretrain {s}": ("pretrain", "pretrain_tiny.yaml", [*pre, "model.gradient_checkpointing=full"], s)
           for s in ("ddp", "fsdp", "zero1", "zero2", "zero3")},
        "finetune lora chat 1 process": ("finetune", "finetune_smollm2_lora.yaml", lora, None),
        **{f"finetune lora chat {s}": ("finetune", "finetune_smollm2_lora.yaml", lora, s) for s in ("ddp", "zero3", "fsdp")},
        "finetune full text zero2": ("finetune", "finetune_smollm2_lora.yaml", full, "zero2"),
        # the model-parallel layouts (tests/recipes/test_*_parallel_training.py, test_moe.py)
        "pretrain pipeline 2 stages": ("pretrain", "pretrain_tiny.yaml", [*pre, "train.pipeline_stages=2"], "ddp"),
        **{f"pretrain {s}": ("pretrain", "pretrain_tiny.yaml", pre, s) for s in ("fsdp_tp", "fsdp_cp", "fsdp_sp", "zero3_sp")},
        "pretrain moe fsdp_tp": ("pretrain", "pretrain_tiny.yaml", [*pre, *MOE], "fsdp_tp"),
    }

    def step_3(run: str) -> str:
        return f"resume={work / run.replace(' ', '-') / 'checkpoints' / 'step-3'}"

    # resumed from step 3: as saved (each strategy's own loader), and converted to another strategy
    for s in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
        runs[f"resume {s} as saved"] = ("pretrain", "pretrain_tiny.yaml", [*pre, "model.gradient_checkpointing=full",
                                                                          step_3(f"pretrain {s}")], s)
    for source, target in (("zero3", "fsdp"), ("fsdp", "zero2"), ("zero2", None)):
        runs[f"resume {source} as {target or '1 process'}"] = (
            "pretrain", "pretrain_tiny.yaml", [*pre, "model.gradient_checkpointing=full", step_3(f"pretrain {source}")], target)
    runs["resume pipeline as ddp"] = ("pretrain", "pretrain_tiny.yaml", [*pre, step_3("pretrain pipeline 2 stages")], "ddp")
    runs["resume 1 process as pipeline"] = ("pretrain", "pretrain_tiny.yaml", [*pre, "train.pipeline_stages=2",
                                                                              step_3("pretrain 1 process")], "ddp")
    found = {}
    for name, (recipe, config, overrides, strategy) in runs.items():
        if only and not any(word in name for word in only):
            continue
        out = work / name.replace(" ", "-")
        print(f"  {name} ...", file=sys.stderr, flush=True)
        launch(recipe, config, [*overrides, f"output_dir={out}"], strategy, env)
        found[name] = records(out)
    return found


def first_difference(a: list[dict], b: list[dict]) -> tuple[str, set[str]]:
    """(the first value that differs, or ""; keys one recording has and the other lacks)."""
    if len(a) != len(b):
        return f"{len(a)} records against {len(b)}", set()
    changed_keys: set[str] = set()
    for ra, rb in zip(a, b, strict=True):
        changed_keys |= set(ra) ^ set(rb)
        shared = sorted(k for k in set(ra) & set(rb) if ra[k] != rb[k])
        if shared:
            return f"step {ra.get('step')}: " + ", ".join(f"{k} {ra[k]!r} -> {rb[k]!r}" for k in shared), changed_keys
    return "", changed_keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the recorded curves to this JSON file")
    what.add_argument("--compare", type=Path, help="record again and compare with this JSON file")
    parser.add_argument("--only", default="", help="comma-separated words: record only runs whose name has one")
    args = parser.parse_args()
    only = {w for w in args.only.split(",") if w} or None
    with tempfile.TemporaryDirectory() as tmp:
        now = record_all(Path(tmp), only)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(now, indent=1))
        print(f"{'run':<32}{'records':>8}")
        for name, rows in now.items():
            print(f"{name:<32}{len(rows):>8}")
        return
    before = json.loads(args.compare.read_text())
    print(f"{'run':<32}{'records':>8}  {'bit-equal':<10}keys added or removed")
    failed = 0
    for name, rows in now.items():
        diff, keys = first_difference(before[name], rows) if name in before else ("not in the recording", set())
        failed += bool(diff)
        print(f"{name:<32}{len(rows):>8}  {'yes' if not diff else 'NO: ' + diff:<10}{', '.join(sorted(keys)) or '-'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
