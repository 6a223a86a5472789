"""recipes/plan.py as a user runs it: a table and a launch line, or --json rows; one line for bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wrong_arguments
from recipe_runner import recipe_module
from transformers import AutoModelForCausalLM

from toolkit.config.load import load_config
from toolkit.models.scratch import hf_config
from toolkit.strategy.pipeline.stages import layer_ranges
from toolkit.training.recipe_config import PretrainConfig

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = sorted(p.stem for p in (ROOT / "accelerate_configs").glob("*.yaml") if not p.stem.startswith("multinode"))


def plan_command(*args: str) -> subprocess.CompletedProcess:
    """`python recipes/plan.py ARGS` as a user types it."""
    return subprocess.run(
        [sys.executable, "recipes/plan.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def plan(*args: str) -> subprocess.CompletedProcess:
    """What plan_command gives, from recipes/plan.py's main in this process: each Python start costs ~6 s
    of imports, the table itself a fraction of a second (the first test runs the command itself, once)."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the configs are named relative to the repository, as in the command
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = PLAN.main(list(args))
            except SystemExit as exc:  # argparse's own refusals
                code = exc.code
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["recipes/plan.py", *args], code, out.getvalue(), err.getvalue())


PLAN = recipe_module("plan")


def test_the_1b_config_on_eight_80gb_gpus_gets_rows_and_a_launch_line():
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "80GB", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert sorted({r["strategy"] for r in rows}) == sorted([*STRATEGIES, "pipeline"])
    assert {r["pipeline_stages"] for r in rows} == {1, 2, 4}
    assert {r["gradient_checkpointing"] for r in rows} == {"none", "every_k", "selective", "full"}
    # selective: on the data-parallel layouts only (modelled there) but ZeRO-3's (refused at launch), its activations
    # between full's and none's
    assert {r["strategy"] for r in rows if r["gradient_checkpointing"] == "selective"} == {
        r["strategy"] for r in rows if r["cp"] * r["tp"] * r["sp"] == 1 and not r["strategy"].startswith("zero3")}
    acts = {(r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]): r["activations_bytes"] for r in rows}
    assert acts["ddp", "full", 8] < acts["ddp", "selective", 8] < acts["ddp", "none", 8]
    for r in rows:
        assert {"strategy", "gradient_checkpointing", "micro_batch_size", "peak_bytes", "fits"} <= set(r)
        assert 512 % (r["micro_batch_size"] * r["dp_shard"]) == 0, "the global batch stays the recipe's"
        assert r["dp_shard"] * r["cp"] * r["tp"] * r["sp"] * r["pipeline_stages"] == 8
        parts = sum(r[f"{k}_bytes"] for k in ("params", "grads", "optimizer", "master", "activations", "logits_loss", "buffers"))
        assert parts == r["peak_bytes"]
    # 8 x 80 GB holds the 1B model many ways, but not DDP without checkpointing at micro-batch 32
    assert any(r["fits"] for r in rows)
    ddp_32 = next(r for r in rows if (r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]) == ("ddp", "none", 32))
    assert not ddp_32["fits"] and ddp_32["peak_bytes"] > 80e9

    mixture = "data.sources=[{name: web, weight: 0.7}, {name: docs, weight: 0.3}]"  # the planner holds for a mixture
    text = plan_command("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "80GB",
                        "data.path=", mixture)
    assert text.returncode == 0, text.stderr
    # the answer first: the row, then its launch line, then each strategy's fastest that fits and what the columns mean
    answer, line, _, intro, *table_and_notes = text.stdout.strip().splitlines()
    assert line.startswith("bash recipes/launch.sh --config_file accelerate_configs/") and "--num_processes 8" in line
    assert intro.startswith("each strategy at its fastest that fits (") and "--all lists every one" in intro
    listed = [r[:14].strip() for r in table_and_notes[2:] if r.split() and r.split()[-1] in ("yes", "no")]
    assert len(listed) == len(set(listed)) and listed[0] == "ddp"  # one row a strategy, the fastest first
    assert any(r.startswith("per GPU, GB = 1e9 bytes; step: estimated step time") and "+rsv: the CUDA context" in r
               for r in table_and_notes)
    every = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--all")
    assert every.returncode == 0 and "every row (" in every.stdout
    assert mixture in shlex.split(line)  # quoted for the shell, as a user pastes it
    assert "recipes/pretrain.py --config recipes/configs/pretrain_llama_1b.yaml" in line
    best = answer
    # the YAML ships what plan.py finds fastest on 8 x 80 GB (its launch line names ddp.yaml)
    shipped = load_config(PretrainConfig, ROOT / "recipes/configs/pretrain_llama_1b.yaml", [])
    assert best.startswith(f"fastest that fits: ddp, gradient checkpointing {shipped.model.gradient_checkpointing}, "
                           f"micro-batch {shipped.train.micro_batch_size} ("), best


