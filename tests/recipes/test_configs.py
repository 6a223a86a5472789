"""Every shipped recipe YAML and accelerate config loads and validates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from recipe_runner import ROOT

from toolkit.config.load import load_config
from toolkit.models.scratch import check_seq_len, hf_config
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_the_required_configs_ship():
    names = {p.name for p in RECIPE_CONFIGS}
    assert {"pretrain_tiny.yaml", "pretrain_gpt2_124m.yaml", "pretrain_llama_1b.yaml"} <= names
    assert {"finetune_smollm2_lora.yaml", "finetune_smollm2_chat_lora.yaml", "finetune_smollm2_full.yaml",
            "finetune_smollm2_qlora.yaml"} <= names
    assert "ddp.yaml" in {p.name for p in ACCELERATE_CONFIGS}


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_recipe_yaml_validates_and_starts_with_its_launch_line(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch --config_file accelerate_configs/"), first
    assert f"--config recipes/configs/{path.name}" in first
    script = first.split("recipes/", 1)[1].split()[0]
    assert (ROOT / "recipes" / script).is_file(), script
    if path.name.startswith("pretrain_"):
        cfg = load_config(PretrainConfig, path)
        check_seq_len(cfg.model, cfg.data.seq_len)
        config = hf_config(cfg.model, cfg.tokenizer.vocab_size, 0, 1)  # the architecture builds
        assert config.model_type == cfg.model.model_type
    else:
        cfg = load_config(FinetuneConfig, path)
        assert cfg.samples.prompts and cfg.train.max_steps > 0


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_with_accelerate(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    raw = yaml.safe_load(path.read_text())
    if raw["distributed_type"] == "DEEPSPEED":
        # Accelerate refuses a mixed_precision key beside a deepspeed_config_file.
        assert "mixed_precision" not in raw
        ds_file = ROOT / raw["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert ds[key] == "auto", f"{ds_file.name}: {key} must come from the recipe"
        assert ds["zero_optimization"]["stage"] in (1, 2, 3)
    else:
        assert raw["mixed_precision"] == "no", "precision belongs to the recipe config (train.mixed_precision)"


def test_a_shipped_yaml_with_an_unknown_key_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "recipes/configs/pretrain_tiny.yaml").read_text() + "\ntrian:\n  max_steps: 3\n")
    with pytest.raises(Exception, match="unknown key trian; did you mean train"):
        load_config(PretrainConfig, bad)


def test_a_chat_config_that_names_record_shapes_names_every_one_the_reader_takes():
    """A YAML's header that lists chat record shapes lists all of toolkit.data.records' (a shape left out reads as
    unsupported), or points at docs/data.md alone."""
    from toolkit.data.records import SAID

    short = {shape: said.split(" (")[0] for shape, said in SAID.items()}  # messages, ShareGPT, Alpaca, prompt/completion
    for path in sorted((ROOT / "recipes" / "configs").glob("finetune_*.yaml")):
        header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
        named = [name for name in short.values() if name.lower() in header.lower()]
        if len(named) > 1 or '"messages"' in header or '"instruction"' in header:
            assert all(name.lower() in header.lower() for name in short.values()), (path.name, named)
