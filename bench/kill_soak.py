"""Hard kills anywhere in a run, then resume=auto: does it come back bit for bit, losing nothing?

    python bench/kill_soak.py                          # 10 random kill points per strategy, seed 0
    python bench/kill_soak.py --kills 3 --strategies ddp zero3 --seed 7
    python bench/kill_soak.py --async --strategies ddp fsdp   # checkpoints written in the background

For each strategy (DDP, FSDP2, ZeRO-2, ZeRO-3; 2 CPU processes, a tiny LLaMA, fp32, accumulation
2, checkpoints every 2 steps with keep_last=1, evaluation every 3), it trains once without a fault,
then, for each kill point drawn at random (toolkit.run.faults: the point, the step and the rank that
sends itself SIGKILL):
  1. launches the run with the kill planned, and checks the folder the kill left: every complete
     checkpoint passes its manifest, the newest one saved before the kill is there (keep_last
     included), and final/ is absent or complete;
  2. relaunches with resume=auto, and checks that it resumed from that newest complete checkpoint
     (never a partial one), and that its loss curve and final/ weights equal the uninterrupted
     run's bit for bit.
With --async (checkpoint.async_save=true; DDP and FSDP2) the points inside the background writes join the draw.
A kill while training may come before or after the save of a step before it completed: the relaunch must resume from
the newest complete checkpoint on disk, which lies between the newest save that had to be complete (the one before
the last save begun: a save completes before the next begins) and the newest begun.
It prints one table, a row per kill, and the line "N kill points, N resumed bit-exact, 0 lost".
tests/recipes/test_strategies.py runs the same harness in a small deterministic form.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.run.faults import ENV as KILL_ENV  # noqa: E402
from toolkit.run.faults import LOG_ENV  # noqa: E402
from toolkit.run.folder import RunDir  # noqa: E402
from toolkit.run.manifest import check_manifest  # noqa: E402

STRATEGIES = ["ddp", "fsdp", "zero2", "zero3"]
ASYNC = "checkpoint.async_save=true"
TINY = [
    "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "tokenizer.vocab_size=512",
    "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2",
    "logging.every=1", "eval.every=3", "eval.blocks=8", "logging.trackers=[]", "samples.max_new_tokens=0",
    "train.max_steps=6", "train.collective_timeout_s=120",
]
SAVES = ["checkpoint.every=2", "checkpoint.keep_last=1"]
TRAINING_POINTS = ("forward", "backward", "between_micro_batches", "after_optimizer")
MAIN_ONLY = ("save.manifest", "save.state_file", "prune", "final")  # what only the main process does
TIMEOUT_S = 600


def setting(overrides: list[str], key: str) -> int:
    return int(next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(key + "=")))


def saved_steps(overrides: list[str]) -> list[int]:
    """The steps a run of `overrides` checkpoints at (every N, and always the last)."""
    every, last = setting(overrides, "checkpoint.every"), setting(overrides, "train.max_steps")
    return sorted({*range(every, last + 1, every), last}) if every else [last]


def possible_kills(overrides: list[str], strategy: str) -> list[str]:
    """Every kill point a run of `overrides` under `strategy` reaches, as LLM_TOOLKIT_KILL items."""
    last, every_eval = setting(overrides, "train.max_steps"), setting(overrides, "eval.every")
    saves, keep = saved_steps(overrides), setting(overrides, "checkpoint.keep_last")
    evals = sorted({*range(every_eval, last + 1, every_eval), last}) if every_eval else [last]
    kills = [f"{p}@{s}/{r}" for p in TRAINING_POINTS for s in range(1, last + 1) for r in (0, 1)]
    kills += [f"eval@{s}/{r}" for s in evals for r in (0, 1)]
    kills += [f"{p}@{s}/{r}" for p in ("save.start", "save.rank_files") for s in saves for r in (0, 1)]
    if ASYNC in overrides:  # DDP's files are the main process's alone; under FSDP2 each rank writes its shards
        kills += [f"save.background@{s}/{r}" for s in saves for r in ((0, 1) if strategy == "fsdp" else (0,))]
    kills += [f"{p}@{s}/0" for p in ("save.manifest", "save.state_file") for s in saves]
    kills += [f"prune@{s}/0" for s in saves[keep:]]
    return [*kills, "final/0"]


def expected_resume(kill: str, overrides: list[str]) -> int:
    """The checkpoint step a relaunch after `kill` must resume from (0: a fresh start): the
    newest whose save finished (state file written) before the kill. In the background (ASYNC), the
    newest one that may have: see resume_range."""
    point, _, rest = kill.partition("@")
    saves = saved_steps(overrides)
    if point.startswith("final"):
        return saves[-1]
    step = int(rest.split("/")[0])
    done = step if point in ("save.state_file", "prune") else step - 1  # eval at N runs before N's save
    return max((s for s in saves if s <= done), default=0)


def resume_range(kill: str, overrides: list[str]) -> tuple[int, int]:
    """The steps a relaunch after `kill` may resume from, oldest and newest. Blocking, one step. In the background a
    save completes at the first step after its writes end, and at the latest when the next save begins (its own
    points, save.*, and prune, are reached in order): a kill while training may come before or after."""
    newest = expected_resume(kill, overrides)
    point = kill.partition("@")[0]
    if ASYNC not in overrides or point.startswith(("save.", "prune", "final")):
        return newest, newest
    saves = saved_steps(overrides)
    return max((s for s in saves if s < newest), default=0), newest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    strategy: str, out: Path, overrides: list[str], cache: Path, kills: list[str] = (), kill_log: Path | None = None,
    restarts: int = 0,
) -> subprocess.CompletedProcess:
    """One 2-process `accelerate launch` of the pretraining recipe; `kills` planned (each fires
    once, logged in `kill_log`); `restarts` > 0 lets torchrun bring the ranks back after one dies."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
        "--num_processes", "2", "--main_process_port", str(free_port()),
        *(["--max_restarts", str(restarts), "--monitor_interval", "1"] if restarts else []),
        "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", *overrides, f"output_dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLM_TOOLKIT_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop(KILL_ENV, None)
    if kills:
        env[KILL_ENV], env[LOG_ENV] = ",".join(kills), str(kill_log)
    # A session of its own, so that a hang is killed with every rank (their pipes would block the read).
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            stderr += f"\n[kill_soak] still running after {TIMEOUT_S} s: killed"
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)


