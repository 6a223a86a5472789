"""What a failed collective looks like to the user (the launched fault is in tests/recipes/test_collective_timeout.py)."""

from __future__ import annotations

import os

import pytest
import torch

from toolkit.strategy.distributed import collective_failure, set_collective_timeout


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def _raised_from(call) -> BaseException:
    try:
        call()
    except BaseException as caught:
        return caught
    raise AssertionError("did not raise")


def test_a_timed_out_collective_names_the_rank_the_wait_and_the_step(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # restored after the test
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    monkeypatch.setenv("RANK", "1")
    set_collective_timeout(20)
    exc = _raised(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"))
    line = collective_failure(exc, step=2)
    assert line.startswith("[rank 1] waited 20 s (train.collective_timeout_s)")
    assert "after step 2" in line and "the ranks fell out of step" in line
    assert line.endswith("(Timed out waiting 20000ms for recv operation to complete)")  # gloo's path prefix dropped
    assert c10d.default_pg_timeout.total_seconds() == 20  # also for groups created later


def test_a_lost_peer_is_not_called_a_timeout():
    exc = _raised(torch.distributed.DistNetworkError("Connection closed by peer [127.0.0.1]:2432"))
    line = collective_failure(exc, step=5)
    assert "another rank stopped or lost its connection" in line and "waited" not in line


def test_an_ordinary_error_is_left_alone():
    assert collective_failure(_raised(RuntimeError("mat1 and mat2 shapes cannot be multiplied")), step=1) is None
    # raised inside FSDP's code (the frame's file is FSDP's), but a bug, not a wait: it keeps its traceback
    import torch.distributed.fsdp as fsdp

    bug = compile("raise RuntimeError('Trying to resize storage that is not resizable')", fsdp.__file__, "exec")
    assert collective_failure(_raised_from(lambda: exec(bug)), step=1) is None
    assert collective_failure(_raised(ValueError("bad value")), step=1) is None


# ---------------------------------------------------------------- one process: what Strategy says


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """`Strategy.launch` as a recipe calls it, in this one CPU process (no launcher environment)."""
    from accelerate.state import AcceleratorState, GradientState

    from toolkit.strategy.distributed import Strategy

    with pytest.MonkeyPatch.context() as mp:
        for name in ("WORLD_SIZE", "RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP",
                     "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
            mp.delenv(name, raising=False)
        # launch sets the process-wide collective timeout (torch's defaults too): restored afterwards
        import torch.distributed.distributed_c10d as c10d

        import toolkit.strategy.distributed as distributed

        for module, name in [(c10d, "default_pg_timeout"), (c10d, "default_pg_nccl_timeout"),
                             (distributed, "_COLLECTIVE_TIMEOUT_S")]:
            mp.setattr(module, name, getattr(module, name))
        yield Strategy.launch(
            mixed_precision="no", global_batch=4, micro_batch=2, max_grad_norm=1.0,
            project_dir=str(tmp_path_factory.mktemp("run")), trackers=[], timeout_s=60,
        )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_one_process_is_the_single_strategy(single):
    assert single.kind == "single" and single.name == "single process"
    assert (single.world_size, single.rank, single.is_main) == (1, 0, True)
    assert single.accumulation == 2 and single.accelerator.gradient_accumulation_steps == 2
    assert single.is_replicated is True
    assert single.zero_stage is None and single.ds_owned == ()
    assert single.offloads_optimizer is False
    assert single.device == torch.device("cpu")


def test_the_first_log_line_says_what_is_in_force(single):
    line = single.describe()
    assert line.startswith("strategy=single process world_size=1 ")
    assert "precision=fp32" in line and "device=cpu" in line and line.endswith("grad_accum=2")


def test_adamw_is_torchs_own_on_cpu(single):
    assert single.adamw() is torch.optim.AdamW


def test_outside_training_sets_the_fsdp_loading_variables_aside_and_restores_them(single, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "1")
    with single.outside_training():
        assert "ACCELERATE_USE_FSDP" not in os.environ
        assert "FSDP_CPU_RAM_EFFICIENT_LOADING" not in os.environ
        model = torch.nn.Linear(2, 2)  # building works in here
    assert model(torch.ones(1, 2)).shape == (1, 2)
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "1"
    with pytest.raises(KeyError), single.outside_training():  # restored on the way out of an error too
        raise KeyError("boom")
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"


def test_check_whole_refuses_a_zero3_partition_and_passes_a_whole_model(tiny_model):
    from toolkit.strategy.distributed import check_whole

    model = tiny_model("llama")
    check_whole(model)  # a plain model: every weight is here
    model.lm_head.weight.ds_id = 7  # what ZeRO-3 puts on each partitioned parameter
    with pytest.raises(RuntimeError, match=r"lm_head\.weight is a ZeRO-3/FSDP shard"):
        check_whole(model)


def test_check_whole_refuses_an_fsdp2_dtensor():
    from toolkit.strategy.distributed import check_whole

    model = torch.nn.Linear(2, 2)
    model.bias.to_local = lambda: model.bias  # FSDP2 parameters are DTensors, which have to_local()
    with pytest.raises(RuntimeError, match="bias"):
        check_whole(model)


FAULTS_PROBE = """
import ctypes, resource, sys, torch
from toolkit.strategy.distributed import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:  # the control: glibc told to map every block afresh and give it back on free
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 1 << 20) and libc.mallopt(-1, 0)  # M_MMAP_THRESHOLD 1 MB, M_TRIM_THRESHOLD 0
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones(4 << 20) for _ in range(3)]  # 3 x 16 MB, like a micro-batch's logits and grads
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[5:]))
"""


def test_cpu_runs_keep_freed_memory_instead_of_faulting_it_back_in():
    """Three 16 MB tensors allocated and freed 20 times. When glibc gives freed memory back to the
    OS (what its defaults do, depending on the heap's history), each allocation faults its pages in
    again; after keep_freed_memory() the same memory is reused without a fault."""
    import subprocess
    import sys

    faults = {
        mode: int(subprocess.run([sys.executable, "-c", FAULTS_PROBE, mode], capture_output=True, text=True,
                                 check=True).stdout.split()[-1])
        for mode in ("control", "keep")
    }
    assert faults["control"] > 15 * 3 * 4000 // 512  # the probe sees faults (4k pages; 2 MB ones under THP)
    assert faults["keep"] < 100


@pytest.mark.parametrize("precision, param_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp2_reduces_gradients_in_fp32_under_mixed_precision(precision, param_dtype):
    """What Accelerate sets for FSDP2 under bf16 on a GPU (params and reduction in bf16), then ours."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from toolkit.strategy.distributed import reduce_gradients_in_fp32

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision(precision)
    assert plugin.mixed_precision_policy.reduce_dtype == param_dtype  # Accelerate's own choice
    reduce_gradients_in_fp32(plugin)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (param_dtype, torch.float32, param_dtype)
    plain = FullyShardedDataParallelPlugin(fsdp_version=2)  # fp32: no policy, nothing to change
    reduce_gradients_in_fp32(plain)
    assert plain.mixed_precision_policy is None


@pytest.mark.parametrize(("world", "sizes", "says"), [
    (1, {"DP_SHARD": 1, "CP": 2}, "must equal the 1 processes launched; launch a multiple of 2 processes (--num_processes 2)"),
    (2, {"DP_SHARD": 1, "TP": 4}, "must equal the 2 processes launched; launch a multiple of 4 processes (--num_processes 4)"),
    (4, {"DP_SHARD": 1, "TP": 2}, "must equal the 4 processes launched; set parallelism_config_dp_shard_size to 2"),
    (2, {"DP_SHARD": 1, "SP": 4}, "parallelism_config_sp_size=4 must equal the 2 processes launched; launch a multiple of 4"),
    (4, {"DP_SHARD": 2, "SP": 2, "CP": 2}, "parallelism_config_cp_size=2 with parallelism_config_sp_size=2 is not supported yet"),
    # the launches tests/recipes once refused these with (tests/README.md)
    (2, {"DP_SHARD": 1, "TP": 2, "SP": 2}, "parallelism_config_tp_size=2 with parallelism_config_sp_size=2 is not supported yet"),
    (2, {"DP_SHARD": 1, "CP": 2, "TP": 2}, "parallelism_config_cp_size=2 with parallelism_config_tp_size=2 is not supported yet"),
    (2, {"DP_SHARD": 1, "CP": 3}, "parallelism_config_dp_shard_size=1 x parallelism_config_cp_size=3 must equal the 2 processes"),
])
def test_a_parallelism_config_that_does_not_fill_the_launch_says_how_to_fix_it(monkeypatch, world, sizes, says):
    from toolkit.config import UserError
    from toolkit.strategy.distributed import parallelism_sizes

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for axis, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis}_SIZE", str(size))
    with pytest.raises(UserError) as raised:
        parallelism_sizes(world)
    assert says in str(raised.value)


def test_a_parallelism_config_that_fills_the_launch_gives_its_sizes(monkeypatch):
    from toolkit.strategy.distributed import parallelism_sizes

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert parallelism_sizes(4) == (1, 2, 1)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ  # kept from Accelerate, which refuses CPU
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert parallelism_sizes(4) == (1, 1, 2)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ  # kept from Accelerate, which refuses CPU


@pytest.mark.parametrize(("stages", "world", "model_parallel", "precision", "says"), [
    (3, 2, 1, "no", "train.pipeline_stages=3 does not divide the 2 processes launched; launch a multiple of 3"),
    (2, 4, 2, "no", "train.pipeline_stages=2 with an accelerate parallelism_config (cp, tp or sp) is not supported yet"),
    (2, 2, 1, "fp16", "train.pipeline_stages=2 with train.mixed_precision=fp16 is not supported"),
])
def test_a_pipeline_the_launch_cannot_hold_is_refused_before_any_process_group(stages, world, model_parallel,
                                                                               precision, says):
    from toolkit.config import UserError
    from toolkit.strategy.distributed import check_pipeline_launch

    with pytest.raises(UserError) as raised:
        check_pipeline_launch(stages, world, model_parallel, precision)
    assert says in str(raised.value)
    check_pipeline_launch(2, 4, 1, "bf16")  # 2 replicas x 2 stages
    check_pipeline_launch(1, 3, 2, "fp16")  # no pipeline: nothing to check


@pytest.mark.parametrize(("text", "says"), [
    ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage=4; DeepSpeed ZeRO stages are 0, 1, 2 or 3"),
    ('{\n  "train_batch_size": "auto",\n  oops\n}', "line 3, column 3"),
])
def test_a_deepspeed_json_that_cannot_work_is_one_line(monkeypatch, tmp_path, text, says):
    """What a launch under such an accelerate config reads first (tests/recipes/test_strategy_errors.py
    launches one, whose micro-batch contradicts the recipe's)."""
    from toolkit.config import UserError
    from toolkit.strategy.distributed import check_deepspeed_config

    (tmp_path / "ds.json").write_text(text)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    with pytest.raises(UserError) as raised:
        check_deepspeed_config()
    assert says in str(raised.value)
