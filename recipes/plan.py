"""Which strategy, checkpointing and micro-batch fit a run on your GPUs, before you launch it.

    python recipes/plan.py --config recipes/configs/pretrain_llama_1b.yaml --gpus 8 --gpu-memory 80GB
    python recipes/plan.py --config recipes/configs/finetune_smollm2_lora.yaml --gpus 1 --gpu-memory 24GB --json
    python recipes/plan.py --config recipes/configs/finetune_smollm2_lora.yaml --cpu --gpus 2 --gpu-memory 12GB

Reads the recipe YAML and key=value overrides as the recipe does, builds the model on the meta
device (no weights, no GPU) and, for every accelerate config in accelerate_configs/ x gradient
checkpointing (none / every_k / selective / full; selective for a dense model on a data-parallel
layout, where it is modelled) x micro-batch, estimates the per-GPU peak broken into
parameters, gradients, optimizer state (fp32 masters included), activations, logits and loss,
and communication/gathering buffers (toolkit.planner; docs/memory.md has the formulas).
`fits` means the peak plus the CUDA context and allocator slack stays under (1 - headroom) of the
GPU's memory. With --cpu it plans CPU processes instead (--gpus counts them, --gpu-memory is each one's share of
the host's memory; train.mixed_precision=auto is fp32 there, as on a CPU launch) and +rsv is what a process holds
beside its tensors: the runtime and its allocator's free memory (toolkit.planner.estimate.cpu_reserve). It then names the fastest row that fits and prints its launch line. The global
batch stays the recipe's: a micro-batch is listed only if it divides it over the data-parallel ranks.

Context, tensor and sequence parallel (fsdp_cp.yaml, fsdp_tp.yaml, zero3_sp.yaml) take cp, tp or sp
from the config's parallelism_config and make the --gpus processes cp (or tp, sp) x dp_shard,
dp_shard = GPUs / cp (the launch line says so). A model or config they refuse is not listed, with the
reason under the table; what a launch of them needs instead of the recipe's (sdpa for context and
sequence parallel, the full loss for tensor parallel) is estimated, said under the table and added to
the launch line. Tensor parallel under sdpa or eager attention also shards the sequence between the
layers (Megatron's sequence parallel: the residual stream and norms 1/tp per rank); under flex or flash
attention it keeps transformers' plan, the activations whole between the layers; the line under the
table says which. A mixture of experts keeps transformers' plan and spreads its experts over the tp
ranks (expert parallel); its rows assume balanced routing (a rank whose experts get more tokens holds
more), which the line under the table says.

Pipeline parallel (ddp.yaml with train.pipeline_stages=p, for p = 2 and 4 where p divides --gpus:
p stages x GPUs / p replicas) is listed as "pp<p> stage <s>": the row is the rank of its largest stage
s. A stage holds its layers' weights, gradients and AdamW state whole, its layers' activations for
each micro-batch in flight, the logits on the last stage alone, and a receive buffer per micro-batch;
under the launch's autocast, as DDP (fp16 is refused: the schedule's backward has no loss scaling).

Errors (one line, exit code 2): an unreadable config or override, any option's value outside what it takes
(--gpus below 1, --headroom outside [0, 0.9), a --gpu-memory that is not a size or is none, a --micro-batch
that is not sizes of 1 or more), argparse's own refusals, a model the planner does not model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.config.errors import UserError  # noqa: E402
from toolkit.config.files import read_config_file  # noqa: E402
from toolkit.config.load import load_config  # noqa: E402
from toolkit.launch.cli import OneLineParser  # noqa: E402
from toolkit.models.adapter import leave_out_bitsandbytes  # noqa: E402
from toolkit.planner import search  # noqa: E402
from toolkit.planner.estimate import gigabytes  # noqa: E402
from toolkit.planner.search import MICRO_BATCHES  # noqa: E402
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig  # noqa: E402


def parse_size(text: str) -> int:
    """--gpu-memory in bytes: a positive number with an optional unit (GB when none)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB|TB)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-memory {text!r} is not a size; write one GPU's memory, e.g. 80GB, 24GiB or 40960MiB")
    unit = (m.group(2) or "GB").lower()
    size = int(float(m.group(1)) * {"gb": 1e9, "gib": 2**30, "mb": 1e6, "mib": 2**20, "tb": 1e12}[unit])
    if size < 1e6:
        raise UserError(f"--gpu-memory {text} is too little to plan in; write one GPU's memory (1MB or more), e.g. 80GB or 24GiB")
    return size


