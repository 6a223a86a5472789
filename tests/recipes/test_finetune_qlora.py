"""QLoRA on the CPU (bitsandbytes 0.50's 4-bit NF4 kernels): a LoRA on the tiny base loaded in 4-bit, in one process
and under FSDP2 and DeepSpeed ZeRO-3 on 2 processes, which shard the packed 4-bit bytes; resumed, merged and exported
as a LoRA is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recipe_runner import FT_TINY, recipe_module, run_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

CONFIG = "finetune_smollm2_qlora.yaml"
KERNELS_LINE = "Failed to load CPU gemm_4bit_forward"  # bitsandbytes' import notice, filtered (adapter.import_bitsandbytes)
NO_BACKWARD = "an autograd kernel was not registered"  # its inference repack (adapter.keep_4bit_trainable)


def qlora_chat(tiny_base, chatml_file, out, *more) -> list[str]:
    return [*FT_TINY, f"model.path={tiny_base}", "model.dtype=float32", "data.format=chat",
            f"data.chat_template={chatml_file}", "data.append_stop=true", "adapter.method=qlora", "adapter.dropout=0",
            "adapter.r=8", "train.mixed_precision=no", "train.max_steps=4", f"output_dir={out}", *more]


def train_losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def held(out) -> list[dict]:
    return next(r["held_bytes"] for r in read_metrics(out / "metrics.jsonl") if "held_bytes" in r)


def model_tensors_of(base) -> list:
    from transformers import AutoConfig

    from toolkit.models.adapter import AdapterConfig, apply_adapter
    from toolkit.planner.state import model_tensors

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    model, _ = apply_adapter(model, AdapterConfig(method="qlora", r=8, dropout=0))
    return model_tensors(model, quantized_base=True)


def planned_state(base, gpus: int, accelerate_config: str) -> dict[str, int]:
    from transformers import AutoConfig

    from toolkit.planner.facts import Run, read_strategy
    from toolkit.planner.state import state_bytes

    strategy = read_strategy(ROOT / "accelerate_configs" / accelerate_config, AutoConfig.from_pretrained(base).hidden_size)
    run = Run(strategy, gpus, 2, 128, precision="fp32", quantized_base=True)
    return state_bytes(model_tensors_of(base), run)


@pytest.fixture(scope="module")
def one_process(tiny_base, chatml_file, data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora") / "one"
    proc = run_recipe("finetune", qlora_chat(tiny_base, chatml_file, out), nproc=1, cache=data_cache, config=CONFIG)
    return out, proc.stdout + proc.stderr


def test_qlora_trains_on_the_cpu_and_merges_into_the_full_precision_base(one_process, tiny_base, chatml_file,
                                                                          data_cache, tmp_path):
    out, log = one_process
    assert "base model: 4-bit NF4 (bitsandbytes), computing in float32, packed bytes held as uint8" in log
    assert "weights: qlora r=8" in log and KERNELS_LINE not in log and NO_BACKWARD not in log
    losses = train_losses(out)
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    evals = {r["phase"]: r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "phase" in r}
    assert evals["after"] < evals["before"], evals
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    # final/: the adapter merged into the base reloaded in full precision (MERGES["method"]["qlora"])
    merged = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    assert getattr(merged.config, "quantization_config", None) is None
    assert set(merged.state_dict()) == set(base.state_dict()) and all(p.dtype == torch.float32 for p in merged.parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])
    # resumed at its step-3 checkpoint, step 4 is the uninterrupted run's, bit for bit
    resumed = tmp_path / "resumed"
    run_recipe("finetune", qlora_chat(tiny_base, chatml_file, resumed, f"resume={out / 'checkpoints' / 'step-3'}"),
               nproc=1, cache=data_cache, config=CONFIG)
    assert train_losses(resumed) == losses[3:]
    a, b = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (out, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_checkpoint_exports_as_final(out, tmp_path / "from-checkpoint")


def assert_checkpoint_exports_as_final(out, exported) -> None:
    """A QLoRA run's last checkpoint, exported with --merge-lora, is final/: its adapter merged into the base reloaded
    in full precision (its packed 4-bit base cannot be; transformers' 4-bit loader was asked to and refused)."""
    code = recipe_module("export").main(["--from", str(out), "--checkpoint", "latest", "--merge-lora", "--format", "hf",
                                         "--output", str(exported)])
    assert code == 0
    assert "merged its" in (exported / "export_report.md").read_text() and "reloaded in full precision" in (
        exported / "export_report.md").read_text()
    mine, final = load_file(exported / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert mine.keys() == final.keys() and all(torch.allclose(mine[k], final[k], atol=1e-6) for k in mine)


# what each layout says it holds the packed bytes in, and how many of the one process's parameter bytes a rank holds
SHARDED = {
    # each rank holds half of every tensor: the packed 4-bit bytes (FSDP2 shards them), the fp32 embeddings and norms,
    # the adapter (measured: 117,376 of 234,752)
    "fsdp.yaml": ("packed bytes held as float32 (sharded over the ranks)", 117_376),
    # ZeRO-3 partitions the uint8 bytes themselves (each rank's Params4bit a ds_tensor of half its bytes, the quant
    # state whole beside it) and everything else; the tensors under stage3_param_persistence_threshold (640 elements:
    # the norms and most LoRA matrices) are held whole beside their partitions (measured: 159,616)
    "zero3.yaml": ("packed bytes held as uint8 (sharded over the ranks)", 159_616),
}


@pytest.mark.distributed
@pytest.mark.parametrize("accelerate_config", SHARDED, ids=["fsdp2", "zero3"])
def test_qlora_sharded_over_2_processes_matches_one_process_resumes_and_exports(
        accelerate_config, one_process, tiny_base, chatml_file, data_cache, tmp_path, capsys):
    reference, _ = one_process
    said, params = SHARDED[accelerate_config]
    out = tmp_path / "run"
    log = run_recipe("finetune", qlora_chat(tiny_base, chatml_file, out), nproc=2, cache=data_cache, config=CONFIG,
                     accelerate_config=accelerate_config).stdout
    assert said in log and "non-floating frozen Params4bit" not in log
    expected, got = train_losses(reference), train_losses(out)
    # the 4-bit path adds no rounding of its own between layouts: each rank dequantises the same NF4 blocks to the same
    # fp32 weights, so what differs is the fp32 sums' order, as for a LoRA (test_finetune_strategies: rel 1e-4, 4e-5
    # derived); measured 0 at every step (fp32, FSDP2 and ZeRO-3) and <= 1.7e-5 relative in bf16
    for step, (a, b) in enumerate(zip(expected, got, strict=True), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: 1 process {a}, {accelerate_config} {b}"
    # each rank holds its share of the parameters, half the adapter's gradients and Adam state
    one, ranks = held(reference)[0], held(out)
    assert [r["params"] for r in ranks] == [params] * 2, (one, ranks)
    assert all(r["grads"] == one["grads"] // 2 and r["optimizer"] < one["optimizer"] * 0.51 for r in ranks), (one, ranks)
    # the planner's rank on 2 GPUs is that rank (ZeRO-3's fp32 master partition of the adapter too); beside it, it
    # counts the quant state each rank holds whole (0.016 a weight), which is not a parameter, so not in held_bytes
    planned = planned_state(tiny_base, 2, accelerate_config)
    packed = sum(t.numel for t in model_tensors_of(tiny_base) if t.quantized)
    assert abs(planned["params"] - packed * 0.016 - ranks[0]["params"]) < 1, (planned, ranks[0])  # int() of a float sum
    assert all(planned[k] == ranks[0][k] for k in ("grads", "optimizer", "master")), (planned, ranks[0])
    # resumed at its step-3 checkpoint: step 4 bit for bit
    resumed = tmp_path / "resumed"
    run_recipe("finetune", qlora_chat(tiny_base, chatml_file, resumed, f"resume={out / 'checkpoints' / 'step-3'}"),
               nproc=2, cache=data_cache, config=CONFIG, accelerate_config=accelerate_config)
    assert train_losses(resumed) == got[3:]
    a, b = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (out, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the adapter written from the shards exports as a LoRA's: merged into the full-precision base, as final/ is
    exported = tmp_path / "exported"
    code = recipe_module("export").main(["--from", str(out / "adapter"), "--base", str(tiny_base), "--merge-lora",
                                         "--format", "hf", "--output", str(exported)])
    assert code == 0, capsys.readouterr().err
    mine, final = load_file(exported / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert mine.keys() == final.keys() and all(torch.allclose(mine[k], final[k], atol=1e-6) for k in mine)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert_checkpoint_exports_as_final(out, tmp_path / "from-checkpoint")  # the shards gathered, then merged


@pytest.mark.parametrize("accelerate_config, measured", [("zero2.yaml", 135_808), ("zero3.yaml", 89_024)])
def test_the_planner_holds_a_qlora_base_in_bf16_as_deepspeed_does(accelerate_config, measured, tiny_base):
    # DeepSpeed's bf16 mode casts the weights peft kept in fp32 (embeddings, norms) and the adapter to bf16; the packed
    # bytes stay uint8. `measured`: a rank's held_bytes params of this run with train.mixed_precision=bf16 on 2 CPU
    # processes (ZeRO-2 holds every parameter whole, ZeRO-3 its partitions and the persisted ones whole)
    from transformers import AutoConfig

    from toolkit.planner.facts import Run, read_strategy
    from toolkit.planner.state import state_bytes

    tensors = model_tensors_of(tiny_base)
    strategy = read_strategy(ROOT / "accelerate_configs" / accelerate_config, AutoConfig.from_pretrained(tiny_base).hidden_size)
    planned = state_bytes(tensors, Run(strategy, 2, 2, 128, precision="bf16", quantized_base=True))
    packed = sum(t.numel for t in tensors if t.quantized)
    assert abs(planned["params"] - packed * 0.016 - measured) < 1, planned