def test_tensor_and_context_parallel_on_two_gpus():
    """fsdp_tp.yaml (tp 2 x dp_shard 1) cuts each tensor 2 ways where fsdp.yaml shards it 2 ways: the
    same state but for the norms, whole on both ranks; under the config's flex attention (transformers'
    plan) tp divides the attention and MLP activations, not the residual stream, and the head all-gathers the whole logits on each rank. fsdp_cp.yaml
    (cp 2 x dp_shard 1) is fsdp.yaml's state with half of each sequence per rank: fsdp.yaml's
    activations at half the micro-batch (as many tokens), plus in each of the 16 layers the keys and
    values gathered from the other half and sdpa's copy of the block-causal mask."""
    # eager layers: the model-parallel layouts' activations are modelled eager, compiled or not
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "4,8", "--json",
                "model.compile=none")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]): r for r in json.loads(proc.stdout)}
    fsdp, tp, cp = rows["fsdp", "none", 8], rows["fsdp_tp", "none", 8], rows["fsdp_cp", "none", 8]

    assert (tp["tp"], tp["dp_shard"], tp["requires"]) == (2, 1, ["model.loss=full"])
    norms = (16 * 2 + 1) * 2048 * 4  # every RMSNorm weight, fp32
    assert tp["params_bytes"] - fsdp["params_bytes"] == norms // 2
    assert tp["optimizer_bytes"] == pytest.approx(fsdp["optimizer_bytes"], rel=1e-4)
    assert tp["activations_bytes"] < fsdp["activations_bytes"]
    tokens_x_vocab = 8 * 2048 * 32768
    assert tp["logits_loss_bytes"] > 10 * tokens_x_vocab, "the whole logits and their fp32 copies on each rank"
    assert fsdp["logits_loss_bytes"] < 4 * tokens_x_vocab, "the config's chunked loss holds no whole logits"

    assert (cp["cp"], cp["dp_shard"], cp["requires"]) == (2, 1, ["model.attn_implementation=sdpa"])
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert cp[key] == fsdp[key], key
    assert cp["accumulation"] == 2 * fsdp["accumulation"], "a cp group reads one micro-batch"
    assert cp["activations_bytes"] < fsdp["activations_bytes"]
    other_half_kv = 2 * 2 * 512 * 8 * 1024  # (k, v) x bf16 x kv width x the 8 x 1024 tokens of the other rank
    mask = 8 * 1024 * 2048  # this rank's rows of the mask: bool, and a bf16 copy in every layer
    same_tokens = rows["fsdp", "none", 4]["activations_bytes"]
    assert cp["activations_bytes"] - same_tokens == pytest.approx(16 * (other_half_kv + 2 * mask) + mask, rel=1e-3)


def test_the_whole_model_compiled_is_launched_with_compiled_layers_where_it_cannot_run():
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
                "model.compile=model", "model.loss=full")
    assert proc.returncode == 0, proc.stderr
    needs = {r["strategy"]: r["requires"] for r in json.loads(proc.stdout) if r["gradient_checkpointing"] == "none"}
    assert needs["ddp"] == needs["fsdp"] == needs["zero3"] == []
    assert "model.compile=layers" not in needs["fsdp_cp"]
    for strategy in ("fsdp_tp", "fsdp_sp", "zero3_sp"):
        assert "model.compile=layers" in needs[strategy], (strategy, needs[strategy])


