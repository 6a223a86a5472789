"""Which settings train under which layouts (toolkit.config.combinations): every rule walked under every shipped layout and
a pipeline, against the cases below. A new rule fails test_every_rule_has_its_cases until its cases are written;
the launch raises exactly the first rule a run breaks (Trainer, before the model loads), and recipes/plan.py lists
the same verdicts (tests/recipes/test_plan.py)."""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest

from toolkit.config.combinations import GPU_ONLY, RULES, check, refusals
from toolkit.config.errors import UserError
from toolkit.config.load import load_config
from toolkit.parallel_layout import ParallelLayout
from toolkit.planner.facts import read_strategy
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

ROOT = Path(__file__).resolve().parents[3]
# every single-node shipped layout on 8 ranks, and a pipeline of 2 stages
LAYOUTS = {path.stem: read_strategy(path, 2048).layout for path in sorted((ROOT / "accelerate_configs").glob("*.yaml"))
           if not path.stem.startswith("multinode")}
LAYOUTS["pipeline"] = ParallelLayout("ddp", 8, pp=2)
LAYOUTS["pipeline_fsdp"] = ParallelLayout("fsdp", 8, pp=2)  # what the launch refuses to make
LAYOUTS["pipeline_tp"] = ParallelLayout("ddp", 8, tp=2, pp=2)
PIPELINES = {"pipeline", "pipeline_fsdp", "pipeline_tp"}

# rule -> (recipe, overrides that set it, precision, the layouts it refuses, what its line starts with)
CASES = {
    "train.pipeline_stages": ("pretrain", [], "no", {"pipeline_fsdp", "pipeline_tp"},
                              "train.pipeline_stages=2 "),
    "train.mixed_precision=fp16": ("pretrain", [], "fp16", PIPELINES,
                                   "train.pipeline_stages=2 with train.mixed_precision=fp16 is not supported"),
    "train.mixed_precision=fp8": ("pretrain", ["train.mixed_precision=fp8", "model.compile=layers"], "bf16",
                                  {"fsdp_cp", "fsdp_sp", "fsdp_tp", "zero3_sp"} | PIPELINES,
                                  "train.mixed_precision=fp8 trains under DDP, FSDP and ZeRO (data parallel), not with"),
    "checkpoint.async_save=true": ("pretrain", ["checkpoint.async_save=true"], "bf16",
                                   {name for name in LAYOUTS if name.startswith("zero")} | PIPELINES,
                                   "checkpoint.async_save=true writes DDP's and FSDP2's checkpoints in the background"),
    "adapter.method=qlora": ("finetune", ["adapter.method=qlora"], "bf16",
                             {"fsdp_cp", "fsdp_sp", "fsdp_tp", "zero3_sp"} | PIPELINES,
                             "adapter.method=qlora trains under DDP, FSDP2 and DeepSpeed ZeRO"),
    "adapter.method=lora": ("finetune", ["adapter.method=lora"], "bf16", {"fsdp_tp"} | PIPELINES,
                            "parallel trains a whole model, not a LoRA adapter, yet"),
    "model.new_tokens": ("finetune", ["model.new_tokens=[<x>]"], "bf16",
                         {name for name in LAYOUTS if name.startswith(("fsdp", "zero3", "pipeline_fsdp"))},
                         "model.new_tokens under a LoRA trains the new rows through peft's trainable tokens"),
    "train.objective (a preference objective)": (
        "finetune", ["train.objective=dpo", "data.format=preference", "adapter.method=full"], "bf16",
        {"fsdp_cp", "fsdp_sp", "fsdp_tp", "zero3_sp"} | PIPELINES,
        "train.objective=dpo trains under DDP, FSDP and ZeRO (data parallel), not with model parallel"),
    "model.loss=chunked": ("pretrain", ["model.loss=chunked"], "bf16", {"fsdp_tp"} | PIPELINES,
                           "model.loss=chunked is not supported with"),
    "forgetting.budget": ("finetune", ["forgetting.general=org/english", "forgetting.budget=0.05",
                                       "adapter.method=full"], "bf16",
                          {"fsdp_cp", "fsdp_tp", "fsdp_sp", "zero3_sp"} | PIPELINES,
                          "forgetting.budget holds a run under DDP, FSDP and ZeRO (data parallel), not with model"),
    "model.loss_positions=targets": ("finetune", ["model.loss_positions=targets"], "bf16",
                                     {"fsdp_cp", "fsdp_tp", "fsdp_sp", "zero3_sp"} | PIPELINES,
                                     "model.loss_positions=targets does not run with model parallel"),
    "model.compile=model": ("pretrain", ["model.compile=model"], "bf16", {"fsdp_tp", "fsdp_sp", "zero3_sp"} | PIPELINES,
                            "model.compile=model does not run with"),
    "model.gradient_checkpointing=selective": (
        "pretrain", ["model.gradient_checkpointing=selective"], "bf16", {"zero3", "zero3_offload", "zero3_sp"},
        "model.gradient_checkpointing=selective does not run under ZeRO-3"),
    "train.canary": ("pretrain", ["train.canary=stop"], "bf16", set(LAYOUTS) - {"ddp", "zero1", "zero2"},
                     "train.canary checks a rank's whole model: it does not run yet under "),
    "model.cast_weights=per_step": ("pretrain", ["model.cast_weights=per_step"], "bf16", set(LAYOUTS) - {"ddp"},
                                    "model.cast_weights=per_step cannot cast the weights once per step here: "),
}


def config(recipe: str, overrides: list[str]):
    return load_config(PretrainConfig if recipe == "pretrain" else FinetuneConfig, None, overrides)