def load_recipe_config(path: str, overrides: list[str]):
    """(recipe name, its validated config): a YAML with an adapter section is a fine-tune."""
    raw = read_config_file(path)  # as the user wrote it: Path("") would be the folder it runs in
    finetune = "adapter" in raw or any(o.startswith("adapter.") for o in overrides)
    cls = FinetuneConfig if finetune else PretrainConfig
    return ("finetune" if finetune else "pretrain"), load_config(cls, path, overrides)


def plan(args) -> tuple[list[dict], dict | None, str, list[str], object]:
    """(the rows, the fastest that fits, the recipe, lines under the table, its config) for the command line's."""
    recipe, cfg = load_recipe_config(args.config, args.overrides)
    rows, best, notes = search.plan(recipe, cfg, args.gpus, args.gpu_memory, args.headroom, args.micro_batch, args.cpu)
    return rows, best, recipe, notes, cfg


def launch_line(best: dict, recipe: str, args) -> str:
    replaced = ("train.micro_batch_size=", "model.gradient_checkpointing=", "train.pipeline_stages=",
                *(o.split("=")[0] + "=" for o in best["requires"]))
    stages = [f"train.pipeline_stages={best['pipeline_stages']}"] if best["pipeline_stages"] > 1 else []
    # quoted for the shell: an override may hold spaces (data.sources=[{name: web, ...}])
    extra = "".join(f" {shlex.quote(o)}" for o in [*(o for o in args.overrides if not o.startswith(replaced)),
                                                    *best["requires"], *stages])
    groups = f" --parallelism_config_dp_shard_size {best['dp_shard']}" if best["cp"] * best["tp"] * best["sp"] > 1 else ""
    config = "ddp" if best["pipeline_stages"] > 1 else best["strategy"]
    settings = (f"--config {args.config} train.micro_batch_size={best['micro_batch_size']} "
                f"model.gradient_checkpointing={best['gradient_checkpointing']}{extra}")
    if Path.cwd().resolve() != ROOT:  # planned from elsewhere (llm-toolkit plan): the command that runs from there
        return f"llm-toolkit {recipe} --config_file {config} --num_processes {args.gpus}{groups} {settings}"
    return (f"bash recipes/launch.sh --config_file accelerate_configs/{config}.yaml --num_processes {args.gpus}{groups} "
            f"recipes/{recipe}.py {settings}")


def label(row: dict) -> str:
    """A row's strategy as the table names it: a pipeline by its stage count and largest stage."""
    return f"pp{row['pipeline_stages']} stage {row['stage']}" if row["pipeline_stages"] > 1 else row["strategy"]


LEGEND = ("per GPU, GB = 1e9 bytes; step: estimated step time relative to the fastest row (the ranking: a rule of "
          "thumb for recomputation, sharding's gathers, offload and pipeline bubbles, not a measurement); +rsv: the "
          "CUDA context and the allocator's slack beside the peak, which must fit too")


CPU_RSV = "the runtime (interpreter, torch, the data) and the memory the allocator keeps free (mimalloc)"


def table(rows: list[dict], args) -> str:
    gb = 1e9
    head = (f"{'strategy':<14}{'ckpt':<9}{'mb':>3}{'step':>6}{'params':>8}{'grads':>8}{'optim':>8}{'master':>8}"
            f"{'activ':>8}{'logits':>8}{'buffers':>8}{'peak':>8}{'+rsv':>7}  fits")
    fastest = min(r["relative_step_time"] for r in rows)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{label(r):<14}{r['gradient_checkpointing']:<9}{r['micro_batch_size']:>3}"
            f"{r['relative_step_time'] / fastest:>6.2f}"
            + "".join(f"{r[k + '_bytes'] / gb:>8.1f}" for k in ("params", "grads", "optimizer", "master", "activations", "logits_loss", "buffers"))
            + f"{r['peak_bytes'] / gb:>8.1f}{r['reserve_bytes'] / gb:>7.1f}  {'yes' if r['fits'] else 'no'}"
        )
    return "\n".join(lines)


def shortlist(rows: list[dict]) -> list[dict]:
    """Each strategy's fastest row that fits (its smallest when none does), fastest first."""
    by_strategy: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: (not r["fits"], r["relative_step_time"], r["peak_bytes"] if r["fits"] else 0)):
        by_strategy.setdefault(label(r), r)
    if not any(r["fits"] for r in by_strategy.values()):
        by_strategy = {k: min((r for r in rows if label(r) == k), key=lambda r: r["peak_bytes"]) for k in by_strategy}
    return sorted(by_strategy.values(), key=lambda r: (not r["fits"], r["relative_step_time"]))