def test_fp8_is_planned_as_bf16_its_upper_bound_and_said_so():
    """The float8 layers' memory is not modelled: the rows are bf16's, and the plan says so under its table."""
    args = ("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "80GB", "--json")
    fp8 = plan(*args, "train.mixed_precision=fp8", "model.compile=layers")
    bf16 = plan(*args, "model.compile=layers")
    assert fp8.returncode == 0, fp8.stderr
    rows = {(r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]): r["peak_bytes"]
            for r in json.loads(bf16.stdout)}
    planned = json.loads(fp8.stdout)
    assert planned and all(rows[(r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"])] == r["peak_bytes"]
                           for r in planned)
    text = plan(*args[:-1], "train.mixed_precision=fp8", "model.compile=layers").stdout
    assert "train.mixed_precision=fp8 is planned as bf16, its upper bound" in text


def test_weight_copies_once_per_step_are_planned_where_they_run_and_refused_elsewhere():
    """model.cast_weights=per_step: DDP's rows hold every layer's bf16 copy through a fully recomputed step (2 bytes a
    matmul weight of the other layers beside the recomputed one's, which is all autocast holds); FSDP2 and ZeRO cast their own way, so
    their launch needs model.cast_weights=auto."""
    rows = {}
    for cast in ("per_forward", "per_step"):
        proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
                    f"model.cast_weights={cast}")
        assert proc.returncode == 0, proc.stderr
        rows[cast] = {(r["strategy"], r["gradient_checkpointing"]): r for r in json.loads(proc.stdout)}
    ddp = rows["per_step"]["ddp", "full"]["activations_bytes"] - rows["per_forward"]["ddp", "full"]["activations_bytes"]
    h, kv, inter = 2048, 8 * 64, 8192  # the YAML's layers: 16 of q, k, v, o, gate, up and down
    matmuls = 16 * (2 * h * h + 2 * h * kv + 3 * h * inter)
    # beside autocast's copy of the one layer being recomputed, the other 15 layers' (and their norms' gains)
    assert 0 <= ddp - 2 * matmuls * 15 // 16 <= 2 * 16 * 2 * h
    assert rows["per_step"]["ddp", "full"]["requires"] == []
    for strategy in ("fsdp", "zero3"):
        assert "model.cast_weights=auto" in rows["per_step"][strategy, "full"]["requires"], strategy
        assert rows["per_forward"][strategy, "full"]["requires"] == []


def test_tensor_parallel_under_sdpa_shards_the_sequence_between_the_layers():
    """fsdp_tp.yaml (tp 2 x dp_shard 1) under sdpa: Megatron's sequence parallel, the residual stream
    half of the tokens per rank. Beside the config's flex attention (transformers' plan), the same
    state; with every layer checkpointed each of the 16 layers keeps its fp32 input for 8 x 1024
    tokens instead of 8 x 2048 (sdpa adds packing's bool mask, once); the final norm keeps half of the
    tokens; the logits stay whole on each rank."""
    flex = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json")
    sdpa = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
                "model.attn_implementation=sdpa")
    assert flex.returncode == 0 and sdpa.returncode == 0, flex.stderr + sdpa.stderr
    assert "fsdp_tp: tp 2 x dp_shard 1, sequence parallel between the layers, as launched with model.loss=full" \
        in sdpa.stderr
    whole, split = ({r["gradient_checkpointing"]: r for r in json.loads(p.stdout) if r["strategy"] == "fsdp_tp"}
                    for p in (flex, sdpa))
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes"):
        assert split["full"][key] == whole["full"][key], key
    half = 8 * 1024  # this rank's tokens of the micro-batch's 8 x 2048
    mask = 8 * 2048 * 2048  # packing's bool block-causal mask, whole on every rank
    assert whole["full"]["activations_bytes"] - split["full"]["activations_bytes"] == 16 * 4 * 2048 * half - mask
    final_norm = 4 * 2048 + 4 + 4 * 2048  # fp32 input, 1/rms, fp32 normalised x per token
    assert whole["full"]["logits_loss_bytes"] - split["full"]["logits_loss_bytes"] == final_norm * half
    assert split["none"]["activations_bytes"] < whole["none"]["activations_bytes"]
    odd = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
               "model.attn_implementation=sdpa", "data.seq_len=2047")
    assert "fsdp_tp: not listed: data.seq_len=2047 is not divisible by parallelism_config_tp_size=2" in odd.stderr


def test_sequence_parallel_on_two_gpus():
    """zero3_sp.yaml (sp 2 x dp_shard 1) is zero3.yaml's state (ZeRO-3 over both ranks) with half of each
    sequence per rank: zero3.yaml's activations at half the micro-batch (as many tokens), plus in each
    of the 16 layers o_proj's own input (the all-to-all back's copy beside sdpa's output, which the
    whole sequence with half the heads makes as large as this rank's tokens with all of them), and once
    the whole sequence's bf16 block-causal mask, made once per forward and shared by the layers. The
    config's flex attention is launched as sdpa; logits for half the tokens."""
    # eager layers: the model-parallel layouts' activations are modelled eager, compiled or not
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "4,8", "--json",
                "model.compile=none")
    assert proc.returncode == 0, proc.stderr
    assert "zero3_sp: sp 2 x dp_shard 1, as launched with model.attn_implementation=sdpa" in proc.stderr
    rows = {(r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]): r for r in json.loads(proc.stdout)}
    zero3, sp = rows["zero3", "none", 8], rows["zero3_sp", "none", 8]
    assert (sp["sp"], sp["cp"], sp["tp"], sp["dp_shard"]) == (2, 1, 1, 1)
    assert sp["requires"] == ["model.attn_implementation=sdpa"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "buffers_bytes"):
        assert sp[key] == zero3[key], key
    assert sp["accumulation"] == 2 * zero3["accumulation"], "an sp group reads one micro-batch"
    same_tokens = rows["zero3", "none", 4]
    assert sp["peak_at"] == same_tokens["peak_at"] and sp["logits_loss_bytes"] == same_tokens["logits_loss_bytes"]
    o_proj_input = 2 * 8 * 1024 * 2048  # bf16 x this rank's 8 x 1024 tokens x 32 heads x 64
    mask = 2 * 8 * 2048 * 2048  # bf16, the whole sequence's, one for all the layers
    rotary = 2 * 1024 * 64 * 2  # cos and sin of half the positions fewer
    assert sp["activations_bytes"] - same_tokens["activations_bytes"] == 16 * o_proj_input + mask - rotary


