"""The README's commands with the shipped YAMLs as shipped, on 2 processes under ZeRO-3 and FSDP2 (and DDP).

Only output_dir and train.max_steps are set (and the SmolLM2 fine-tune is shortened: SHORTER below); samples,
evaluation, checkpoints and tensorboard stay on, as a new user meets them. Before issue 8 the fine-tune hung for ever under ZeRO-3
(rank 0 generated the "before" samples alone while transformers synced generate across ranks)
and pretraining under ZeRO-3 failed after training (final/ was reloaded through zero.Init).

Every line they print is the toolkit's or a progress bar (issue 26: ~15 lines of other libraries'
notices hid them). OMP_NUM_THREADS is left unset, as on a new user's machine; DeepSpeed configs go
through recipes/launch.sh, since under plain `accelerate launch` its launcher prints two notices
before any toolkit code runs (docs/training.md, "What a run prints"). The bitsandbytes stand-in is seen by the launched
runs only: forked ranks imported their modules before it was on the path.
"""

from __future__ import annotations

import os
import re

import probe_ranks
import pytest
from recipe_runner import foreign_lines, run_recipe

from toolkit.run.folder import RunDir
from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

STRATEGIES = ["zero3", "fsdp"]

# bitsandbytes 0.50, imported on a machine without the `kernels` package, prints this; a run that loads
# no 4-bit base must not import it (peft does whenever it is installed). The stand-in prints it too, then
# fails its import (peft's LoRA then fails too: it found the package installed).
BITSANDBYTES_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'."
STAND_IN = f"""import sys
print({BITSANDBYTES_LINE!r}, file=sys.stderr)
raise ImportError("bitsandbytes imported by a run that loads no 4-bit base")
"""


@pytest.fixture
def as_a_new_user(tmp_path) -> dict[str, str | None]:
    """A launch environment without OMP_NUM_THREADS or DS_ACCELERATOR, with bitsandbytes installed (a stand-in)."""
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(STAND_IN)
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    # DS_ACCELERATOR: set in this process by the toolkit's import; a user's shell has none
    return {"OMP_NUM_THREADS": None, "DS_ACCELERATOR": None, "PYTHONPATH": path}


# Launched for real: the two layouts every change is tried under, and the SmolLM2 fine-tunes. The other layouts'
# ranks are forked (tests/support/probe_ranks.py) with the environment their launcher gives, and what that launcher prints
# is read from the launch that recorded it (DeepSpeed's layouts go through recipes/launch.sh, shown by zero3's).
LAUNCHED = {"zero3", "fsdp"}


def launched(recipe: str, overrides: list[str], strategy: str, cache, env, **kwargs):
    real = strategy in LAUNCHED or recipe == "finetune"
    proc = run_recipe(recipe, overrides, nproc=2, cache=cache, accelerate_config=f"{strategy}.yaml", env=env,
                      launcher=real, wrapper=real and strategy.startswith("zero"), **kwargs)
    printed = proc.stdout + proc.stderr
    if not real:
        printed = re.sub(r"^--- rank \d+\n", "", printed, flags=re.M)  # probe_ranks.run's headers
        if not strategy.startswith("zero"):
            printed += probe_ranks.launcher_output(f"{strategy}.yaml", 2)
    foreign = foreign_lines(printed)
    assert not foreign, "lines that are not the toolkit's:\n" + "\n".join(foreign)
    return proc


@pytest.mark.parametrize("strategy", ["ddp", *STRATEGIES, "zero3_sp", "fsdp_tp"])
def test_pretrain_tiny_as_shipped(strategy, tmp_path, data_cache, as_a_new_user):
    out = tmp_path / "run"
    proc = launched("pretrain", [f"output_dir={out}", "train.max_steps=6"], strategy, data_cache, as_a_new_user)
    assert "sample      : 'The for statement" in proc.stdout, proc.stdout[-2000:]
    assert "held-out loss" in proc.stdout + proc.stderr
    assert (out / "final" / "model.safetensors").is_file()
    assert [p.name for p in RunDir(out).complete_checkpoints()] == ["step-6"]
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [5, 6]
    # torch 2.13's deprecation of DeepSpeed's collectives came back ~80 times a step under ZeRO
    assert "reduce_scatter_tensor` is deprecated" not in proc.stdout + proc.stderr  # forked ranks: all in stdout
    assert "all_gather_into_tensor` is deprecated" not in proc.stdout + proc.stderr


# The SmolLM2 fine-tune, shorter: rows of 64 tokens, not 256 (a sixth of a step's cost); one evaluation batch a
# rank, not two (each ZeRO-3 forward gathers every layer: ~7 CPU-s); 8 sample tokens, not 40 (rank 0 generates
# them alone while rank 1 waits). Each part still runs as shipped: evaluations, samples, a checkpoint, the merge.
SHORTER = ["train.max_steps=1", "data.seq_len=64", "eval.blocks=8", "samples.max_new_tokens=8"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_finetune_smollm2_lora_as_shipped(strategy, tmp_path, data_cache, as_a_new_user):
    out = tmp_path / "run"
    proc = launched("finetune", [f"output_dir={out}", *SHORTER], strategy, data_cache, as_a_new_user,
                    config="finetune_smollm2_lora.yaml")
    assert "perplexity" in proc.stdout and "before" in proc.stdout and "after" in proc.stdout, proc.stdout[-2000:]
    samples = (out / "samples.md").read_text()
    assert samples.count("**before**") == 2 and samples.count("**after**") == 2
    assert "The with statement" in samples and "A generator function" in samples
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "final" / "model.safetensors").is_file()  # merge: true
    assert [p.name for p in RunDir(out).complete_checkpoints()] == ["step-1"]
