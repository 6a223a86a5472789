"""toolkit.training.profiling's table from a profiler's events: busy time, idle gaps and what ran under them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from toolkit.training.profiling import OTHER, StepProfiler, check_steps, kind_of, summarise, table

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(name, start, end, device=CPU, parent=None, self_us=None):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           cpu_parent=parent, self_cpu_time_total=end - start if self_us is None else self_us)


def test_gaps_between_kernels_name_the_host_work_under_them():
    """Kernels at 0-40 and 100-160 us of 200: busy 100 us, the longest gap 60 us (40-100), when the host was
    in aten::item's synchronise; the next, 40 us at the end, under no operator."""
    step = event("optimizer_step", 0, 150)
    events = [
        step,
        event("aten::item", 35, 110, parent=step), event("cudaStreamSynchronize", 36, 109, parent=step),
        event("gemm", 0, 40, CUDA), event("gemm", 100, 130, CUDA), event("adam", 130, 160, CUDA),
    ]
    summary = summarise(events, wall_us=200, first=6, last=8)
    assert summary["device"] == "cuda" and summary["busy_ms"] == 0.1 and summary["busy_share"] == 0.5
    assert [(g["ms"], g["at_ms"], g["host"]) for g in summary["gaps"]] == [
        (0.06, 0.04, "optimizer_step > cudaStreamSynchronize"), (0.04, 0.16, "(no operator: Python between calls)")]
    assert [(k["name"], k["ms"], k["calls"], k["share"]) for k in summary["top"]] == [
        ("gemm", 0.07, 2, 0.7), ("adam", 0.03, 1, 0.3)]
    lines = table(summary)
    assert lines[0] == "steps 6-8: 0.2 ms wall, device busy 0.1 ms (50.0%; GPU kernels)"
    assert "| 0.06 | 0.0 | optimizer_step > cudaStreamSynchronize |" in lines
    assert lines[-2:] == ["| matmul | 0.07 | 70.0% |", "| optimizer | 0.03 | 30.0% |"]


def test_every_kernel_has_a_kind_and_the_kinds_sum_to_the_kernels():
    """H200 kernel names of the 1B step (bench/gpu_throughput.py --profile) and CPU operators, each in its kind."""
    names = {
        "triton_tem_fused_flex_attention_backward_transpose_view_5": "attention",
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul", "aten::mm": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication", "Memcpy HtoD (Pageable -> Device)": "memory copies",
        "triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_8": OTHER,
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::silu": OTHER,
    }
    assert {name: kind_of(name) for name in names} == names
    events = [event(name, 10 * i, 10 * i + 5 + i, CUDA) for i, name in enumerate(names)]
    kinds = summarise(events, wall_us=200, first=1, last=1)["kinds"]
    assert sum(k["ms"] for k in kinds) == pytest.approx(sum(5 + i for i in range(len(names))) / 1e3, rel=1e-12)
    assert sum(k["share"] for k in kinds) == pytest.approx(1, rel=1e-12)


def test_on_a_cpu_run_nested_operators_count_once_and_by_self_time():
    outer = event("aten::linear", 0, 50, self_us=10)
    events = [outer, event("aten::addmm", 5, 45, parent=outer), event("aten::add", 70, 80)]
    summary = summarise(events, wall_us=100, first=1, last=1)
    assert summary["device"] == "cpu" and summary["busy_ms"] == 0.06
    assert [(k["name"], k["ms"]) for k in summary["top"]] == [("aten::addmm", 0.04), ("aten::linear", 0.01),
                                                            ("aten::add", 0.01)]


def test_a_profile_is_two_steps_in_order():
    assert check_steps([]) == [] and check_steps([3, 3]) == [] and check_steps([2, 5], max_steps=5) == []
    assert check_steps([True, 2]) and check_steps([0, 2]) and check_steps([1, 2, 3]) and check_steps([2, 6], max_steps=5)


def test_steps_first_to_last_are_traced_and_a_resume_past_first_says_so(tmp_path):
    said = []
    profiler = StepProfiler([2, 3], tmp_path, True, torch.device("cpu"), said.append)
    # the operands made outside the steps: inside, the matmul is the only work (under load, making two 64 x 64
    # operands inside them once took longer than multiplying them, and aten::ones came first: CI failed on it)
    a = torch.ones(256, 256)
    for step in (1, 2, 3, 4):
        profiler.begin(step)
        a @ a
        profiler.end(step)
    assert profiler.summary["steps"] == [2, 3] and profiler.summary["top"][0]["name"] == "aten::mm"
    assert said == [f"profile: {tmp_path / 'profile'} (steps 2-3: {profiler.summary['wall_ms']:.0f} ms, the device "
                    f"busy {profiler.summary['busy_share']:.0%} of it; the table in summary.md)"]

    resumed = StepProfiler([2, 3], tmp_path / "resumed", True, torch.device("cpu"), said.append)
    for step in (3, 4):
        resumed.begin(step)
        resumed.end(step)
    assert said[1:] == ["logging.profile=[2, 3]: this run starts at step 3, past step 2: nothing is traced"]
    assert resumed.summary is None and not (tmp_path / "resumed").exists()
