"""Hard kills anywhere in a run, then resume=auto: does it come back bit for bit, losing nothing?

    python bench/kill_soak.py                          # 10 random kill points per strategy, seed 0
    python bench/kill_soak.py --kills 3 --strategies ddp zero3 --seed 7
    python bench/kill_soak.py --async --strategies ddp fsdp   # checkpoints written in the background
    python bench/kill_soak.py --finetune-budget --kills 3 --strategies ddp zero3   # a budgeted LoRA fine-tune

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
With --finetune-budget the run is a LoRA fine-tune of a tiny base (the pretraining recipe's, 4 steps, made once) on a
mixture of Python source (code.txt) and the documentation, held to a forgetting budget (toolkit.training.forgetting)
with every lever at work: replay moves the documentation's share at its evaluations, selection saves the best step
within the budget when checkpoint.every does not fall on it (a forced save), keeps it through rotation and makes
final/ of it. Those saves depend on the numbers, so the steps a run saves at (and prunes at) are read from the
uninterrupted run's log, not derived from checkpoint.every; the evaluation before training (step 0) joins the kill
points; and the relaunch must also give the same budget rows (metrics.jsonl kind budget), tokens per source and
adapter/ as the uninterrupted run, bit for bit.
It prints one table, a row per kill, and the line "N kill points, N resumed bit-exact, 0 lost".
tests/recipes/test_strategies.py runs the same harness in a small deterministic form, and
tests/recipes/test_forgetting_kills.py its --finetune-budget form.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
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
PRETRAIN = ("recipes/pretrain.py", "recipes/configs/pretrain_tiny.yaml")  # (script, config) of a launch
FINETUNE = ("recipes/finetune.py", "recipes/configs/finetune_smollm2_lora.yaml")
# --finetune-budget: a LoRA fine-tune of the tiny base on Python source (80 %) and the documentation (20 %), the
# documentation's held-out loss held to a budget of +0.2 %. With these numbers replay moves its share at steps 2, 6,
# 8 and 10, the best step within the budget moves to 2, 4 and then 10 (saved there, checkpoint.every or not), and
# final/ is step 10's.
BUDGETED = [
    "data.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.lr=3e-3",
    "optim.warmup_steps=1", "logging.every=1", "eval.every=2", "eval.blocks=4", "logging.trackers=[]",
    "samples.max_new_tokens=0", "train.max_steps=12", "train.collective_timeout_s=120",
    "forgetting.general=docs", "forgetting.budget=0.002",
]
BUDGETED_SAVES = ["checkpoint.every=3", "checkpoint.keep_last=1"]
TRAINING_POINTS = ("forward", "backward", "between_micro_batches", "after_optimizer")
MAIN_ONLY = ("save.manifest", "save.state_file", "prune", "final")  # what only the main process does
TIMEOUT_S = 600


def setting(overrides: list[str], key: str) -> int:
    return int(next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(key + "=")))


def saved_steps(overrides: list[str]) -> list[int]:
    """The steps a run of `overrides` checkpoints at (every N, and always the last)."""
    every, last = setting(overrides, "checkpoint.every"), setting(overrides, "train.max_steps")
    return sorted({*range(every, last + 1, every), last}) if every else [last]


def pruning(saves: list[int], keep: int, kept: Callable[[int], int | None] = lambda step: None) -> list[int]:
    """The saves whose rotation deletes an older checkpoint (the `prune` point): all but the newest `keep` go, save
    the step a forgetting budget keeps at that save (`kept`), as toolkit.checkpoint.manager rotates them."""
    done, pruned = [], []
    for step in saves:
        done.append(step)
        spared = {*done[-keep:], kept(step)}
        if any(s not in spared for s in done):
            pruned.append(step)
        done = [s for s in done if s in spared]
    return pruned


@dataclass(frozen=True)
class Schedule:
    """What a run does at which step: its last step, the steps it checkpoints at, evaluates at (kill point eval),
    and whose save prunes an older checkpoint."""

    last: int
    saves: list[int]
    evals: list[int]
    prunes: list[int]

    @classmethod
    def configured(cls, overrides: list[str]) -> Schedule:
        """A pretraining run's, from its config alone."""
        last, every_eval = setting(overrides, "train.max_steps"), setting(overrides, "eval.every")
        saves = saved_steps(overrides)
        evals = sorted({*range(every_eval, last + 1, every_eval), last}) if every_eval else [last]
        return cls(last, saves, evals, pruning(saves, setting(overrides, "checkpoint.keep_last")))

    @classmethod
    def observed(cls, log: str, out: Path, overrides: list[str]) -> Schedule:
        """The uninterrupted run's, from what it did: a forgetting budget saves the best step within it at its
        evaluation, checkpoint.every or not, and keeps it through rotation; patience may end the run early. The saves
        its log says, the evaluations its metrics.jsonl holds (the one before training included), its last trained
        step, and the prunes its rotation made with the best step its budget rows kept at each save."""
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        saves = sorted({int(s) for s in re.findall(r"checkpoint saved: \S*step-(\d+)", log)})
        best = {r["step"]: r["best_step"] for r in rows if r["kind"] == "budget"}

        def kept(step: int) -> int | None:
            judged = [s for s in best if s <= step]
            return best[max(judged)] if judged else None

        return cls(max(r["step"] for r in rows if r["kind"] == "train"), saves,
                   sorted({r["step"] for r in rows if r["kind"] == "eval"}),
                   pruning(saves, setting(overrides, "checkpoint.keep_last"), kept))


