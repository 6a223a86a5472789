"""The pretraining recipe, launched for real: DDP parity, outputs that load, resume.

The DDP run and its one-process reference are the strategy matrix's (conftest.strategy_runs, one_process_run).
"""

from __future__ import annotations

import json
import shutil

import pytest
from recipe_runner import MATRIX_RUN, TINY, run_recipe
from safetensors.torch import load_file
from same_training import assert_same_weights, lr_sum
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.run.folder import RunDir
from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def ddp_run(strategy_runs):
    """The strategy matrix's DDP run (conftest.strategy_runs: MATRIX_RUN, 2 processes), shared with test_strategies.py."""
    return strategy_runs("ddp")


def test_ddp_matches_one_process_on_the_same_global_batch(ddp_run, one_process_run):
    ddp, log = ddp_run
    assert "strategy=DDP world_size=2 backend=gloo" in log
    ref, got = losses(one_process_run), losses(ddp)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    # Training moved the model: the comparison above is not between two untouched inits.
    assert got[6] < got[1] - 0.05

    digests = [r for r in read_metrics(ddp / "metrics.jsonl") if "parameter_digests" in r][-1]["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "replicas ended with different weights"
    # Adam divides by sqrt(v): coordinates with near-zero gradients turn last-bit differences in
    # the all-reduce order into lr-sized steps, so weights agree within what same_training.py derives
    a = load_file(ddp / "final" / "model.safetensors")
    b = load_file(one_process_run / "final" / "model.safetensors")
    assert_same_weights(a, b, lr_sum(one_process_run), steps=6, longest_sum=512)  # TINY's vocabulary


def test_final_folder_loads_and_generates(ddp_run):
    out, _ = ddp_run
    final = out / "final"
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok("The for statement", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 8
    card = (final / "README.md").read_text()
    assert "final held-out loss" in card and "max_steps: 6" in card

    rows = read_metrics(out / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"):
        assert key in train_rows[0], key
    assert train_rows[0]["mfu"] is None  # CPU: no invented peak
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert all(r["eval_ppl"] > 1 for r in rows if "eval_ppl" in r)
    assert (out / "loss.png").stat().st_size > 1000
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-3", "step-6"]


def test_resume_from_checkpoint_continues_at_the_right_step(ddp_run, tmp_path, data_cache):
    straight, _ = ddp_run
    out = tmp_path / "resumed"
    proc = run_recipe("pretrain", [*MATRIX_RUN, f"output_dir={out}", f"resume={straight / 'checkpoints' / 'step-3'}"],
                      nproc=2, cache=data_cache)
    assert "at step 3" in proc.stdout + proc.stderr
    resumed, ref = losses(out), losses(straight)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # same data position, optimizer, scheduler and RNG: bit-equal on CPU
        assert resumed[step] == ref[step], step
    state = json.loads((out / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] > 0


def test_resume_auto_extends_a_finished_run(ddp_run, data_cache, tmp_path):
    out = shutil.copytree(ddp_run[0], tmp_path / "run")  # the shared run stays as it ended
    run_recipe("pretrain", [*MATRIX_RUN, "train.max_steps=8", f"output_dir={out}", "resume=auto"], nproc=2,
               cache=data_cache)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))  # 1-6 kept from the first run, 7-8 appended once
    # keep_last=2: step-3 was pruned once step-8 completed
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-6", "step-8"]


def test_a_stop_signal_to_accelerate_launch_saves_a_complete_checkpoint(tmp_path, data_cache):
    """Cluster preemption (SIGTERM to the launcher, as SLURM sends it): nothing trained is lost."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import launching
    from recipe_runner import ROOT

    out = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
           "--num_processes", "2", "--main_process_port", str(launching.free_port()), "recipes/pretrain.py",
           "--config", "recipes/configs/pretrain_tiny.yaml", *TINY, "train.max_steps=100000",
           "checkpoint.every=0", "eval.every=0", f"output_dir={out}"]
    env = {**os.environ, "LLM_TOOLKIT_CACHE": str(data_cache), "OMP_NUM_THREADS": "1"}
    proc = launching.start(cmd, cwd=ROOT, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(losses(out)) >= 3:
            break
        time.sleep(0.5)
    if proc.poll() is not None or len(losses(out)) < 3:
        pytest.fail(f"no 3 steps within 300 s: {launching.kill_all(proc)[1][-3000:]}")
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 120 s after SIGTERM: {launching.kill_all(proc)[1][-3000:]}")
    assert proc.returncode != 0
    assert "stopped by a signal at step" in stderr and "continue with resume=auto" in stderr, stderr[-3000:]
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1 and (out / "checkpoints" / saved[0] / "trainer_state.json").is_file()
    assert [p.name for p in RunDir(out).complete_checkpoints()] == saved
    assert int(saved[0].split("-")[1]) >= 3
    # the same checkpoint resumed: test_launch_wrapper.py's SIGTERM case (recipes/launch.sh, the same trainer)