def resumed_steps(log: str) -> list[int]:
    """The checkpoint steps a launch's log says it resumed from, in order."""
    return [int(s) for s in re.findall(r"resumed from \S*step-(\d+) at step", log)]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def audit(out: Path, newest_saved: int) -> list[str]:
    """What a kill must never leave: a complete checkpoint that fails its manifest, the newest
    checkpoint saved before the kill missing, a final/ that is there but not whole."""
    run, problems = RunDir(out), []
    complete = run.complete_checkpoints()
    for folder in complete:
        if (problem := check_manifest(folder)) is not None:
            problems.append(f"complete checkpoint {folder.name} is damaged: {problem}")
    if newest_saved and run.checkpoint(newest_saved) not in complete:
        problems.append(f"checkpoint step-{newest_saved}, saved before the kill, is gone or incomplete")
    if run.final.exists():
        problems += [f"final/ lacks {name}" for name in ("config.json", "model.safetensors", "tokenizer.json")
                     if not (run.final / name).is_file()]
    return problems


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def compare(out: Path, reference: Path) -> list[str]:
    """The finished run against the uninterrupted one: every loss and the final weights, bit for bit."""
    got, want = losses(out), losses(reference)
    problems = [f"step {s}: loss {got.get(s)!r}, uninterrupted {want[s]!r}" for s in want if got.get(s) != want[s]]
    if sorted(got) != sorted(want):
        problems.append(f"logged steps {sorted(got)}, uninterrupted {sorted(want)}")
    if not RunDir(out).final.is_dir():
        problems.append("no final/ after the resumed run")
    elif not same_weights(RunDir(out).final, RunDir(reference).final):
        problems.append("final/ weights differ from the uninterrupted run's")
    return problems


def kill_and_resume(strategy: str, kill: str, work: Path, reference: Path, overrides: list[str], cache: Path) -> dict:
    """One soak cycle; the row of the table."""
    out, log = work / "run", work / "kills.log"
    killed = launch(strategy, out, overrides, cache, [kill], log)
    fired = log.is_file() and kill in log.read_text().split()
    row = {"strategy": strategy, "kill": kill, "fired": fired, "resumed": False, "bit_exact": False, "lost": False,
           "problems": []}
    if not fired:
        row["problems"].append(f"the kill never fired (exit {killed.returncode}): {killed.stderr[-300:]}")
        return row
    oldest, newest = resume_range(kill, overrides)
    complete = [int(c.name.split("-")[1]) for c in RunDir(out).complete_checkpoints()]
    want = max(complete, default=0) if oldest < newest else newest
    lost = audit(out, want)
    if not oldest <= want <= newest:
        lost.append(f"the newest complete checkpoint after the kill is step {want}, expected {oldest} to {newest}")
    again = launch(strategy, out, [*overrides, "resume=auto"], cache)
    row["resumed"] = again.returncode == 0
    if again.returncode == 0:
        lost += audit(out, saved_steps(overrides)[-1])
    row["lost"], row["problems"] = bool(lost), lost
    if not row["resumed"]:
        row["problems"].append(f"resume=auto exited {again.returncode}: {again.stderr[-600:]}")
        return row
    if resumed_steps(again.stdout + again.stderr) != ([want] if want else []):
        row["problems"].append(f"resumed from {resumed_steps(again.stdout + again.stderr)}, expected step {want}")
    differences = compare(out, reference)
    row["bit_exact"] = not differences
    row["problems"] += differences
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="random kill points per strategy")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async", dest="background", action="store_true",
                        help="checkpoints written in the background (checkpoint.async_save; DDP and FSDP2 only)")
    args = parser.parse_args()
    overrides = [*TINY, *SAVES, *([ASYNC] if args.background else [])]
    draw = random.Random(args.seed)
    rows = []
    print(f"{'strategy':<8} {'kill point':<28} {'resumed':<8} {'bit-exact':<10} problems", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        for strategy in args.strategies:
            reference = work / f"{strategy}-reference"
            done = launch(strategy, reference, overrides, cache)
            if done.returncode != 0:
                sys.exit(f"the uninterrupted {strategy} run failed:\n{done.stderr[-4000:]}")
            for i, kill in enumerate(draw.sample(possible_kills(overrides, strategy), args.kills)):
                row = kill_and_resume(strategy, kill, work / f"{strategy}-{i}", reference, overrides, cache)
                rows.append(row)
                print(f"{strategy:<8} {kill:<28} {'yes' if row['resumed'] else 'NO':<8} "
                      f"{'yes' if row['bit_exact'] else 'NO':<10} {'; '.join(row['problems']) or '-'}", flush=True)
    exact = sum(r["bit_exact"] for r in rows)
    lost = sum(r["lost"] for r in rows)
    print(f"{len(rows)} kill points, {exact} resumed bit-exact, {lost} lost")
    sys.exit(0 if exact == len(rows) and not lost else 1)


if __name__ == "__main__":
    main()