def possible_kills(overrides: list[str], strategy: str, schedule: Schedule | None = None) -> list[str]:
    """Every kill point a run of `overrides` under `strategy` reaches, as LLM_TOOLKIT_KILL items (`schedule`: what the
    run does when, where not its config alone)."""
    ran = schedule or Schedule.configured(overrides)
    saves = ran.saves
    kills = [f"{p}@{s}/{r}" for p in TRAINING_POINTS for s in range(1, ran.last + 1) for r in (0, 1)]
    kills += [f"eval@{s}/{r}" for s in ran.evals for r in (0, 1)]
    kills += [f"{p}@{s}/{r}" for p in ("save.start", "save.rank_files") for s in saves for r in (0, 1)]
    if ASYNC in overrides:  # DDP's files are the main process's alone; under FSDP2 each rank writes its shards
        kills += [f"save.background@{s}/{r}" for s in saves for r in ((0, 1) if strategy == "fsdp" else (0,))]
    kills += [f"{p}@{s}/0" for p in ("save.manifest", "save.state_file") for s in saves]
    kills += [f"prune@{s}/0" for s in ran.prunes]
    return [*kills, "final/0"]


def expected_resume(kill: str, overrides: list[str], saves: list[int] | None = None) -> int:
    """The checkpoint step a relaunch after `kill` must resume from (0: a fresh start): the
    newest whose save finished (state file written) before the kill. In the background (ASYNC), the
    newest one that may have: see resume_range. `saves`: the steps the run saves at (Schedule.saves), where not
    checkpoint.every's alone."""
    point, _, rest = kill.partition("@")
    saves = saves or saved_steps(overrides)
    if point.startswith("final"):
        return saves[-1]
    step = int(rest.split("/")[0])
    done = step if point in ("save.state_file", "prune") else step - 1  # eval at N runs before N's save
    return max((s for s in saves if s <= done), default=0)


def resume_range(kill: str, overrides: list[str], saves: list[int] | None = None) -> tuple[int, int]:
    """The steps a relaunch after `kill` may resume from, oldest and newest. Blocking, one step. In the background a
    save completes at the first step after its writes end, and at the latest when the next save begins (its own
    points, save.*, and prune, are reached in order): a kill while training may come before or after."""
    saves = saves or saved_steps(overrides)
    newest = expected_resume(kill, overrides, saves)
    point = kill.partition("@")[0]
    if ASYNC not in overrides or point.startswith(("save.", "prune", "final")):
        return newest, newest
    return max((s for s in saves if s < newest), default=0), newest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    strategy: str, out: Path, overrides: list[str], cache: Path, kills: list[str] = (), kill_log: Path | None = None,
    restarts: int = 0, recipe: tuple[str, str] = PRETRAIN,
) -> subprocess.CompletedProcess:
    """One 2-process `accelerate launch` of `recipe` (script, config; the pretraining one's by default); `kills`
    planned (each fires once, logged in `kill_log`); `restarts` > 0 lets torchrun bring the ranks back after one
    dies."""
    script, config = recipe
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
        "--num_processes", "2", "--main_process_port", str(free_port()),
        *(["--max_restarts", str(restarts), "--monitor_interval", "1"] if restarts else []),
        script, "--config", config, *overrides, f"output_dir={out}",
    ]
    return _run(cmd, cache, kills, kill_log)


