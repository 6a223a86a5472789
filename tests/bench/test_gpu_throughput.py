"""bench/gpu_throughput.py's plain loop on CPU, profiled: the table of where its steps went comes back with its
throughput, and the steps traced are not the ones timed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_throughput as bench  # noqa: E402


def test_the_plain_loop_profiles_two_steps_after_the_timed_ones(tmp_path):
    # tests/conftest.py's tiny llama (an import of conftest is ambiguous beside the other conftest.py files)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)
    spec = {"model_type": "llama", "sizes": sizes, "vocab": 300, "seed": 0, "variant": "a",
            "micro_batch": 2, "checkpointing": "none", "seq_len": 64, "accumulation": 1, "steps": 2, "warmup": 1,
            "profile": 2, "workdir": str(tmp_path)}
    result = bench.peer_worker(spec)
    assert result["tokens_per_s"] > 0 and result["profile"]["steps"] == [4, 5]  # after warmup 1 + 2 timed
    assert (tmp_path / "profile" / "summary.md").is_file()
    row = bench.Row("peer", "-", "none", 2, "a")
    lines = bench.profiles([row, row], [result, {"tokens_per_s": 1.0}])
    assert sum(line.startswith("### Profile: plain loop") for line in lines) == 1
    assert any(line.startswith("steps 4-5: ") and "CPU operators" in line for line in lines)


def test_a_recipe_row_gets_the_planners_peak_beside_the_measured_one():
    args = SimpleNamespace(model=str(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml"), seq_len=128, warmup=1, steps=2,
                           profile=0, global_batch=8, extra=[])
    row = bench.Row("recipe", "ddp", "selective", 8, "shipped")
    planned = bench.planned_gib(row, args, 4096)
    assert 0 < planned < 1  # the 1.3M-parameter model's 8 x 128 tokens
    measured = {"tokens_per_s": 1.0, "mfu": None, "cuda_max_allocated_mb": planned * 1024 / 1.25, "planned_gib": planned}
    assert bench.cell(measured, "planned", None, 1) == f"{planned:.1f} (+25%)"


def test_the_timed_rate_counts_the_steps_after_warmup_from_rows_logged_every_warmup_steps():
    """A recipe row logs every --warmup steps (gpu_throughput.log_every), so that a step that never waits for the
    device is measured as such: the rate is the timed steps' tokens over their time, whatever the rows' windows."""
    log_every, timed_rate = bench.log_every, bench.timed_rate
    assert log_every(3) == "logging.every=3" and log_every(0) == "logging.every=1"
    # 100 tokens a step; steps 1-3 (compiling) at 10 tokens/s, then 1000 tokens/s; rows at 3, 6, 9, 12, 13
    rows = [{"step": s, "tokens": 100 * s, "tokens_per_s": 10.0 if s == 3 else 1000.0} for s in (3, 6, 9, 12, 13)]
    rate, first = timed_rate(rows, 3, 10)
    assert rate == pytest.approx(1000.0) and first["step"] == 6
    assert timed_rate(rows, 3, 6)[1]["step"] == 6  # only the rows up to step 9


def test_the_smoke_rows_run_the_code_paths_of_the_gpu_rows():
    """bash bench/gpu_check.sh --smoke runs the full form's code paths on tiny shapes (issue 41, point 6): check's recipe
    rows, the first with the 1B YAML's switches (compiled layers, the chunked loss), the second the whole model compiled
    with its loss, on pretrain_tiny; flex_attention is sdpa on CPU. (Before: both rows as pretrain_tiny ships, eager.)"""
    import yaml

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    smoke = script.split("if (( SMOKE )); then", 1)[1].split("else", 1)[0]
    assert "--configs smoke" in smoke and "--switches" not in smoke
    check = [r for r in bench.preset("check") if r.kind == "recipe"]
    rows = [r for r in bench.preset("smoke") if r.kind == "recipe"]
    assert [(r.strategy, r.checkpointing, r.micro_batch) for r in rows] == [
        (r.strategy, r.checkpointing, r.micro_batch) for r in check]
    shipped = yaml.safe_load((ROOT / "recipes" / "configs" / "pretrain_llama_1b.yaml").read_text())["model"]
    first = dict(o.split("=", 1) for o in bench.switch_overrides(rows[0].switches, gpu=True))
    assert {k: v for k, v in first.items() if k.startswith("model.")} == {
        f"model.{k}": str(shipped[k]) for k in ("compile", "attn_implementation", "loss")}
    assert rows[1].switches == check[1].switches == "whole"
    on_cpu = [o for r in rows for o in bench.switch_overrides(r.switches, gpu=False)]
    assert "model.compile=model" in on_cpu and "model.compile=layers" in on_cpu and "model.loss=chunked" in on_cpu
    assert "model.attn_implementation=sdpa" in on_cpu and not any("flex" in o for o in on_cpu)


def test_the_fp8_rows_and_their_smoke_form_and_the_loss_curves_side_by_side():
    """Issue 46's GPU rows: the 1B YAML as shipped in bf16, then in fp8 (the MLP alone and rowwise their own part); the
    smoke form runs
    them with the 1B YAML's switches on CPU. The curves table puts the rows' logged losses side by side and says each
    row's largest distance from the first."""
    fp8 = bench.preset("fp8")
    assert [r.extra for r in fp8] == ["", "train.mixed_precision=fp8"] and fp8[0].switches == "shipped"
    variants = ["", "train.mixed_precision=fp8", "train.mixed_precision=fp8 train.fp8_layers=mlp",
                "train.mixed_precision=fp8 train.fp8_recipe=rowwise"]
    assert [r.extra for r in bench.preset("fp8-variants")] == variants
    smoke = bench.preset("fp8-smoke")
    assert [r.extra for r in smoke] == variants
    assert {r.switches for r in smoke} == {"fast"}
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "export LLM_TOOLKIT_FP8_EMULATE=1" in script.split("if (( SMOKE )); then", 2)[2].split("else", 1)[0]
    rows = fp8[:2]
    results = [{"tokens_per_s": 1.0, "losses": [[3, 10.0], [6, 8.0]]},
               {"tokens_per_s": 1.2, "losses": [[3, 10.1], [6, 7.6]], "fp8": "fp8: 80 of 113 linear layers"}]
    lines = bench.curves(rows, results)
    assert "| 6 | 8.0000 | 7.6000 |" in lines
    assert lines[-1] == ("- train.mixed_precision=fp8: largest relative distance from the first row 5.00% (step 6), "
                         "last step 5.00%; fp8: 80 of 113 linear layers")
    assert bench.curves(rows[:1], results[:1]) == []