def test_every_rule_has_its_cases():
    assert {rule.setting for rule in RULES} == set(CASES)
    for setting, (_, _, _, refused, _) in CASES.items():
        assert refused and refused != set(LAYOUTS), f"{setting}: a rule that refuses everywhere or nowhere"


@pytest.mark.parametrize("setting", CASES)
def test_each_rule_refuses_its_layouts_and_only_those(setting):
    recipe, overrides, precision, refused, start = CASES[setting]
    rule = next(r for r in RULES if r.setting == setting)
    cfg = config(recipe, overrides)
    for name, layout in LAYOUTS.items():
        line = rule.refused(cfg, layout, precision)
        assert (line is not None) == (name in refused), (setting, name, line)
        if line is not None:
            assert start in line and ("; use " in line or "; launch with " in line), line  # one line that says what to do
            assert any(r.line == line and r.instead == rule.instead for r in refusals(cfg, layout, precision))
    # without the setting the rule holds nowhere (the pretrain and fine-tune defaults: fp32, full loss, LoRA)
    plain = config(recipe, [])
    assert all(rule.refused(plain, layout, "no") is None for name, layout in LAYOUTS.items()
               if not (setting in ("adapter.method=lora", "train.pipeline_stages") and name in refused))


def test_the_launch_raises_the_first_rule_it_breaks_and_the_override_lifts_it():
    for recipe, asked in product(("pretrain", "finetune"), (
        {"model.loss": "chunked", "model.cast_weights": "per_step"},  # (the whole model compiled takes loss=full)
        {"model.compile": "model", "model.cast_weights": "per_step"},
    )):
        for layout in LAYOUTS.values():
            for precision in ("no", "bf16", "fp16"):
                cfg = config(recipe, [f"{k}={v}" for k, v in asked.items()])
                found = refusals(cfg, layout, precision)
                if not found:
                    check(cfg, layout, precision)
                    continue
                with pytest.raises(UserError) as info:
                    check(cfg, layout, precision)
                assert str(info.value) == found[0].line
                lifted = {**asked, **{k: v for r in found if r.instead for k, v in r.instead.items()}}
                left = refusals(config(recipe, [f"{k}={v}" for k, v in lifted.items()]), layout, precision)
                assert all(r.instead is None for r in left), left  # what an override lifts, it lifts


# each rule's reason under each kind of layout it refuses (moved here with the rules: qlora from test_adapter.py,
# model.compile=model from test_compilation.py, model.cast_weights=per_step from test_weight_cast.py)
REASONS = [
    (["adapter.method=qlora"], "bf16", ParallelLayout("fsdp", world=8, fsdp_version=1), "not under FSDP1 (its flat"),
    (["adapter.method=qlora"], "bf16", ParallelLayout("deepspeed", world=2, zero_stage=3, sp=2), "parallel (sp 2), which"),
    (["adapter.method=qlora"], "bf16", ParallelLayout("fsdp", world=4, tp=2), "not with model parallel (tp 2), which"),
    (["adapter.method=qlora"], "bf16", ParallelLayout("ddp", pp=2), "not with model parallel (pp 2), which would split"),
    (["adapter.method=lora"], "bf16", ParallelLayout("fsdp", 2, tp=2), "tensor parallel trains a whole model, not a LoRA"),
    (["adapter.method=lora"], "bf16", ParallelLayout("ddp", 2, pp=2), "pipeline parallel trains a whole model, not a LoRA"),
    (["model.compile=model"], "bf16", ParallelLayout("ddp", world=2, pp=2), "model.compile=model does not run with pipeline stages"),
    (["model.compile=model"], "bf16", ParallelLayout("deepspeed", world=2, zero_stage=3, sp=2),
     "model.compile=model does not run with tensor or sequence parallelism"),
    (["model.cast_weights=per_step"], "no", ParallelLayout("ddp", 2), "here: the run computes in fp32"),
    (["model.cast_weights=per_step"], "bf16", ParallelLayout("fsdp", 2), "here: FSDP2 casts the weights its own way"),
    (["model.cast_weights=per_step"], "bf16", ParallelLayout("deepspeed", 2, zero_stage=3), "here: DeepSpeed casts"),
    (["model.cast_weights=per_step"], "bf16", ParallelLayout("ddp", 2, cp=2), "pipelines compute under autocast"),
    (["model.loss=chunked"], "bf16", ParallelLayout("ddp", 2, pp=2), "with train.pipeline_stages > 1 yet (the last stage"),
    (["model.loss=chunked"], "bf16", ParallelLayout("fsdp", 2, tp=2), "with tensor parallel (parallelism_config_tp_size)"),
    (["model.loss=chunked", "train.objective=dpo", "data.format=preference"], "bf16", ParallelLayout("ddp", 2),
     "train.objective=dpo scores each answer from the full logits: model.loss=chunked is not supported with it yet"),
]


@pytest.mark.parametrize("overrides, precision, layout, said", REASONS, ids=lambda v: str(v)[:40])
def test_each_refusal_says_why(overrides, precision, layout, said):
    found = refusals(config("finetune", ["adapter.method=full", *overrides]), layout, precision)
    assert said in found[0].line, found
    assert not refusals(config("finetune", ["adapter.method=full"]), layout, precision)  # the setting is why


@pytest.mark.parametrize("key, value, line", [row for row in GPU_ONLY], ids=lambda v: str(v)[:30])
def test_what_trains_on_gpus_only_is_refused_on_a_cpu_alone(key, value, line):
    cfg = config("pretrain", [f"{key}={value}"])
    with pytest.raises(UserError) as info:
        check(cfg, LAYOUTS["ddp"], "no", device="cpu")
    assert str(info.value) == line and "; use " in line
    check(cfg, LAYOUTS["ddp"], "bf16", device="cuda")
    check(config("pretrain", []), LAYOUTS["ddp"], "no", device="cpu")
