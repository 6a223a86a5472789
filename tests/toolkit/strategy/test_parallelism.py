"""The parallel layout a launch asks for (toolkit.strategy.parallelism), refused in one line where the launch
cannot hold it, before any process group exists."""

from __future__ import annotations

import os

import pytest

from toolkit.config.errors import UserError


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
    from toolkit.strategy.parallelism import launched_sizes

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for axis, size in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis}_SIZE", str(size))
    with pytest.raises(UserError) as raised:
        launched_sizes(world)
    assert says in str(raised.value)


def test_a_parallelism_config_that_fills_the_launch_gives_its_layout(monkeypatch):
    from toolkit.parallel_layout import ParallelLayout
    from toolkit.strategy.parallelism import launched_sizes, parallel_layout

    assert parallel_layout("MULTI_CPU", launched_sizes(2), 2) == ParallelLayout("ddp", 2)
    assert parallel_layout("NO", launched_sizes(1), 1) == ParallelLayout("single", 1)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    layout = parallel_layout("FSDP", launched_sizes(4), 4)
    assert layout == ParallelLayout("fsdp", 4, tp=2) and layout.dp_shard == 2
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ  # kept from Accelerate, which refuses CPU
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    layout = parallel_layout("DEEPSPEED", launched_sizes(4), 4)  # its ZeRO stage: the launched family's details
    assert layout == ParallelLayout("deepspeed", 4, sp=2) and layout.dp_shard == 2
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ  # kept from Accelerate, which refuses CPU


@pytest.mark.parametrize(("stages", "world", "model_parallel", "precision", "says"), [
    (3, 2, 1, "no", "train.pipeline_stages=3 does not divide the 2 processes launched; launch a multiple of 3"),
    (2, 4, 2, "no", "train.pipeline_stages=2 with an accelerate parallelism_config (cp, tp or sp) is not supported yet"),
    (2, 2, 1, "fp16", "train.pipeline_stages=2 with train.mixed_precision=fp16 is not supported"),
])
def test_a_pipeline_the_launch_cannot_hold_is_refused_before_any_process_group(stages, world, model_parallel,
                                                                               precision, says):
    from toolkit.strategy.parallelism import check_pipeline_launch

    with pytest.raises(UserError) as raised:
        check_pipeline_launch(stages, world, model_parallel, precision)
    assert says in str(raised.value)
    check_pipeline_launch(2, 4, 1, "bf16")  # 2 replicas x 2 stages
    check_pipeline_launch(1, 3, 2, "fp16")  # no pipeline: nothing to check


def test_the_mesh_has_an_axis_for_every_parallel_degree_and_none_without_model_parallel():
    from dataclasses import fields

    from toolkit.parallel_layout import ParallelLayout
    from toolkit.strategy.parallelism import MESH_AXES, device_mesh

    degrees = {f.name for f in fields(ParallelLayout) if f.type == "int"} - {"world", "zero_stage", "fsdp_version", "ep"}
    assert set(MESH_AXES) - {"dp"} == degrees  # ep is not an axis: a mixture's experts spread over the tp ranks
    for layout in (ParallelLayout("ddp", 8), ParallelLayout("fsdp", 8), ParallelLayout("deepspeed", 8, zero_stage=3)):
        assert device_mesh(layout, "cpu") is None  # the default process group: no collective, no group made
