"""Sequence parallel as a user launches it (accelerate_configs/zero3_sp.yaml, DeepSpeed Ulysses under
ZeRO-3): every sequence split over 2 ranks, packed documents kept apart, the same curves as one
process (fp32, rel 1e-4), a checkpoint resumed bit for bit and by plain ZeRO-3, final/ one HF folder
with the reference's logits; dp_shard 2 x sp 2 on 4 processes; and what cannot work refused in one
line."""

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


def test_sequence_parallel_on_2_processes_equals_one_process_and_resumes_bit_exact(one_process_run, tmp_path, data_cache):
    out, after = assert_run_equals_one_process_and_resumes_bit_exact(
        "zero3_sp.yaml", "sequence_parallel=2 (data_parallel=1)", one_process_run, tmp_path, data_cache
    )

    # the weights are not split: its checkpoint is ZeRO-3's, which plain ZeRO-3 resumes as it is
    elsewhere = tmp_path / "zero3"
    run_recipe("pretrain", [*RUN, f"output_dir={elsewhere}", f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2,
               cache=data_cache, accelerate_config="zero3.yaml")
    assert_same_curves(curves(elsewhere), after)


def test_under_fsdp2_the_split_gives_the_same_curves_and_resumes_bit_exact(one_process_run, tmp_path, data_cache):
    assert_run_equals_one_process_and_resumes_bit_exact(
        "fsdp_sp.yaml", "sequence_parallel=2 (data_parallel=1)", one_process_run, tmp_path, data_cache
    )


def test_dp_shard_2_by_sp_2_on_4_processes_equals_one_process(one_process_run, tmp_path, data_cache):
    assert_2d_run_equals_one_process("zero3_sp.yaml", "sequence_parallel=2 (data_parallel=2)", one_process_run, tmp_path / "2d", data_cache)


# the model refused where the recipe checks it; sp with tp or cp (the launch's sizes) in
# tests/toolkit/strategy/test_distributed.py and test_tensor_parallel_training.py (tests/README.md)
@pytest.mark.parametrize(("extra", "launch_args", "says"), [
    (["model.config.num_attention_heads=1", "model.config.num_key_value_heads=1"], [],
     "llama has 1 attention heads, not divisible by parallelism_config_sp_size=2"),
])
def test_what_cannot_be_split_is_refused_in_one_line(tmp_path, data_cache, extra, launch_args, says):
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", f"output_dir={tmp_path / 'run'}", *extra], nproc=2,
                      cache=data_cache, accelerate_config="zero3_sp.yaml", check=False, launch_args=launch_args)
    assert_refused_in_one_line(proc, says)
