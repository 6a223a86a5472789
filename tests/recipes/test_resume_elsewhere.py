"""Resuming under another strategy or world size (issue 12): a checkpoint written under DDP, FSDP2
or ZeRO-1/2/3 on W processes resumes under another of them on W' processes, with the same global
batch (12 sequences in micro-batches of 2: accumulation 6, 3 or 2 on 1, 2 or 3 processes), and the
run continues the uninterrupted run's loss curve within the parity tolerance (rel 1e-4, fp32, CPU),
with Adam's moments and step carried over parameter by parameter and the LR schedule going on.

The source checkpoints were saved by an earlier commit (tests/fixtures/checkpoints, made by
tests/support/saved_checkpoints.py): every case is also a checkpoint written before the code that resumes it.
Every run goes through tests/support/resume_probe.py, the recipe unchanged plus a dump of its
optimizer: a source run dumped what it held when it saved step 3 (the fixture's saved.pt), a resumed
run what it loaded. The source run's own steps 4-6 (the fixture's metrics.jsonl) are the reference.
Where Accelerate loads the files as they are (DDP at any world size, FSDP2 at any world size:
Strategy.resumes_natively) nothing is converted, and that is checked too.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from recipe_runner import FT_TINY, ROOT, TINY, run_recipe
from saved_checkpoints import GLOBAL_BATCH, PRETRAIN
from saved_checkpoints import copy as copy_fixture

from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

PROBE = ["tests/support/resume_probe.py"]
NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2",
         "zero3": "DeepSpeed ZeRO-3", "pipeline": "pipeline of 2 stages"}
CONVERTED = [  # (source, target) as (accelerate config, processes); "pipeline": 2 stages under ddp.yaml
    (("zero2", 2), ("fsdp", 1)),
    (("fsdp", 2), ("zero3", 3)),
    (("ddp", 3), ("zero1", 2)),
    (("zero3", 2), ("ddp", 1)),
    (("pipeline", 2), ("ddp", 1)),
]
NATIVE = [(("fsdp", 2), ("fsdp", 1)), (("ddp", 3), ("ddp", 1)), (("zero3", 2), ("zero3", 2))]


def described(strategy: str, processes: int) -> str:
    if strategy == "ddp" and processes == 1:
        return "one process"  # plain python: no launcher, no process group
    return f"{NAMES[strategy]} on {processes} process{'es' if processes > 1 else ''}"


def launch(recipe: str, strategy: str, processes: int, overrides: list[str], probe, cache, config: str,
           accelerate_config: str | None = None, check: bool = True, launcher: bool = False):
    """One process under ddp: plain python; anything else with accelerate launch's environment, FSDP2 on one
    process included. Forked from the probe server unless `launcher`, for a run whose output is read as a user
    sees it."""
    return run_recipe(
        recipe, overrides, nproc=processes, cache=cache, config=config,
        accelerate_config=accelerate_config or f"{strategy}.yaml", check=check,
        env={"RESUME_PROBE_OUT": str(probe), "RESUME_PROBE_STEP": "3"}, script=[*PROBE, recipe],
        launch=strategy != "ddp", launcher=launcher,
    )


def curve(out) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(run folder, saved.pt) of a source strategy's fixture, copied once per module on first use."""
    folder, done = tmp_path_factory.mktemp("sources"), {}

    def get(strategy: str, processes: int):
        if (strategy, processes) not in done:
            done[strategy, processes] = copy_fixture(f"{strategy}@{processes}", folder)
        return done[strategy, processes]

    return get


def continues(source_out, out, steps=(4, 5, 6)) -> None:
    """The resumed run's losses and learning rates are the uninterrupted run's from the checkpoint on."""
    ref, got = curve(source_out), curve(out)
    assert sorted(got) == list(steps), got
    for step in steps:
        assert got[step][0] == pytest.approx(ref[step][0], rel=1e-4), ("loss", step)
        assert got[step][1] == pytest.approx(ref[step][1], rel=1e-12), ("lr: the schedule did not continue", step)


def carried_over(saved_probe, loaded_probe, accumulation: int) -> None:
    """What the resumed run loaded is what the checkpoint held: every trained parameter's Adam moments
    and step, its fp32 master weight, the module's own copy equal to that master, the counters."""
    saved, loaded = torch.load(saved_probe, weights_only=True), torch.load(loaded_probe, weights_only=True)
    assert saved["step"] == loaded["step"] == 3
    assert sorted(loaded["moments"]) == sorted(saved["moments"]) and saved["moments"]
    for name, moments in saved["moments"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["moments"][name][key], moments[key]), (name, key)
        assert saved["steps"][name] == loaded["steps"][name] == 3.0, name
    for name, weight in saved["masters"].items():
        assert torch.equal(loaded["masters"][name], weight), name
    for name, copy in loaded["module"].items():  # DeepSpeed: the module's copy is set from the master too
        assert torch.equal(copy, loaded["masters"][name]), f"{name}: the module's weights are not the masters"
    # one rate for every group (DeepSpeed drops an empty no-decay group, which torch keeps: LoRA)
    assert set(loaded["lrs"]) == set(saved["lrs"]) and len(set(saved["lrs"])) == 1
    assert loaded["counters"]["accelerate_step"] == 3 * accumulation
    if "global_steps" in loaded["counters"]:
        assert loaded["counters"]["global_steps"] == 3


