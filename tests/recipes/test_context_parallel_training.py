"""Context parallel as a user launches it (accelerate_configs/fsdp_cp.yaml): every sequence split over
2 ranks, packed documents kept apart, the same curves as one process (fp32, rel 1e-4), a checkpoint
resumed bit for bit, final/ one HF folder with the reference's logits; dp_shard 2 x cp 2 on 4
processes; and what cannot work refused in one line."""

from __future__ import annotations

import pytest
from model_parallel import (
    assert_2d_run_equals_one_process,
    assert_refused_in_one_line,
    assert_run_equals_one_process_and_resumes_bit_exact,
)
from recipe_runner import TINY, run_recipe

pytestmark = pytest.mark.distributed


def test_context_parallel_on_2_processes_equals_one_process_and_resumes_bit_exact(one_process_run, tmp_path, data_cache):
    assert_run_equals_one_process_and_resumes_bit_exact(
        "fsdp_cp.yaml", "context_parallel=2 (data_parallel=1)", one_process_run, tmp_path, data_cache
    )


def test_dp_shard_2_by_cp_2_on_4_processes_equals_one_process(one_process_run, tmp_path, data_cache):
    assert_2d_run_equals_one_process("fsdp_cp.yaml", "context_parallel=2 (data_parallel=2)", one_process_run, tmp_path / "2d", data_cache)


# the sequence and the model refused where the recipe checks them; the launch's sizes (cp x dp_shard, cp
# with tp) in tests/toolkit/strategy/test_distributed.py and test_tensor_parallel_training.py (tests/README.md)
@pytest.mark.parametrize(("extra", "launch_args", "says"), [
    (["data.seq_len=66"], [], "data.seq_len=66 is not divisible by 2 x parallelism_config_cp_size = 4"),
    (["model.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
      "model.config.moe_intermediate_size=64"], [], "context parallel with a mixture of experts"),
])
def test_what_cannot_be_split_is_refused_in_one_line(tmp_path, data_cache, extra, launch_args, says):
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", f"output_dir={tmp_path / 'run'}", *extra], nproc=2,
                      cache=data_cache, accelerate_config="fsdp_cp.yaml", check=False, launch_args=launch_args)
    assert_refused_in_one_line(proc, says)

