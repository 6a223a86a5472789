"""The Strategy object of one process (toolkit.strategy.distributed): its facts, its first log line, and the
checks that a model is whole where one process generates from it."""

from __future__ import annotations

import os

import pytest
import torch

from toolkit.parallel_layout import ParallelLayout


def test_one_process_is_the_single_strategy(single):
    assert single.layout == ParallelLayout("single", 1) and single.layout.name == "single process"
    assert (single.rank, single.is_main) == (0, True)
    assert single.accumulation == 2 and single.accelerator.gradient_accumulation_steps == 2
    assert single.is_replicated is True
    assert single.ds_owned == ()
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