def _run(cmd: list[str], cache: Path, kills: list[str] = (), kill_log: Path | None = None) -> subprocess.CompletedProcess:
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


def tiny_base(work: Path, cache: Path) -> Path:
    """A fine-tune's base: the final/ of 4 steps of the pretraining recipe's tiny LLaMA on one process (what
    tests/conftest.py's tiny_base makes)."""
    out = work / "tiny-base"
    done = _run([sys.executable, PRETRAIN[0], "--config", PRETRAIN[1], *TINY, "train.max_steps=4", "checkpoint.every=0",
                 f"output_dir={out}"], cache)
    if done.returncode != 0:
        sys.exit(f"the tiny base's pretraining failed:\n{done.stderr[-4000:]}")
    return out / "final"


def code_corpus(folder: Path) -> Path:
    """code.txt: Python source of a few standard-library modules, paragraphs of code, not prose (the fine-tune's
    domain; tests/recipes/test_mixture_training.py writes the same)."""
    import argparse
    import configparser
    import json.decoder
    import textwrap

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "code.txt").write_text("\n\n".join(inspect.getsource(m) for m in (argparse, configparser, json.decoder,
                                                                               textwrap)))
    return folder / "code.txt"


def budgeted(base: Path, code: Path) -> list[str]:
    """The budgeted fine-tune's overrides (BUDGETED, BUDGETED_SAVES) on `base`, its domain `code`."""
    return [*BUDGETED, f"model.path={base}", f"data.sources=[{{name: code, path: {code}, weight: 0.8}}, "
            "{name: docs, weight: 0.2}]", *BUDGETED_SAVES]


def resumed_steps(log: str) -> list[int]:
    """The checkpoint steps a launch's log says it resumed from, in order."""
    return [int(s) for s in re.findall(r"resumed from \S*step-(\d+) at step", log)]


def metrics(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def source_tokens(out: Path) -> dict[int, dict[str, int]]:
    """Each train row's tokens trained on so far per data source (tokens/<name>: a mixture's)."""
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("tokens/")} for r in metrics(out, "train")}


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
    if run.adapter.exists():
        problems += [f"adapter/ lacks {name}" for name in ("adapter_config.json", "adapter_model.safetensors")
                     if not (run.adapter / name).is_file()]
    return problems


def same_weights(a: Path, b: Path, name: str = "model.safetensors") -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def compare(out: Path, reference: Path) -> list[str]:
    """The finished run against the uninterrupted one, bit for bit: every loss, the tokens of each data source (a
    mixture's), the forgetting budget's rows (a budgeted fine-tune's), the final weights and the adapter (a LoRA's)."""
    got, want = losses(out), losses(reference)
    problems = [f"step {s}: loss {got.get(s)!r}, uninterrupted {want[s]!r}" for s in want if got.get(s) != want[s]]
    if sorted(got) != sorted(want):
        problems.append(f"logged steps {sorted(got)}, uninterrupted {sorted(want)}")
    got_tokens, want_tokens = source_tokens(out), source_tokens(reference)
    problems += [f"step {s}: tokens per source {got_tokens.get(s)}, uninterrupted {want_tokens[s]}"
                 for s in want_tokens if got_tokens.get(s) != want_tokens[s]]
    got_budget, want_budget = metrics(out, "budget"), metrics(reference, "budget")
    if got_budget != want_budget:
        differ = next((g["step"] for g, w in zip(got_budget, want_budget, strict=False) if g != w), None)
        problems.append(f"budget rows at steps {[r['step'] for r in got_budget]}, uninterrupted "
                        f"{[r['step'] for r in want_budget]}" + (f"; step {differ}'s differs" if differ is not None else ""))
    if not RunDir(out).final.is_dir():
        problems.append("no final/ after the resumed run")
    elif not same_weights(RunDir(out).final, RunDir(reference).final):
        problems.append("final/ weights differ from the uninterrupted run's")
    if RunDir(reference).adapter.is_dir():
        if not RunDir(out).adapter.is_dir():
            problems.append("no adapter/ after the resumed run")
        elif not same_weights(RunDir(out).adapter, RunDir(reference).adapter, "adapter_model.safetensors"):
            problems.append("adapter/ weights differ from the uninterrupted run's")
    return problems


