"""A user's own DeepSpeed JSON, and strategy configs that cannot work: one clear line each."""

from __future__ import annotations

import json

import pytest
import yaml
from recipe_runner import ROOT, TINY, run_recipe

from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed


def accelerate_config(tmp_path, ds: dict | str | None = None, fsdp_layer: str | None = None) -> str:
    """Write an accelerate config (and its DeepSpeed JSON) next to the test; return its path."""
    if fsdp_layer is not None:
        cfg = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp.yaml").read_text())
        cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = fsdp_layer
    else:
        cfg = yaml.safe_load((ROOT / "accelerate_configs" / "zero2.yaml").read_text())
        ds_path = tmp_path / "ds.json"
        ds_path.write_text(ds if isinstance(ds, str) else json.dumps(ds, indent=2))
        cfg["deepspeed_config"]["deepspeed_config_file"] = str(ds_path)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def zero2_with(**changes) -> dict:
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds.update(changes)
    return ds


def launch_error(tmp_path, data_cache, config: str, *extra: str) -> str:
    """The one error line the ranks stop with (exit code 2: bad input), on ranks forked with the launcher's
    environment; how a launcher shows a rank's error line is test_launch_wrapper.py's."""
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=2", f"output_dir={tmp_path / 'run'}", *extra],
                      nproc=2, cache=data_cache, accelerate_config=config, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error: ")]
    assert errors and set(errors) == {errors[0]}, proc.stdout[-3000:]  # a rank killed after the first failed says none
    assert "Traceback" not in proc.stdout
    return errors[0]


def test_users_deepspeed_json_with_its_own_optimizer_and_scheduler(tmp_path, data_cache):
    """The form of the templates in Accelerate's repository: DeepSpeed builds optimizer and schedule."""
    ds = zero2_with(
        optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    )
    out = tmp_path / "run"
    proc = run_recipe("pretrain", [*TINY, "train.max_steps=6", "optim.warmup_steps=3", f"output_dir={out}"],
                      nproc=2, cache=data_cache, accelerate_config=accelerate_config(tmp_path, ds))
    assert "the DeepSpeed config defines optimizer and scheduler: using them" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    lrs = [r["lr"] for r in rows]
    assert lrs[0] < lrs[2] and lrs[-1] < lrs[3], f"DeepSpeed's warmup/decay schedule was not in force: {lrs}"
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_micro_batch_that_contradicts_the_recipe(tmp_path, data_cache):
    err = launch_error(tmp_path, data_cache, accelerate_config(tmp_path, zero2_with(train_micro_batch_size_per_gpu=4)))
    assert "train_micro_batch_size_per_gpu=4 but the recipe has 2 (train.micro_batch_size)" in err


def test_fsdp_layer_class_the_model_does_not_have(tmp_path, data_cache):
    err = launch_error(tmp_path, data_cache, accelerate_config(tmp_path, fsdp_layer="GPT2Block"))
    assert "wraps GPT2Block, which this LlamaForCausalLM does not have" in err and "LlamaDecoderLayer" in err


def test_deepspeed_config_without_deepspeed_importable(tmp_path, data_cache):
    """`accelerate launch` itself stops first when DeepSpeed is missing; a recipe started by any
    other launcher with DeepSpeed requested (torchrun, SLURM srun) says it in one line too."""
    blocker = tmp_path / "no_deepspeed" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named deepspeed (blocked by the test)')\n")
    env = {"PYTHONPATH": str(blocker.parent), "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json"}
    proc = run_recipe("pretrain", [*TINY, f"output_dir={tmp_path / 'run'}"], nproc=1, cache=data_cache,
                      check=False, env=env, launcher=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the accelerate config asks for DeepSpeed, but it cannot be imported")
    assert "Traceback" not in proc.stderr
