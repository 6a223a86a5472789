"""eval.harness_tasks and recipes/evaluate.py where they were never run: on a GPU (issue 47). One table.

    python bench/harness_check.py --out harness.md          # a lent GPU: about 4 minutes
    python bench/harness_check.py --smoke --out harness.md  # the same commands on CPU, shorter: about 3 minutes

Rows, each a real command on the tests' two local tasks (tests/support/harness_tasks.py, from the CPython docs):
- finetune: SmolLM2-135M LoRA with eval.harness_tasks: the base and the result scored in memory on the GPU after
  training, rows in its before/after table;
- pretrain: pretrain_tiny with eval.every: each step's model scored by recipes/evaluate.py beside training, on the
  GPU training uses;
- evaluate: `accelerate launch --num_processes 1 recipes/evaluate.py` on the pretraining run's final/, whose scores
  must equal the run's own last `harness` row; on a machine of 2 or more GPUs, again over all of them (up to 8): the
  harness splits the documents, and the scores must be the one process's.
Each row: its exit code, seconds, the harness rows it logged, and what a check found wrong (empty: nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from harness_tasks import write_tasks  # noqa: E402

TASKS = "pydoc_continuation,pydoc_last_word"


def run(command: list[str], log: Path, timeout: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - t0


def harness_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if r.get("kind") == "harness"]


def said(rows: list[dict]) -> str:
    return "; ".join(f"{r['step']} {r['phase']}: " + ", ".join(f"{k.split('/', 2)[1]} {v:.3f}" for k, v in r.items()
                                                              if k.startswith("harness/")) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: fewer steps and documents")
    parser.add_argument("--out", default="harness.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="harness-check-"))
    tasks = work / "tasks"
    write_tasks(tasks)
    limit = ["eval.harness_limit=8"] if args.smoke else []
    common = [f"eval.harness_tasks=[{TASKS}]", f"eval.harness_include_path={tasks}", *limit]
    py = sys.executable
    rows, problems = [], []

    ft = work / "ft"
    code, seconds = run([py, "recipes/finetune.py", "--config", "recipes/configs/finetune_smollm2_lora.yaml",
                         f"output_dir={ft}", f"train.max_steps={2 if args.smoke else 60}", "data.seq_len=128",
                         "eval.blocks=8", "samples.max_new_tokens=0", "checkpoint.every=0", "logging.trackers=[]",
                         *common], work / "finetune.log", 900)
    found = harness_rows(ft)
    wrong = [] if [r["phase"] for r in found] == ["before", "after"] else ["not one before and one after row"]
    rows.append(("finetune (SmolLM2 LoRA, scored in memory)", code, seconds, said(found), wrong))

    pt = work / "pt"
    steps = 40 if args.smoke else 600
    code, seconds = run([py, "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", f"output_dir={pt}",
                         f"train.max_steps={steps}", f"eval.every={steps // 2}", "logging.trackers=[]",
                         "samples.max_new_tokens=0", *common], work / "pretrain.log", 900)
    found = harness_rows(pt)
    wrong = [] if [r["step"] for r in found] == [steps // 2, steps] else [f"rows at {[r['step'] for r in found]}"]
    rows.append(("pretrain (tiny, scored beside training)", code, seconds, said(found), wrong))

    out = work / "evaluate.json"
    launch = [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "recipes/evaluate.py"]
    code, seconds = run([*launch, "--from", str(pt), "--tasks", TASKS, "--include-path", str(tasks), "--output",
                         str(out), *(["--limit", "8"] if args.smoke else [])], work / "evaluate.log", 600)
    mine = json.loads(out.read_text())["llm_toolkit_evaluation"]["scores"] if out.exists() else {}
    last = {k: v for k, v in found[-1].items() if k.startswith("harness/")} if found else {}
    wrong = [] if mine and mine == last else [f"{mine} against the run's {last}"]
    rows.append(("evaluate (accelerate launch, 1 process) on its final/", code, seconds,
                 ", ".join(f"{k.split('/', 2)[1]} {v:.3f}" for k, v in mine.items()), wrong))

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count()
    if gpus > 1:  # the harness's own data parallelism: each process a share of the documents, the same scores
        split = work / "evaluate-split.json"
        launch[4] = str(min(gpus, 8))
        code, seconds = run([*launch, "--from", str(pt), "--tasks", TASKS, "--include-path", str(tasks), "--output",
                             str(split)], work / "evaluate-split.log", 600)
        theirs = json.loads(split.read_text())["llm_toolkit_evaluation"]["scores"] if split.exists() else {}
        wrong = [] if theirs and theirs == mine else [f"{theirs} against one process's {mine}"]
        rows.append((f"evaluate (accelerate launch, {launch[4]} processes) on its final/", code, seconds,
                     ", ".join(f"{k.split('/', 2)[1]} {v:.3f}" for k, v in theirs.items()), wrong))
    lines = [f"# eval.harness_tasks and recipes/evaluate.py on {device}{' (smoke)' if args.smoke else ''}", "",
             "| what | exit | s | harness rows | wrong |", "|---|---:|---:|---|---|"]
    for what, code, seconds, rows_said, wrong in rows:
        lines.append(f"| {what} | {code} | {seconds:.0f} | {rows_said} | {'; '.join(wrong)} |")
        if code != 0 or wrong:
            problems.append(what)
    lines += ["", f"logs: {work}"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