def kill_and_resume(strategy: str, kill: str, work: Path, reference: Path, overrides: list[str], cache: Path,
                    recipe: tuple[str, str] = PRETRAIN, saves: list[int] | None = None) -> dict:
    """One soak cycle; the row of the table. `saves`: the steps the uninterrupted run saved at (Schedule.saves)."""
    saves = saves or saved_steps(overrides)
    out, log = work / "run", work / "kills.log"
    killed = launch(strategy, out, overrides, cache, [kill], log, recipe=recipe)
    fired = log.is_file() and kill in log.read_text().split()
    row = {"strategy": strategy, "kill": kill, "fired": fired, "resumed": False, "bit_exact": False, "lost": False,
           "problems": []}
    if not fired:
        row["problems"].append(f"the kill never fired (exit {killed.returncode}): {killed.stderr[-300:]}")
        return row
    oldest, newest = resume_range(kill, overrides, saves)
    complete = [int(c.name.split("-")[1]) for c in RunDir(out).complete_checkpoints()]
    want = max(complete, default=0) if oldest < newest else newest
    lost = audit(out, want)
    if not oldest <= want <= newest:
        lost.append(f"the newest complete checkpoint after the kill is step {want}, expected {oldest} to {newest}")
    again = launch(strategy, out, [*overrides, "resume=auto"], cache, recipe=recipe)
    row["resumed"] = again.returncode == 0
    if again.returncode == 0:
        lost += audit(out, saves[-1])
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
    parser.add_argument("--finetune-budget", dest="budget", action="store_true",
                        help="a LoRA fine-tune held to a forgetting budget (replay, selection, forced saves) instead "
                             "of pretraining")
    args = parser.parse_args()
    draw = random.Random(args.seed)
    rows = []
    print(f"{'strategy':<8} {'kill point':<28} {'resumed':<8} {'bit-exact':<10} problems", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        overrides, recipe = [*TINY, *SAVES], PRETRAIN
        if args.budget:
            overrides, recipe = budgeted(tiny_base(work, cache), code_corpus(work)), FINETUNE
        overrides += [ASYNC] if args.background else []
        for strategy in args.strategies:
            reference = work / f"{strategy}-reference"
            done = launch(strategy, reference, overrides, cache, recipe=recipe)
            if done.returncode != 0:
                sys.exit(f"the uninterrupted {strategy} run failed:\n{done.stderr[-4000:]}")
            schedule = (Schedule.observed(done.stdout + done.stderr, reference, overrides) if args.budget
                        else Schedule.configured(overrides))
            if args.budget:
                print(f"{strategy:<8} (the uninterrupted run saves at steps {schedule.saves}, prunes at "
                      f"{schedule.prunes}, evaluates at {schedule.evals})", flush=True)
            for i, kill in enumerate(draw.sample(possible_kills(overrides, strategy, schedule), args.kills)):
                row = kill_and_resume(strategy, kill, work / f"{strategy}-{i}", reference, overrides, cache, recipe,
                                      schedule.saves)
                rows.append(row)
                print(f"{strategy:<8} {kill:<28} {'yes' if row['resumed'] else 'NO':<8} "
                      f"{'yes' if row['bit_exact'] else 'NO':<10} {'; '.join(row['problems']) or '-'}", flush=True)
    exact = sum(r["bit_exact"] for r in rows)
    lost = sum(r["lost"] for r in rows)
    print(f"{len(rows)} kill points, {exact} resumed bit-exact, {lost} lost")
    sys.exit(0 if exact == len(rows) and not lost else 1)


if __name__ == "__main__":
    main()
