"""Tensor parallel as a user launches it (accelerate_configs/fsdp_tp.yaml): every layer split over 2
ranks by transformers' plan (the tied embedding and head still one weight), the same curves as one
process (fp32, rel 1e-4), a checkpoint resumed bit for bit, final/ one HF folder with the reference's
logits; dp_shard 2 x tp 2 on 4 processes; and what cannot work refused in one line."""

from __future__ import annotations

import pytest
from model_parallel import (
    RUN,
    assert_2d_run_equals_one_process,
    assert_refused_in_one_line,
    assert_run_equals_one_process_and_resumes_bit_exact,
    assert_same_curves,
    curves,
)
from recipe_runner import TINY, run_recipe

pytestmark = pytest.mark.distributed


def test_tensor_parallel_on_2_processes_equals_one_process_and_resumes_bit_exact(one_process_run, tmp_path, data_cache):
    out, after = assert_run_equals_one_process_and_resumes_bit_exact(
        "fsdp_tp.yaml", "tensor_parallel=2: Megatron sequence parallel", one_process_run, tmp_path, data_cache
    )

    # its checkpoint is FSDP2's (torch.distributed.checkpoint): plain FSDP2 resumes it as it is
    elsewhere = tmp_path / "fsdp"
    run_recipe("pretrain", [*RUN, f"output_dir={elsewhere}", f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2,
               cache=data_cache, accelerate_config="fsdp.yaml")
    assert_same_curves(curves(elsewhere), after)


def test_dp_shard_2_by_tp_2_on_4_processes_equals_one_process(one_process_run, tmp_path, data_cache):
    assert_2d_run_equals_one_process("fsdp_tp.yaml", "tensor_parallel=2: Megatron sequence parallel", one_process_run, tmp_path / "2d", data_cache)


# One run (2 ranks forked with accelerate launch's variables) per place the recipe refuses a split (the model's
# sizes, the launch's sizes, the loss, the sequence); every message of each place is checked in tests/toolkit/strategy (tests/README.md lists them).
@pytest.mark.parametrize(("extra", "launch_args", "says"), [
    (["model.config.num_key_value_heads=1"], [], "model.config.num_key_value_heads=1 is not divisible by tp=2"),
    ([], ["--parallelism_config_cp_size", "2"], "parallelism_config_cp_size=2 with parallelism_config_tp_size=2 is not supported yet"),
    (["model.loss=chunked"], [], "model.loss=chunked is not supported with tensor parallel"),
    (["data.seq_len=63"], [], "data.seq_len=63 is not divisible by parallelism_config_tp_size=2: tensor parallel splits"),
])
def test_what_cannot_be_split_is_refused_in_one_line(tmp_path, data_cache, extra, launch_args, says):
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", f"output_dir={tmp_path / 'run'}", *extra], nproc=2,
                      cache=data_cache, accelerate_config="fsdp_tp.yaml", check=False, launch_args=launch_args)
    assert_refused_in_one_line(proc, says)

