"""The shipped fine-tunes of the bases users bring (Llama 3.1 8B, Qwen2.5 7B, Mistral 7B, Gemma 2 9B; LoRA, QLoRA and
full), offline: each names a base whose architecture recipes/configs/bases/ ships, validates, plans as its first
lines say on 1 and 8 x 80 GB GPUs (a planner change fails here until the lines are updated), and builds on the meta
device with its adapter on the modules it names."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
from recipe_runner import ROOT, recipe_module

from toolkit.config.load import load_config
from toolkit.models.base_model import SHIPPED_BASES, meta_base, shipped_base
from toolkit.planner.search import meta_model
from toolkit.training.recipe_config import FinetuneConfig

CONFIGS = ROOT / "recipes" / "configs"
PLAN = recipe_module("plan")


def named_base(path: Path) -> str | None:
    return load_config(FinetuneConfig, path, []).model.path


BASE_YAMLS = sorted(p for p in CONFIGS.glob("finetune_*.yaml") if named_base(p))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """As here and on CI: the Hub cannot be reached, so the architectures come from recipes/configs/bases/."""
    import toolkit.data.tokenizer

    monkeypatch.setattr(toolkit.data.tokenizer, "hub_unreachable", lambda timeout_s=3.0: "offline (the test says so)")


def test_every_base_a_shipped_yaml_names_ships_its_architecture_and_each_has_lora_qlora_and_full():
    named = {named_base(p) for p in BASE_YAMLS}
    assert named == {"meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                     "mistralai/Mistral-7B-Instruct-v0.3", "google/gemma-2-9b-it"}
    assert all(shipped_base(hub_id) is not None for hub_id in named)
    assert {str(p.parent.relative_to(SHIPPED_BASES)) for p in SHIPPED_BASES.rglob("config.json")} == named
    methods: dict[str, set[str]] = {}
    for p in BASE_YAMLS:
        methods.setdefault(named_base(p), set()).add(load_config(FinetuneConfig, p, []).adapter.method)
    assert all(m == {"lora", "qlora", "full"} for m in methods.values()), methods


def planned(config: str, gpus: int) -> tuple[dict, str]:
    """plan.py's pick for `config` on `gpus` x 80 GB, and its launch line."""
    # plan.py's own parser, so that an option added there is here too
    args = PLAN.parser().parse_args(["--config", config, "--gpus", str(gpus), "--gpu-memory", "80GB"])
    PLAN.check_args(args)
    with contextlib.redirect_stderr(io.StringIO()):
        _, best, recipe, notes, _ = PLAN.plan(args)
    return best, PLAN.launch_line(best, recipe, args), notes


def model_of(cfg, with_adapter: bool = False) -> torch.nn.Module:
    """The meta model plan.py planned (built once for both GPU counts); the base under the adapter, or with it."""
    model = meta_model("finetune", cfg)[0]
    return model if with_adapter or not hasattr(model, "get_base_model") else model.get_base_model()


def said(best: dict) -> str:
    return (f"{PLAN.label(best)}, gradient checkpointing {best['gradient_checkpointing']}, micro-batch "
            f"{best['micro_batch_size']}: {best['peak_bytes'] / 1e9:.1f} GB peak per GPU")


@pytest.mark.parametrize("path", BASE_YAMLS, ids=lambda p: p.stem.removeprefix("finetune_"))
def test_a_base_yaml_plans_as_its_first_lines_say_and_builds_with_its_adapter(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs are named relative to the repository, as in the launch lines
    text = path.read_text()
    cfg = load_config(FinetuneConfig, path, [])
    one, _, notes = planned(f"recipes/configs/{path.name}", 1)
    eight, launch, _ = planned(f"recipes/configs/{path.name}", 8)
    assert f"architecture is read from recipes/configs/bases/{cfg.model.path}/config.json" in "\n".join(notes)
    expected = [f"#   1 GPU:  {said(one)} (as set below)", f"#   8 GPUs: {said(eight)}:", f"#     {launch}"]
    assert re.findall(r"(?m)^#   (?:1 GPU|8 GPUs):.*$|^#     bash recipes/launch.sh.*$", text) == expected, (
        "the plan changed; put these lines in the YAML:\n" + "\n".join(expected))
    assert text.startswith(f"# accelerate launch --config_file accelerate_configs/{one['strategy']}.yaml "
                           f"--num_processes 1 recipes/finetune.py --config recipes/configs/{path.name}\n")
    assert (cfg.train.micro_batch_size, cfg.model.gradient_checkpointing) == (
        one["micro_batch_size"], one["gradient_checkpointing"])

    if cfg.adapter.method == "full":  # once a base: what the recipe sizes before it loads, the shipped architecture
        base, _ = meta_base(cfg.model)
        assert base.device == torch.device("meta") and type(base).__name__ == type(model_of(cfg)).__name__
    model = model_of(cfg, with_adapter=True)  # as plan.py built it: with the recipe's adapter (apply_adapter)
    if not cfg.adapter.is_lora:
        assert all(p.requires_grad for p in model.parameters())
        return
    layers = model.config.num_hidden_layers
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    for target in cfg.adapter.target_modules:  # every layer's named projection, and nothing else
        assert sum(name.endswith(f".{target}") for name in adapted) == layers, target
    assert len(adapted) == layers * len(cfg.adapter.target_modules)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