def test_model_parallel_rows_say_what_a_launch_needs():
    long = ["data.seq_len=32768", "model.config.max_position_embeddings=32768"]
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--gpu-memory", "18GB",
                "--micro-batch", "1", *long)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    assert "fsdp_cp: cp 2 x dp_shard 1, as launched with model.attn_implementation=sdpa" in out
    assert "fsdp_tp: tp 2 x dp_shard 1, activations whole between the layers (flex_attention: transformers' plan), " \
        "as launched with model.loss=full" in out
    assert "zero3_sp: sp 2 x dp_shard 1, as launched with model.attn_implementation=sdpa" in out
    assert out[0].startswith("fastest that fits: fsdp_cp, gradient checkpointing full"), "32k tokens fit split in two"
    assert out[1].startswith("bash recipes/launch.sh --config_file accelerate_configs/fsdp_cp.yaml --num_processes 2 "
                             "--parallelism_config_dp_shard_size 1 recipes/pretrain.py")
    assert out[1].endswith(" ".join(long) + " model.attn_implementation=sdpa")

    heads = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8",
                 "model.config.num_key_value_heads=1", "--json")
    assert "fsdp_tp: not listed: model.config.num_key_value_heads=1 is not divisible by tp=2" in heads.stderr
    assert "fsdp_tp" not in {r["strategy"] for r in json.loads(heads.stdout)}
    odd_heads = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8",
                     "model.config.hidden_size=1920", "model.config.num_attention_heads=15",
                     "model.config.num_key_value_heads=5", "--json")
    assert "zero3_sp: not listed: llama has 15 attention heads, not divisible by parallelism_config_sp_size=2" \
        in odd_heads.stderr
    assert "zero3_sp" not in {r["strategy"] for r in json.loads(odd_heads.stdout)}


def test_a_small_gpu_makes_it_shard_and_recompute():
    rows = json.loads(plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--gpu-memory", "16GB",
                           "--json").stdout)
    fitting = {(r["strategy"], r["gradient_checkpointing"]) for r in rows if r["fits"]}
    assert ("ddp", "none") not in fitting, "DDP holds 16 bytes per parameter (16.6 GB) before any activation"
    assert ("zero3", "full") in fitting and ("fsdp", "full") in fitting


@pytest.mark.parametrize(("config", "said", "not_said"), [
    # a QLoRA shards its 4-bit base under FSDP2: more GPUs lower it
    ("finetune_llama3.1_8b_qlora.yaml", "try more GPUs or a shorter data.seq_len", ("DDP only", "GPUs with more memory",
                                                                                    "a LoRA (")),
    ("finetune_llama3.1_8b_full.yaml", "try more GPUs, a shorter data.seq_len or a LoRA (adapter.method=lora)",
     ("DDP only", "GPUs with more memory")),
])
def test_nothing_fits_says_what_limits_it_and_only_what_lowers_it(config, said, not_said):
    out = plan("--config", f"recipes/configs/{config}", "--gpus", "2", "--gpu-memory", "0.5GB").stdout
    first = out.splitlines()[0]
    assert first.startswith("nothing fits 2 GPU(s) of 0.5 GB: ") and said in first, first  # was "of 0 GB"
    assert not any(words in first for words in not_said), first


