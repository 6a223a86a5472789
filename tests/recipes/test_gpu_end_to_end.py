"""End to end on one CUDA GPU at world size 1, in bf16: what a user runs, on the hardware it is for.

`pytest -m gpu` on a GPU machine (docs/gpu.md says how to set one up); skipped where
CUDA is absent. The SmolLM2 GGUF is too large to carry to that machine, so the fine-tunes start
from a base that the pretraining recipe trains there first. What it printed when it last ran
is in docs/gpu.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from recipe_runner import ROOT, TINY, run_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.run.folder import RunDir
from toolkit.training.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run with pytest -m gpu on a GPU machine"),
]

# every shipped accelerate config, at world size 1 (the multinode one on this single node); the
# model-parallel ones split the model over 2 ranks, and one GPU cannot hold two NCCL ranks
MODEL_PARALLEL = {p.name for p in (ROOT / "accelerate_configs").glob("*.yaml") if "parallelism_config:" in p.read_text()}
CONFIGS = [
    pytest.param(name, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="splits the model over 2 GPUs"))
    if name in MODEL_PARALLEL else name
    for name in sorted(p.name for p in (ROOT / "accelerate_configs").glob("*.yaml"))
]
SINGLE_NODE = ["--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1"]
PRETRAIN = [*TINY, "train.mixed_precision=bf16", "train.max_steps=6", "checkpoint.every=3", "samples.max_new_tokens=16"]


def launch(recipe: str, overrides: list[str], cache, accelerate_config: str = "ddp.yaml", config: str | None = None):
    extra = SINGLE_NODE if accelerate_config.startswith("multinode") else []
    kwargs = {"config": config} if config else {}
    nproc = 2 if accelerate_config in MODEL_PARALLEL else 1
    return run_recipe(recipe, overrides, nproc=nproc, cache=cache, accelerate_config=accelerate_config,
                      launch=True, launcher=True, launch_args=extra, **kwargs)


@pytest.mark.parametrize("accelerate_config", CONFIGS)
def test_pretrain_trains_checkpoints_resumes_and_samples(accelerate_config, tmp_path, data_cache):
    out = tmp_path / "run"
    proc = launch("pretrain", [*PRETRAIN, f"output_dir={out}"], data_cache, accelerate_config)
    log = proc.stdout + proc.stderr
    print(log[-3000:])  # shown with pytest -s: the record for docs/gpu.md
    assert f"world_size={2 if accelerate_config in MODEL_PARALLEL else 1}" in log and "precision=bf16" in log and "device=cuda" in log, log[-3000:]
    assert "sample      : " in proc.stdout
    assert [p.name for p in RunDir(out).complete_checkpoints()] == ["step-3", "step-6"]
    final = out / "final"
    weights = load_file(str(final / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}  # fp32 masters, whatever the strategy
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.bfloat16).cuda()
    ids = AutoTokenizer.from_pretrained(final)("The for statement", return_tensors="pt")["input_ids"].cuda()
    assert model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 8

    launch("pretrain", [*PRETRAIN, "train.max_steps=8", "resume=auto", f"output_dir={out}"], data_cache, accelerate_config)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9)), steps  # resumed from step 6, no step repeated or lost


@pytest.fixture(scope="module")
def gpu_base(tmp_path_factory, data_cache):
    """A tiny LLaMA pretrained on the GPU: the base of the fine-tunes below."""
    out = tmp_path_factory.mktemp("gpu-base") / "run"
    launch("pretrain", [*PRETRAIN, "train.max_steps=20", "samples.max_new_tokens=0", f"output_dir={out}"], data_cache)
    return out / "final"


FINETUNES = {
    "lora": "finetune_smollm2_lora.yaml",
    "full": "finetune_smollm2_full.yaml",
    "qlora": "finetune_smollm2_qlora.yaml",
}


@pytest.mark.parametrize("method", FINETUNES)
def test_finetune_from_a_gpu_trained_base(method, gpu_base, tmp_path, data_cache):
    if method == "qlora":
        pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install -e '.[qlora]'")
    out = tmp_path / method
    overrides = [
        f"model.path={gpu_base}", "data.format=text", "data.seq_len=64", "train.max_steps=12",
        "train.global_batch_size=8", "train.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=1",
        "logging.trackers=[]", "eval.blocks=8",
        "samples.max_new_tokens=8", "checkpoint.every=3", f"output_dir={out}",
    ]
    proc = launch("finetune", overrides, data_cache, config=FINETUNES[method])
    log = proc.stdout + proc.stderr
    print(log[-3000:])
    assert "device=cuda" in log
    phases = {r["phase"]: r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "phase" in r}
    assert phases["after"] < phases["before"], phases
    assert (out / "samples.md").is_file()
    final = out / "final"
    assert final.is_dir()  # full: the model; lora/qlora: merge=true in the shipped YAMLs
    model = AutoModelForCausalLM.from_pretrained(final).cuda()
    assert all(p.is_floating_point() for p in model.parameters())


@pytest.mark.parametrize("fmt", ["hf", "gguf", "int8", "int4"])
def test_export_of_a_gpu_run(fmt, gpu_base, tmp_path):
    output = tmp_path / ("model.gguf" if fmt == "gguf" else fmt)
    cmd = [sys.executable, "recipes/export.py", "--from", str(gpu_base.parent), "--format", fmt, "--output", str(output)]
    if fmt == "gguf":
        pytest.importorskip("gguf")
        cmd += ["--quant", "q8_0"]
    if fmt in ("int8", "int4"):
        pytest.importorskip("torchao")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout[-2000:])
    if fmt == "gguf":
        assert output.is_file() and output.read_bytes()[:4] == b"GGUF"
        return
    model = AutoModelForCausalLM.from_pretrained(output, device_map="cuda")  # int8/int4 load on CUDA
    ids = AutoTokenizer.from_pretrained(output)("The for statement", return_tensors="pt")["input_ids"].cuda()
    assert model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 8