def parser() -> OneLineParser:
    """The command line; every option's wrong values are refused in one line (tests/recipes/test_plan.py walks them)."""
    parser = OneLineParser("python recipes/plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a recipe YAML from recipes/configs/")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run will use (its world size)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB, 24GiB")
    parser.add_argument("--headroom", type=float, default=0.1, help=f"share of the GPU's memory kept free ({HEADROOM[0]}-"
                        f"{HEADROOM[1]}, the upper end excluded)")
    parser.add_argument("--micro-batch", help="comma-separated micro-batch sizes to list (default 1..32)")
    parser.add_argument("--cpu", action="store_true", help="plan CPU processes: --gpus counts them, --gpu-memory is "
                        "each one's share of the host's memory, +rsv the runtime and the allocator's free heap")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.add_argument("--all", action="store_true", help="list every row (strategy x recomputation x micro-batch), "
                        "not only each strategy's fastest that fits")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for the recipe")
    return parser


HEADROOM = (0, 0.9)


def check_args(args: argparse.Namespace) -> None:
    """Each option's value in its range, each refused in a line of its own, before any config is read."""
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus} must be at least 1: the GPUs the run will use")
    if not HEADROOM[0] <= args.headroom < HEADROOM[1]:  # nan fails too
        raise UserError(f"--headroom {args.headroom:g} must be at least {HEADROOM[0]} and below {HEADROOM[1]}: the share "
                        "of each GPU's memory kept free, e.g. 0.1")
    args.gpu_memory = parse_size(args.gpu_memory)
    args.micro_batch = parse_micro_batches(args.micro_batch)


def parse_micro_batches(text: str | None) -> tuple[int, ...]:
    """--micro-batch's sizes, in order, once each; MICRO_BATCHES when it is not given."""
    if text is None:
        return MICRO_BATCHES
    allowed = "give sizes of 1 or more separated by commas, e.g. 1,2,4"
    if not text.strip():
        raise UserError(f"--micro-batch {text!r} names no size; {allowed}, or leave it out for {','.join(map(str, MICRO_BATCHES))}")
    sizes = []
    for part in text.split(","):
        if not part.strip().isdigit():
            raise UserError(f"--micro-batch {text}: {part.strip()!r} is not a whole number; {allowed}")
        if int(part) < 1:
            raise UserError(f"--micro-batch {text}: {int(part)} is not a size; {allowed}")
        sizes.append(int(part))
    return tuple(sorted(set(sizes)))


def main(argv: list[str] | None = None) -> int:
    leave_out_bitsandbytes()  # a QLoRA is planned on the meta device, without its 4-bit kernels
    try:
        args = parser().parse_args(argv)
        check_args(args)
        rows, best, recipe, notes, cfg = plan(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print("".join(f"{n}\n" for n in notes), end="", file=sys.stderr)
        print(json.dumps(rows, indent=1))
        return 0
    budget = args.gpu_memory * (1 - args.headroom) / 1e9
    unit, units = ("CPU process", "CPU process(es)") if args.cpu else ("GPU", "GPU(s)")
    if best is None:
        smallest = min(rows, key=lambda r: r["peak_bytes"])
        print(f"nothing fits {args.gpus} {units} of {gigabytes(args.gpu_memory)}: the smallest is {label(smallest)} / "
              f"{smallest['gradient_checkpointing']} / micro-batch {smallest['micro_batch_size']} at "
              f"{gigabytes(smallest['peak_bytes'])} per {unit}; {search.nothing_fits(recipe, cfg, rows)}")
    else:
        print(f"fastest that fits: {label(best)}, gradient checkpointing {best['gradient_checkpointing']}, "
              f"micro-batch {best['micro_batch_size']} ({best['peak_bytes'] / 1e9:.1f} GB peak per {unit}, "
              f"{(best['peak_bytes'] + best['reserve_bytes']) / 1e9:.1f} with +rsv, of {budget:.1f} usable: "
              f"{gigabytes(args.gpu_memory)} less {args.headroom:.0%} headroom)")
        print(launch_line(best, recipe, args))
    shown = rows if args.all else shortlist(rows)
    print(f"\n{'every row' if args.all else 'each strategy at its fastest that fits'} ({len(shown)} of {len(rows)}"
          f"{'' if args.all else '; --all lists every one'}), {args.gpus} {units} of {gigabytes(args.gpu_memory)}:")
    print(table(shown, args))
    print(LEGEND.replace("per GPU", "per CPU process").replace("the CUDA context and the allocator's slack", CPU_RSV)
          if args.cpu else LEGEND)
    if notes:
        print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `plan.py ... | head`: the reader has what it wanted, and no traceback follows
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