def test_lora_needs_a_small_optimizer_and_no_base_gradients():
    config = "recipes/configs/finetune_smollm2_lora.yaml"
    lora = json.loads(plan("--config", config, "--gpus", "1", "--gpu-memory", "24GB", "--json").stdout)
    full = json.loads(plan("--config", config, "--gpus", "1", "--gpu-memory", "24GB", "--json", "adapter.method=full").stdout)

    def ddp(rows):
        return next(r for r in rows if (r["strategy"], r["gradient_checkpointing"], r["micro_batch_size"]) == ("ddp", "none", 4))

    # the YAML's model.dtype=compute holds the frozen base in bf16 on a GPU: half the fp32 masters of a full fine-tune
    assert 0.5 * ddp(full)["params_bytes"] < ddp(lora)["params_bytes"] < 0.55 * ddp(full)["params_bytes"], \
        "the frozen base is still held, in bf16"
    assert ddp(lora)["optimizer_bytes"] < ddp(full)["optimizer_bytes"] / 20
    assert ddp(lora)["grads_bytes"] < ddp(full)["grads_bytes"] / 20


def test_the_readmes_fine_tune_plans_what_it_measured_on_cpu():
    """The README's LoRA of SmolLM2, one process in fp32 (what `auto` is on CPU): weights and live tensors measured
    2.36 GB at the step's peak (docs/benchmarks.md, "CPU: resident memory of the README's LoRA fine-tune by allocator"); as shipped before (LoRA dropout's kept
    copies, the full logits) 3.44 GB, which this plan put at 3.6."""
    config = "recipes/configs/finetune_smollm2_lora.yaml"
    rows = json.loads(plan("--config", config, "--gpus", "1", "--gpu-memory", "24GB", "--json", "--micro-batch", "4",
                           "train.mixed_precision=no").stdout)
    row = next(r for r in rows if (r["strategy"], r["gradient_checkpointing"]) == ("ddp", "none"))
    assert 2.36e9 <= row["peak_bytes"] <= 2.36e9 * 1.2, row


def test_the_cpu_plan_of_the_readmes_fine_tune_is_its_measured_resident_memory():
    """Issue 42 point 12: plan.py had no CPU answer (a GPU's, with a CUDA context, for `--gpus 1 --gpu-memory 24GB
    train.mixed_precision=no`). With --cpu, `auto` is fp32 as on a CPU launch and +rsv is the runtime and the free
    memory of the allocator the launcher preloads (mimalloc): peak + rsv against the peak RSS measured for one process
    and, per rank, for ZeRO-3 x 2 (the larger rank), in bytes (/usr/bin/time's KiB; docs/benchmarks.md)."""
    config = "recipes/configs/finetune_smollm2_lora.yaml"
    for gpus, strategy, measured in ((1, "ddp", MEASURED_ONE_PROCESS), (2, "zero3", 3_062_772 * 1024)):
        proc = plan("--config", config, "--cpu", "--gpus", str(gpus), "--gpu-memory", "12GB", "--json", "--micro-batch", "4")
        row = next(r for r in json.loads(proc.stdout) if (r["strategy"], r["gradient_checkpointing"]) == (strategy, "none"))
        resident = row["peak_bytes"] + row["reserve_bytes"]
        assert abs(resident - measured) <= 0.1 * measured, (gpus, resident, row)
    text = plan("--config", config, "--cpu", "--gpus", "1", "--gpu-memory", "12GB", "--micro-batch", "4").stdout
    assert "per CPU process" in text and "CUDA" not in text, text[:400]


MEASURED_ONE_PROCESS = 3_097_384 * 1024  # peak RSS in bytes, one process under mimalloc (docs/benchmarks.md, "CPU: resident memory ... by allocator")


# the shipped configs tests/recipes/test_base_configs.py does not plan (it plans the bases people fine-tune)
OWN_CONFIGS = sorted(p.name for p in (ROOT / "recipes" / "configs").glob("*.yaml")
                     if p.name.startswith(("pretrain_", "finetune_smollm2_")))


@pytest.mark.parametrize("name", OWN_CONFIGS)
def test_every_shipped_config_is_planned_or_refused_with_its_reason(name):
    """Issue 42 point 9: plan.py refused the shipped GPT-2 config, where a user is told nothing to do. On 8 x 80 GB,
    as the README plans: the answer first, or one line that says why and what to do instead."""
    proc = plan("--config", f"recipes/configs/{name}", "--gpus", "8", "--gpu-memory", "80GB")
    if proc.returncode == 0:
        assert proc.stdout.startswith("fastest that fits: "), proc.stdout[:300]
        return
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and not proc.stdout.strip() and len(lines) == 1 and lines[0].startswith("error: "), proc
    reasons = {"model_type 'gpt2' is not modelled yet": "launch it as its YAML's first line says",
               "no micro-batch in [1, 2, 4, 8, 16, 32] divides train.global_batch_size=4 over 8 GPUs":
                   "plan for a --gpus that divides 4, or set train.global_batch_size to a multiple of 8"}
    said = [reason for reason in reasons if reason in proc.stderr]
    assert said and reasons[said[0]] in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu-memory", "lots"], "is not a size"),
        (["train.nonsense=1"], "nonsense"),
        (["--gpus", "3"], "divides train.global_batch_size=512"),
    ],
)
def test_bad_input_is_one_line(args, message):
    extra = ["--micro-batch", "8"] if "--gpus" in args else []
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", *args, *extra)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


