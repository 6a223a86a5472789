"""What the context- and tensor-parallel recipe tests share: the run, its curves, the comparisons
with one process, and the refusal check."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from recipe_runner import TINY, run_recipe
from same_training import assert_same_weights, lr_sum
from transformers import AutoModelForCausalLM

from toolkit.training.metrics import read_metrics

RUN = [*TINY, "train.max_steps=6", "checkpoint.every=3", "eval.every=3"]


def curves(out) -> dict[tuple[int, str], float]:
    """(step, loss | eval | grad_norm) -> value, from a run's metrics.jsonl."""
    rows = read_metrics(out / "metrics.jsonl")
    found = {(r["step"], "loss"): r["loss"] for r in rows if "loss" in r}
    found |= {(r["step"], "eval"): r["eval_loss"] for r in rows if "eval_loss" in r}
    found |= {(r["step"], "grad_norm"): r["grad_norm"] for r in rows if r.get("grad_norm") is not None}
    return found


def assert_same_curves(got: dict, ref: dict, rel: float = 1e-4) -> None:
    """rel 1e-4: fp32 in another order over 6 AdamW steps (same_training.py derives it)."""
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=rel), key


def assert_same_logits(folder, reference_folder) -> None:
    """Both final/ folders load with from_pretrained as the same model: their weights within what
    same_training.py derives for the reference run's steps, and the reference folder's model given
    this folder's weights gives this folder's logits to the bit on a fixed batch.

    The logits themselves have no bound from rounding alone: a weight whose gradient's sign was within
    rounding may step the other way, 2 sum(lr) apart, and moves each logit by that times its slope
    there, so the comparison is split in two. The weights' bound catches a broken strategy (every
    weight ~lr apart) or a final/ from another step: measured 12x past it, while a context-parallel
    run's final/ is within 1e-5 of it. The second check runs the same operations in the same order in
    one process, so only a config that builds another model (rope, norm eps, ties, heads) moves it."""
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    got, ref = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                for path in (folder, reference_folder))
    run = Path(reference_folder).parent
    steps = sum(1 for r in read_metrics(run / "metrics.jsonl") if "lr" in r)
    assert_same_weights(got.state_dict(), ref.state_dict(), lr_sum(run), steps, longest_sum=ref.config.vocab_size,
                        what=(str(folder),))
    with torch.no_grad():
        logits = got(input_ids=ids).logits
        ref.load_state_dict(got.state_dict())
        assert torch.equal(ref(input_ids=ids).logits, logits), f"{folder} loads as another model than {reference_folder}"


def assert_refused_in_one_line(proc: subprocess.CompletedProcess, says: str) -> None:
    """A refusal (a run_recipe(...) of 2 ranks): exit code 2, one `error:` line, no traceback."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], output[-3000:]
    assert "Traceback" not in output


def assert_2d_run_equals_one_process(config: str, says: str, one_process_run, out, cache) -> None:
    """dp_shard 2 x (cp, tp or sp) 2 on 4 processes under accelerate config `config`, whose first line
    says `says`: the first 3 steps' curves equal one process's."""
    proc = run_recipe("pretrain", [*RUN, "train.max_steps=3", f"output_dir={out}"], nproc=4, cache=cache,
                      accelerate_config=config, launch_args=["--parallelism_config_dp_shard_size", "2"])
    assert says in proc.stdout + proc.stderr
    ref = {k: v for k, v in curves(one_process_run).items() if k[0] <= 3}
    assert_same_curves(curves(out), ref)


def assert_run_equals_one_process_and_resumes_bit_exact(
    config: str, says: str, one_process_run, tmp_path, cache, extra: tuple[str, ...] = ()
):
    """2 processes under accelerate config `config` (and overrides `extra`), whose first line says
    `says`: the curves and final/ logits of one process, and a resume from step-3 equal to the bit.
    Returns the run's folder and its curves after step 3."""
    out = tmp_path / "run"
    proc = run_recipe("pretrain", [*RUN, *extra, f"output_dir={out}"], nproc=2, cache=cache, accelerate_config=config)
    assert says in proc.stdout + proc.stderr
    # DeepSpeed's shared-memory all-reduce kernel, which training never calls: under fsdp_sp.yaml Ulysses
    # started DeepSpeed's comm, which built it (a minute on a new machine) and said so on every rank
    assert "shm_comm" not in proc.stdout + proc.stderr
    got = curves(out)
    assert_same_curves(got, curves(one_process_run))
    assert_same_logits(out / "final", one_process_run / "final")

    resumed = tmp_path / "resumed"
    run_recipe("pretrain", [*RUN, *extra, f"output_dir={resumed}", f"resume={out / 'checkpoints' / 'step-3'}"],
               nproc=2, cache=cache, accelerate_config=config)
    after = {k: v for k, v in got.items() if k[0] > 3}
    assert curves(resumed) == after
    return out, after
