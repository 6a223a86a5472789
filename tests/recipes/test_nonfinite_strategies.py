"""A NaN on one rank only, in real 2-process launches: every rank skips that step, the run logs it
once and trains on to the same losses as one process skipping the same step, replicas stay equal;
with train.on_nonfinite=abort the run stops with one error line and exit code 5. Under DDP, FSDP2
and DeepSpeed ZeRO-2/3, where Accelerate's backward would have stepped the engine itself."""

from __future__ import annotations

import json
import os
import re
import sys

import launching
import pytest
import torch
from recipe_runner import LAUNCH_TIMEOUT_S, ROOT, TINY, run_recipe
from safetensors.torch import load_file

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.run.faults import NONFINITE_ENV as ENV
from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

RUN = [*TINY, "train.max_steps=6"]  # TINY checkpoints and evaluates every 3 steps
SKIPPED = {"kind": "nonfinite", "step": 3, "action": "skip", "in_a_row": 1}
# strategy: (accelerate config, what rank 1 alone gets at step 3, what every rank reports)
CASES = {
    "ddp": ("ddp.yaml", "batch", "loss"),  # a NaN batch: loss and gradients
    "fsdp": ("fsdp.yaml", "grad", "grad"),
    "zero2": ("zero2.yaml", "loss", "loss"),  # finite gradients: DeepSpeed would step, the toolkit drops the update
    "zero3": ("zero3.yaml", "grad", "grad"),  # DeepSpeed's own overflow path drops it; reported and counted alike
}


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def deepspeed_counters(checkpoint) -> dict[str, int]:
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-1/2, ZeRO-3
    path = next(p for p in (checkpoint / "pytorch_model" / n for n in names) if p.is_file())
    state = torch.load(path, map_location="cpu", weights_only=False)
    return {k: state[k] for k in ("global_steps", "skipped_steps")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """One process skipping the same step."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_recipe("pretrain", [*RUN, f"output_dir={out}"], nproc=1, cache=data_cache, env={ENV: "batch@3"})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    done = {}

    def get(strategy: str):
        if strategy not in done:
            config, kind, _ = CASES[strategy]
            out = tmp_path_factory.mktemp(strategy) / "run"
            proc = run_recipe("pretrain", [*RUN, f"output_dir={out}"], nproc=2, cache=data_cache,
                              accelerate_config=config, env={ENV: f"{kind}@3/1"})
            done[strategy] = (out, proc.stdout + proc.stderr)
        return done[strategy]

    return get


@pytest.mark.parametrize("strategy", CASES)
def test_a_nan_on_one_rank_is_skipped_by_every_rank(strategy, runs, reference):
    out, log = runs(strategy)
    reported = CASES[strategy][2]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r for r in rows if "nonfinite" in r] == [{**SKIPPED, "nonfinite": reported}]
    what = "loss" if reported == "loss" else "gradients"
    assert log.count(f"step 3: non-finite {what} (NaN or inf); batch skipped") == 1  # rank 0's one line

    # both ranks skipped step 3 and trained on: the losses of one process skipping it
    ref, got = losses(reference), losses(out)
    assert sorted(got) == sorted(ref) == [1, 2, 4, 5, 6]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (strategy, step)
    assert got[6] < got[1] - 0.05
    digests = [r for r in rows if "parameter_digests" in r][-1]["parameter_digests"]
    if strategy in ("ddp", "zero2"):
        assert digests[0] == digests[1], "replicas ended with different weights"
    weights = load_file(out / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert TrainerState.read(out / "checkpoints" / "step-3").suspect == "saved right after 1 skipped non-finite step(s)"
    if strategy.startswith("zero"):
        # DeepSpeed counted the step (a resume relies on global_steps = the trainer's step) and its skip
        assert deepspeed_counters(out / "checkpoints" / "step-3") == {"global_steps": 3, "skipped_steps": 1}
        assert deepspeed_counters(out / "checkpoints" / "step-6") == {"global_steps": 6, "skipped_steps": 1}


def test_deepspeed_resumes_after_a_skip_bit_exactly(runs, tmp_path, data_cache):
    straight, _ = runs("zero2")
    out = tmp_path / "resumed"
    run_recipe("pretrain", [*RUN, f"output_dir={out}", f"resume={straight / 'checkpoints' / 'step-3'}"],
               nproc=2, cache=data_cache, accelerate_config="zero2.yaml")
    ref, got = losses(straight), losses(out)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == ref[step], step
    assert deepspeed_counters(out / "checkpoints" / "step-6") == {"global_steps": 6, "skipped_steps": 1}


def test_bf16_deepspeed_without_its_own_overflow_check_still_skips(tmp_path, data_cache):
    """bf16 ZeRO-2 with DeepSpeed's check_grad_overflow off (older DeepSpeed has none) applies a NaN
    gradient's update, and every later loss is NaN; the toolkit drops that update from the norm.
    The schedule is DeepSpeed's own here (a linear warmup): it does not move on the skipped step."""
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["bf16"] = {"enabled": "auto", "check_grad_overflow": False}
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 10, "warmup_type": "linear"}}
    (tmp_path / "zero2.json").write_text(json.dumps(ds))
    launch = (ROOT / "accelerate_configs" / "zero2.yaml").read_text()
    (tmp_path / "zero2.yaml").write_text(launch.replace("ds_configs/zero2.json", str(tmp_path / "zero2.json")))
    out = tmp_path / "run"
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=4", "train.mixed_precision=bf16", f"output_dir={out}"],
                      nproc=2, cache=data_cache, accelerate_config=str(tmp_path / "zero2.yaml"), env={ENV: "grad@3/1"})
    assert "the DeepSpeed config defines scheduler" in proc.stdout + proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r for r in rows if "nonfinite" in r] == [{**SKIPPED, "nonfinite": "grad"}]
    lr = {r["step"]: r["lr"] for r in rows if "loss" in r}
    assert sorted(lr) == [1, 2, 4]
    # 3e-4 per warmup step, counted from the first update: two updates before step 4, not three
    assert (lr[1], lr[2], lr[4]) == pytest.approx((0.0, 0.0, 3e-4))
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and all(0 < e < 10 for e in evals)
    assert deepspeed_counters(out / "checkpoints" / "step-3") == {"global_steps": 3, "skipped_steps": 1}