# every option of plan.py by kind: tests/support/wrong_arguments.py lists each kind's wrong values
KINDS = {"--config": "file", "--gpus": "count", "--gpu-memory": "size", "--headroom": "fraction", "--micro-batch": "sizes",
         "--cpu": "switch", "--json": "switch", "--all": "switch", "overrides": "overrides", "-h": "help"}


def test_every_option_of_plan_has_a_kind():
    """A new option fails here until KINDS says what it takes, and so which wrong values it must refuse."""
    found = {action.option_strings[0] if action.option_strings else action.dest for action in PLAN.parser()._actions}
    assert found == set(KINDS)


@pytest.mark.parametrize("option, case", wrong_arguments.cases(KINDS))
def test_every_wrong_value_of_every_option_is_one_line(option, case, tmp_path, monkeypatch):
    """--micro-batch 0 and 0,a were tracebacks, --gpus 0 and --headroom 1.5 blamed each other, --gpu-memory 0GB
    planned 0 GB GPUs, --gpu-memory -5GB was argparse's usage block: each is one line naming the option and value."""
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    (tmp_path / "file.txt").write_text("x")
    argv, value = wrong_arguments.argv_of(option, KINDS[option], case, {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt")})
    base = [] if option == "--config" else ["--config", "recipes/configs/pretrain_tiny.yaml"]
    proc = plan(*base, *argv)
    wrong_arguments.assert_one_line(proc.returncode, proc.stdout, proc.stderr, option, value)


def test_the_options_are_checked_apart_and_say_what_they_take():
    """Each option's line says what it takes; --micro-batch lists each size once, in order."""
    said = {args: plan("--config", "recipes/configs/pretrain_tiny.yaml", *args).stderr.strip() for args in
            (("--gpus", "0"), ("--headroom", "1.5"), ("--gpu-memory", "0GB"), ("--gpu-memory", "-5GB"), ("--micro-batch", "0,a"))}
    assert said[("--gpus", "0")] == "error: --gpus 0 must be at least 1: the GPUs the run will use"
    assert said[("--headroom", "1.5")].startswith("error: --headroom 1.5 must be at least 0 and below 0.9")
    assert "--gpus" not in said[("--headroom", "1.5")] and "--headroom" not in said[("--gpus", "0")]
    assert said[("--gpu-memory", "0GB")].startswith("error: --gpu-memory 0GB is too little to plan in")
    assert said[("--gpu-memory", "-5GB")] == ("error: --gpu-memory '-5GB' is not a size; write one GPU's memory, e.g. 80GB, "
                                              "24GiB or 40960MiB")  # -5GB was taken for an option: argparse's usage block
    assert said[("--micro-batch", "0,a")].startswith("error: --micro-batch 0,a: 0 is not a size; give sizes of 1 or more")
    assert PLAN.parse_micro_batches("8,2,8") == (2, 8) and PLAN.parse_micro_batches(None) == PLAN.MICRO_BATCHES


def test_a_pipeline_row_is_its_largest_stage():
    """ddp.yaml + train.pipeline_stages=2 on 2 GPUs: the row is the rank of its largest stage, which holds
    that stage's weights, gradients and AdamW state whole (layer_ranges' cut; the tied embedding/head a
    copy on both ends); the first stage keeps 2 micro-batches in flight of its 8 layers, as many
    layer-micro-batches as DDP's 16 layers of one, and no logits; the last stage the logits of one
    micro-batch, as DDP. fp16 is refused (the schedule's backward has no loss scaling)."""
    fp32_full_loss = ["train.mixed_precision=no", "model.loss=full"]
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
                *fp32_full_loss)
    assert proc.returncode == 0, proc.stderr
    assert "pp2: ddp.yaml + train.pipeline_stages=2 (2 stages x 1 replicas)" in proc.stderr
    rows = {(r["strategy"], r["gradient_checkpointing"]): r for r in json.loads(proc.stdout)}
    ddp, first, last = rows["ddp", "none"], rows["pipeline", "none"], rows["pipeline", "full"]
    assert {r["pipeline_stages"] for r in (first, last)} == {2} and first["dp_shard"] == 1
    assert (first["stage"], last["stage"]) == (0, 1)
    assert first["accumulation"] == ddp["accumulation"] * 2 == 64, "one pipeline reads what two DDP ranks would"

    cfg = load_config(PretrainConfig, ROOT / "recipes/configs/pretrain_llama_1b.yaml", [])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model, cfg.tokenizer.vocab_size, 0, None))
    ranges = layer_ranges(16, 2)

    def held(stage: int) -> list[torch.Tensor]:
        return [p for n, p in model.named_parameters(remove_duplicate=False)
                if (n.startswith("model.layers.") and int(n.split(".")[2]) in ranges[stage])
                or (n == "model.embed_tokens.weight" and stage == 0) or (not n.startswith("model.layers.") and
                                                                        n != "model.embed_tokens.weight" and stage == 1)]

    for row in (first, last):
        mine = held(row["stage"])
        numel = sum(p.numel() for p in mine)
        assert (row["params_bytes"], row["grads_bytes"]) == (4 * numel, 4 * numel), row["stage"]
        assert row["optimizer_bytes"] == 8 * numel + 4 * len(mine), "AdamW's exp_avg, exp_avg_sq and step"
        assert 0.5 < row["params_bytes"] / ddp["params_bytes"] < 0.6, "half the layers, and the tied embedding"
        received = 2048 * 4 + (8 if row["stage"] == 1 else 0)
        assert row["buffers_bytes"] == 64 * 8 * 2048 * received, \
            "a receive buffer per micro-batch (64 of them): gradients on stage 0, hidden states and position ids on 1"

    # 8 layers x 2 micro-batches in flight = DDP's 16 x 1, plus the second micro-batch's rotary angles and
    # token ids (flex attention: no mask), and the gradient through the last layer's backward
    tokens = 8 * 2048
    assert ddp["peak_at"] == "loss backward" and first["peak_at"] == "last layer's backward"  # all saved, both
    rotary_and_ids = 2 * 2048 * 64 * 4 + 8 * tokens
    through_backward = tokens * (2 * 4 * 2048 + 2 * 4 * 8192)
    assert first["activations_bytes"] - ddp["activations_bytes"] == rotary_and_ids + through_backward
    assert first["logits_loss_bytes"] == 0
    full_ddp = rows["ddp", "full"]
    assert last["peak_at"] == full_ddp["peak_at"] == "loss backward"
    assert last["logits_loss_bytes"] == full_ddp["logits_loss_bytes"] > tokens * 32768 * 8, "one micro-batch's logits"

    # the launch line is ddp.yaml's with the stage count
    small = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--gpu-memory", "33GB",
                 "--micro-batch", "8", *fp32_full_loss).stdout.strip().splitlines()
    assert small[0].startswith("fastest that fits: pp2 stage 1, gradient checkpointing full"), small[:3]
    assert small[1] == ("bash recipes/launch.sh --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/pretrain.py "
                         "--config recipes/configs/pretrain_llama_1b.yaml train.micro_batch_size=8 "
                         "model.gradient_checkpointing=full " + " ".join(fp32_full_loss) + " train.pipeline_stages=2")


