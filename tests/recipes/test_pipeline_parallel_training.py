"""Pipeline parallel as a user launches it (accelerate_configs/ddp.yaml with train.pipeline_stages=2):
the tiny LLaMA's layers cut into 2 stages, its tied embedding and head kept one weight, the
accumulation's micro-batches through torch's 1F1B schedule; the same curves as one process (fp32,
rel 1e-4), a checkpoint resumed bit for bit and under DDP (and one process's under a pipeline),
final/ one HF folder with the reference's logits; and what cannot work refused in one line."""

from __future__ import annotations

import pytest
from model_parallel import (
    RUN,
    assert_refused_in_one_line,
    assert_run_equals_one_process_and_resumes_bit_exact,
    assert_same_curves,
    curves,
)
from recipe_runner import TINY, run_recipe

pytestmark = pytest.mark.distributed

STAGES = ("train.pipeline_stages=2",)


def test_a_pipeline_of_2_stages_equals_one_process_and_resumes_bit_exact(one_process_run, tmp_path, data_cache):
    out, after = assert_run_equals_one_process_and_resumes_bit_exact(
        "ddp.yaml", "pipeline_stages=2 (data_parallel=1)", one_process_run, tmp_path, data_cache, STAGES
    )
    # each stage's weights and optimizer state, by their names in the whole model
    step = out / "checkpoints" / "step-3"
    assert sorted(p.name for p in step.glob("pipeline_stage_*")) == [
        "pipeline_stage_0.safetensors", "pipeline_stage_0_optimizer.pt",
        "pipeline_stage_1.safetensors", "pipeline_stage_1_optimizer.pt",
    ]

    # the same contract as every strategy: a pipeline's checkpoint resumes under DDP, and one
    # process's checkpoint under a pipeline (converted to the state by parameter name)
    elsewhere = tmp_path / "ddp"
    proc = run_recipe("pretrain", [*RUN, f"output_dir={elsewhere}", f"resume={step}"], nproc=2, cache=data_cache)
    assert "this run is DDP on 2 processes: converted it" in proc.stdout + proc.stderr
    assert_same_curves(curves(elsewhere), after)
    into = tmp_path / "into-pipeline"
    run_recipe("pretrain", [*RUN, *STAGES, f"output_dir={into}", f"resume={one_process_run / 'checkpoints' / 'step-3'}"],
               nproc=2, cache=data_cache)
    assert_same_curves(curves(into), {k: v for k, v in curves(one_process_run).items() if k[0] > 3})


@pytest.mark.parametrize(("extra", "config", "says"), [
    (["model.model_type=gemma"], "ddp.yaml", "model_type=gemma cannot be cut into pipeline stages"),
    (["model.loss=chunked"], "ddp.yaml", "model.loss=chunked is not supported with train.pipeline_stages > 1"),
    ([], "fsdp.yaml", "train.pipeline_stages=2 runs under accelerate_configs/ddp.yaml"),
])
def test_what_cannot_be_cut_is_refused_in_one_line(tmp_path, data_cache, extra, config, says):
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", *STAGES, *extra, f"output_dir={tmp_path / 'run'}"],
                      nproc=2, cache=data_cache, accelerate_config=config, check=False)
    assert_refused_in_one_line(proc, says)