def test_on_nonfinite_abort_is_one_error_line_and_exit_code_5(tmp_path, data_cache):
    """Through recipes/launch.sh, which passes the recipe's exit code on (accelerate launch exits 1)."""
    out = tmp_path / "run"
    cmd = ["bash", "recipes/launch.sh", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
           "--main_process_port", str(launching.free_port()), "recipes/pretrain.py",
           "--config", "recipes/configs/pretrain_tiny.yaml", *RUN, "train.on_nonfinite=abort", f"output_dir={out}"]
    env = {**os.environ, "LLM_TOOLKIT_CACHE": str(data_cache), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHON": sys.executable, ENV: "batch@2/1"}
    proc = launching.run(cmd, LAUNCH_TIMEOUT_S, cwd=ROOT, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 5, output[-6000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-6000:]
    assert re.findall(r"error: .*", output) == [
        "error: non-finite loss (NaN or inf) at step 2 (train.on_nonfinite=abort); the run diverged and that step "
        "was not applied: lower optim.lr or check the data of step 2, then start over"
    ], output[-6000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r for r in rows if "nonfinite" in r] == [{"kind": "nonfinite", "step": 2, "nonfinite": "loss", "action": "abort", "in_a_row": 1}]
    assert sorted(losses(out)) == [1]


def test_a_skip_left_on_the_device_under_fsdp_trains_as_one_process_skipping_on_the_host(tmp_path, data_cache):
    """train.step_sync=none under FSDP2, whose parameters are DTensors: the fused AdamW skips step 2 on both ranks
    on the device, and the host reads it while step 3 runs (steps 3, 4 and 6 read their values: evaluation,
    checkpoint, log). The run is one process's that skipped it on the host; a constant rate, since a decaying
    one gives step 3 the rate of step 4."""
    same = [*RUN, "optim.fused=true", "optim.schedule=constant", "optim.warmup_steps=0", "logging.every=4"]
    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_recipe("pretrain", [*same, "train.step_sync=host", f"output_dir={one}"], nproc=1, cache=data_cache,
               env={ENV: "grad@2"})
    run_recipe("pretrain", [*same, "train.step_sync=none", f"output_dir={two}"], nproc=2, cache=data_cache,
               accelerate_config="fsdp.yaml", env={ENV: "grad@2/1"})
    rows = {run: read_metrics(run / "metrics.jsonl") for run in (one, two)}
    for run in (one, two):
        assert [r for r in rows[run] if "nonfinite" in r] == [{**SKIPPED, "step": 2, "nonfinite": "grad"}]
    ref, got = losses(one), losses(two)
    assert sorted(got) == sorted(ref) == [4, 6]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    tokens = [{r["step"]: r["tokens"] for r in rows[run] if "loss" in r} for run in (one, two)]
    assert tokens[0] == tokens[1]