def test_what_a_pipeline_refuses_is_named_under_the_table():
    proc = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "8", "--micro-batch", "8",
                "model.config.num_hidden_layers=3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert ("pipeline, train.pipeline_stages=4: not listed: model.config.num_hidden_layers=3 cannot fill 4 pipeline "
            "stages; use at most 3 stages") in proc.stderr
    assert {r["pipeline_stages"] for r in json.loads(proc.stdout)} == {1, 2}
    lora = plan("--config", "recipes/configs/finetune_smollm2_lora.yaml", "--gpus", "2", "--json")
    assert "pipeline, train.pipeline_stages=2: not listed: pipeline parallel trains a whole model, not a LoRA adapter" \
        in lora.stderr
    assert {r["pipeline_stages"] for r in json.loads(lora.stdout)} == {1}
    fp16 = plan("--config", "recipes/configs/pretrain_llama_1b.yaml", "--gpus", "2", "--micro-batch", "8",
                "train.mixed_precision=fp16", "--json")
    assert ("pipeline, train.pipeline_stages=2: not listed: train.pipeline_stages=2 with train.mixed_precision=fp16 is "
            "not supported") in fp16.stderr


def test_preference_tuning_is_planned_data_parallel_with_full_logits():
    proc = plan("--config", "recipes/configs/finetune_smollm2_dpo_lora.yaml", "--gpus", "2", "--json",
                "model.loss=chunked", "adapter.method=full")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and {r["cp"] * r["tp"] * r["sp"] * r["pipeline_stages"] for r in rows} == {1}
    assert all(r["requires"] == ["model.loss=full"] for r in rows)
    assert "not listed: train.objective=dpo trains under DDP, FSDP and ZeRO (data parallel), not with model parallel" \
        in proc.stderr
    sft = json.loads(plan("--config", "recipes/configs/finetune_smollm2_chat_lora.yaml", "--gpus", "2", "--json",
                          "model.loss=chunked", "adapter.method=full", "data.seq_len=512").stdout)
    # the same model and blocks, trained on the full logits: what the chunked SFT loss saves is held
    ddp = {r["strategy"]: r for r in sft if r["micro_batch_size"] == 2 and r["gradient_checkpointing"] == "none"}
    dpo = {r["strategy"]: r for r in rows if r["micro_batch_size"] == 2 and r["gradient_checkpointing"] == "none"}
    assert dpo["ddp"]["peak_bytes"] > ddp["ddp"]["peak_bytes"]