@pytest.mark.parametrize(("source", "target"), [*CONVERTED, *NATIVE], ids=[
    "zero2@2-to-fsdp@1", "fsdp@2-to-zero3@3", "ddp@3-to-zero1@2", "zero3@2-to-ddp@1", "pipeline@2-to-ddp@1",  # converted
    "fsdp@2-to-fsdp@1", "ddp@3-to-ddp@1", "zero3@2-to-zero3@2",  # loaded as they are
])
def test_a_checkpoint_resumes_under_another_strategy_or_world_size(source, target, sources, tmp_path, data_cache):
    source_out, saved_probe = sources(*source)
    out, probe = tmp_path / "resumed", tmp_path / "loaded.pt"
    checkpoint = source_out / "checkpoints" / "step-3"
    proc = launch("pretrain", *target, [*PRETRAIN, f"output_dir={out}", f"resume={checkpoint}"], probe, data_cache,
                  "pretrain_tiny.yaml")
    log = proc.stdout + proc.stderr
    said = [line for line in log.splitlines() if "was saved under" in line]
    if (source, target) in CONVERTED:
        assert said == [
            f"[pretrain] checkpoint step-3 was saved under {described(*source)}, this run is {described(*target)}: "
            "converted it into step-3.converted (weights and Adam state by parameter name) and loaded it"
        ], log[-4000:]
        assert (source_out / "checkpoints" / "step-3.converted" / "optimizer.json").is_file()
    else:
        assert said == [], "a checkpoint that loads as it is was converted"
    assert f"resumed from {checkpoint} at step 3" in log
    continues(source_out, out)
    if saved_probe.is_file():  # a pipeline's source run had no probe
        carried_over(saved_probe, probe, accumulation=GLOBAL_BATCH // (2 * target[1]))


def test_a_lora_checkpoint_moves_between_strategies(tiny_base, chatml_file, data_cache, tmp_path):
    """LoRA chat SFT on the tiny base under ZeRO-2 on 2 processes, resumed on one process: peft's names,
    a frozen base without Adam state, the adapter's moments carried over."""
    common = [*FT_TINY, f"model.path={tiny_base}", "data.format=chat", f"data.chat_template={chatml_file}", "data.append_stop=true",
              "adapter.dropout=0", "adapter.r=8", "train.max_steps=6", "checkpoint.every=3"]
    source, resumed = tmp_path / "zero2", tmp_path / "one"
    launch("finetune", "zero2", 2, [*common, f"output_dir={source}"], tmp_path / "saved.pt", data_cache,
           "finetune_smollm2_lora.yaml")
    proc = launch("finetune", "ddp", 1, [*common, f"output_dir={resumed}", f"resume={source / 'checkpoints' / 'step-3'}"],
                  tmp_path / "loaded.pt", data_cache, "finetune_smollm2_lora.yaml")
    assert ("checkpoint step-3 was saved under DeepSpeed ZeRO-2 on 2 processes, this run is one process: converted"
            in proc.stdout + proc.stderr)
    continues(source, resumed)
    carried_over(tmp_path / "saved.pt", tmp_path / "loaded.pt", accumulation=4)
    moments = torch.load(tmp_path / "loaded.pt", weights_only=True)["moments"]
    assert moments and all("lora_" in name for name in moments), sorted(moments)[:4]
    assert (resumed / "adapter" / "adapter_model.safetensors").is_file()


def test_a_checkpoint_of_a_deepspeed_json_with_its_own_optimizer_is_refused_in_one_line(tmp_path, data_cache):
    """DeepSpeed's own optimizer (a user JSON's `optimizer` block) keeps state the recipe's AdamW does
    not have: such a checkpoint resumes only as it was saved, and anywhere else says so."""
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = yaml.safe_load((ROOT / "accelerate_configs" / "zero2.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds.json")
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    source, resumed = tmp_path / "owned", tmp_path / "resumed"
    common = [*TINY, f"train.global_batch_size={GLOBAL_BATCH}", "train.max_steps=3", "eval.every=0"]
    launch("pretrain", "zero2", 1, [*common, f"output_dir={source}"], tmp_path / "saved.pt", data_cache,
           "pretrain_tiny.yaml", accelerate_config=str(tmp_path / "accelerate.yaml"))
    checkpoint = source / "checkpoints" / "step-3"
    proc = launch("pretrain", "ddp", 1, [*common, "train.max_steps=4", f"output_dir={resumed}", f"resume={checkpoint}"],
                  tmp_path / "loaded.pt", data_cache, "pretrain_tiny.yaml", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {checkpoint} (DeepSpeed ZeRO-2 on 1 process) was trained with the optimizer its DeepSpeed "
        "JSON defines, whose state is DeepSpeed's own: it cannot be converted for another strategy or world size; "
        "resume it under DeepSpeed ZeRO-2 on 1 process with the same DeepSpeed JSON"
    )
    assert "Traceback" not in proc.stderr
    assert not (source / "checkpoints" / "step-3.converted").exists()
    assert not (source / "checkpoints" / "step-3.converted.tmp").exists()