def test_a_mixture_of_experts_is_planned_with_expert_parallel():
    """Qwen3-MoE (pretrain_tiny's sizes, 4 experts): parameters with every expert's, each routed copy of a
    token's expert activations (top-k 2 -> 4: two more per token and layer, in the weights' dtype: fp32
    under DDP's autocast, bf16 under FSDP2 and ZeRO), the strategies that refuse a mixture of experts
    named, and fsdp_tp listed with its experts spread over the 2 tp ranks: each rank keeps half of the
    routed copies (balanced routing, said under the table)."""
    moe = ["model.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.moe_intermediate_size=64"]
    rows = {}
    for k in (2, 4):
        proc = plan("--config", "recipes/configs/pretrain_tiny.yaml", "--gpus", "2", "--micro-batch", "8", "--json",
                    *moe, f"model.config.num_experts_per_tok={k}")
        assert proc.returncode == 0, proc.stderr
        rows[k] = {(r["strategy"], r["gradient_checkpointing"]): r for r in json.loads(proc.stdout)}
    assert "fsdp_tp: tp 2 x dp_shard 1, experts spread over the tp ranks (ep 2: 2 of 4 on each), activations whole " \
           "between the layers (a mixture of experts: transformers' plan); estimated with balanced routing" in proc.stderr
    assert {s for s, _ in rows[2]} == {"ddp", "fsdp", "fsdp_tp", "zero1", "zero2", "zero3", "zero3_offload"}
    cfg = load_config(PretrainConfig, ROOT / "recipes/configs/pretrain_tiny.yaml", [*moe, "model.config.num_experts_per_tok=2"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model, 4096, 0, None))
    assert rows[2]["ddp", "none"]["params_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    tokens_layers, h, i = 8 * 128 * 4, 128, 64
    for strategy, weights in (("ddp", 4), ("fsdp", 2), ("zero3", 2)):
        # per routed copy: gathered input, gate_up, silu, product, down output; 3 int64 indices; its bf16
        # routing weight. The router: 8 more bytes of top-k indices per copy
        more = 2 * (weights * (2 * h + 4 * i) + 24 + 2 + 8) * tokens_layers
        grown = rows[4][strategy, "none"]["activations_bytes"] - rows[2][strategy, "none"]["activations_bytes"]
        assert grown == more, strategy
    # fsdp_tp (autocast over fp32 weights): the router's top-k indices for every token; each rank sends the
    # copies of its half of the tokens (2 int64 indices, the fp32 expert output coming back, its bf16 routing
    # weight) and its experts receive half of all the copies (fp32 gathered input, gate_up, silu, product, a
    # unit weight; 2 int64 indices and a 1-byte mask): two more copies per token are one more on each rank
    sent, received = 8 + 8 + 4 * h + 2, 4 * (h + 4 * i) + 4 + 8 + 8 + 1
    grown = rows[4]["fsdp_tp", "none"]["activations_bytes"] - rows[2]["fsdp_tp", "none"]["activations_bytes"]
    assert grown == (2 * 8 + sent + received) * tokens_layers


def test_planned_from_elsewhere_the_launch_line_is_the_installed_commands(tmp_path, monkeypatch, capsys):
    """`llm-toolkit plan` from a user's folder: accelerate_configs/ and recipes/ are not there, llm-toolkit finds them."""
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "recipes" / "configs" / "pretrain_llama_1b.yaml")
    assert PLAN.main(["--config", config, "--gpus", "8"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(f"llm-toolkit pretrain --config_file ddp --num_processes 8 --config {config} "), line
