"""The numerics canary: each fast path checked against its reference while a run goes on. Planted bugs, one per
lever, are each caught at their first check; a run with the canary on trains the numbers it trains without it."""

from __future__ import annotations

import contextlib
import json
import re
import typing

import probe_ranks
import pytest
import torch
import transformers.masking_utils as masking
from accelerate.state import AcceleratorState
from one_process_trainer import packed_blocks, start_trainer

from toolkit.config.load import load_config
from toolkit.data.packing import collate
from toolkit.models import float8, weight_cast
from toolkit.models import loss as loss_module
from toolkit.models.compute import ATTENTION
from toolkit.run.folder import RunDir
from toolkit.training import canary
from toolkit.training.metrics import read_metrics
from toolkit.training.recipe_config import PretrainConfig

CHUNKED = ["model.loss=chunked", "model.loss_chunk_tokens=16"]
PER_STEP = ["train.mixed_precision=bf16", "model.cast_weights=per_step"]


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory):
    return packed_blocks(tiny_texts, tiny_tokenizer, tmp_path_factory.mktemp("packed"), held_out=False)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def fast_values() -> dict[str, tuple[str, ...]]:
    """Every value of every setting that picks a path the model computes by, from the config's own types."""
    hints = typing.get_type_hints(type(load_config(PretrainConfig, None, []).model))
    values = {f"model.{key}": typing.get_args(hints[key]) for key in ("compile", "loss", "loss_positions",
                                                                       "cast_weights")}
    values["model.attn_implementation"] = tuple(sorted(ATTENTION))
    train = typing.get_type_hints(type(load_config(PretrainConfig, None, []).train))
    values["train.mixed_precision"] = typing.get_args(train["mixed_precision"])
    values["train.step_sync"] = typing.get_args(train["step_sync"])
    return values


def test_every_path_a_setting_picks_is_a_lever_or_a_reference(monkeypatch):
    """A new compile mode, attention, loss, cast or precision fails here until it is a lever (checked against its
    reference) or a reference itself, with why."""
    monkeypatch.setenv(float8.EMULATE, "1")  # fp8's config checks ask for a compile where it runs for real
    for key, values in fast_values().items():
        for value in values:
            cfg = load_config(PretrainConfig, None, [f"{key}={value}"])
            levers = [lever.setting for lever in canary.levers_in_use(cfg, canary.Taken())]
            assert levers or value in canary.REFERENCES[key], f"{key}={value}: neither a lever nor a reference"
            assert not (levers and value in canary.REFERENCES[key]), f"{key}={value}: both a lever and a reference"
    default = load_config(PretrainConfig, None, [])  # auto casts and skips where the launched run can
    assert [lv.setting for lv in canary.levers_in_use(default, canary.Taken(True, True))] == \
        ["model.cast_weights=per_step", "train.step_sync=none"]


def canary_run(tmp_path, blocks, tiny_tokenizer, tiny_model, *overrides):
    trainer = start_trainer(tmp_path, blocks, tiny_tokenizer, tiny_model, "train.max_steps=3",
                            "checkpoint.every=1", *overrides)
    return trainer


def drops_the_last_chunk(monkeypatch):
    original = loss_module.linear_cross_entropy_sum

    def planted(hidden, weight, bias, targets, chunk_tokens, softcap=None):
        targets = targets.clone()
        flat = targets.view(-1)
        flat[(flat.numel() - 1) // chunk_tokens * chunk_tokens:] = -100
        return original(hidden, weight, bias, targets, chunk_tokens, softcap)

    monkeypatch.setattr(loss_module, "linear_cross_entropy_sum", planted)


def scales_one_tokens_gradient(monkeypatch):
    original = loss_module.linear_cross_entropy_sum

    def planted(hidden, weight, bias, targets, chunk_tokens, softcap=None):
        token = torch.zeros_like(hidden[..., :1])
        token.view(-1)[5] = 1.0
        hidden = hidden + token * (hidden - hidden.detach())  # the same value; token 5's gradient doubled
        return original(hidden, weight, bias, targets, chunk_tokens, softcap)

    monkeypatch.setattr(loss_module, "linear_cross_entropy_sum", planted)


def stale_copy_once(monkeypatch):
    """Step 3 computes with the bf16 copies made for step 2, not from the weights step 2 trained (the gradients still
    reach the fp32 weights, as the real copy's do)."""
    original, made = weight_cast.WeightCast.step, []

    @contextlib.contextmanager
    def planted(self):
        with original(self):
            if len(made) == 2:
                for module in self.linears:
                    fresh = module.step_weight
                    module.step_weight = made[1][id(module)] + (fresh - fresh.detach())
            made.append({id(m): m.step_weight.detach() for m in self.linears})
            yield

    monkeypatch.setattr(weight_cast.WeightCast, "step", planted)


def drops_a_target_row(monkeypatch):
    original = loss_module.target_rows

    def planted(targets):
        return original(targets)[1:]  # the first target never reaches the head

    monkeypatch.setattr(loss_module, "target_rows", planted)


PLANTED = {  # (the bug, the run's settings, the lever named, the step whose check catches it)
    "a head on the targets that drops one": (drops_a_target_row, ["model.loss_positions=targets"],
                                             "model.loss_positions=targets", 1),
    "a chunked loss that drops the last chunk": (drops_the_last_chunk, CHUNKED, "model.loss=chunked", 1),
    "a loss that scales one token's gradient": (scales_one_tokens_gradient, CHUNKED, "model.loss=chunked", 1),
    # two levers in use: the one whose fast path alone drifts is named
    "a dropped last chunk beside the per-step copy": (drops_the_last_chunk, CHUNKED + PER_STEP, "model.loss=chunked",
                                                      1),
    "a bf16 weight copy stale for one step": (stale_copy_once, PER_STEP, "model.cast_weights=per_step", 3),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_caught_at_its_first_check(tmp_path, blocks, tiny_tokenizer, tiny_model, monkeypatch, bug):
    plant, settings, lever, step = PLANTED[bug]
    plant(monkeypatch)
    trainer = canary_run(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, *settings, "train.canary=stop",
                         "train.canary_every=1")
    with pytest.raises(canary.Drifted, match=rf"numerics canary at step {step}: {lever} computed a loss of") as e:
        trainer.fit()
    assert trainer.state.step == step - 1  # before the step trained
    assert [c.name for c in RunDir(tmp_path / "run").complete_checkpoints()] == [f"step-{s}" for s in range(1, step)]
    rows = [r for r in read_metrics(RunDir(tmp_path / "run").metrics) if r["kind"] == "canary"]
    assert rows[-1]["drifted"] == lever
    assert "the step was not applied and the checkpoints saved so far are intact" in str(e.value)


def test_the_canary_changes_no_number_training_computes(tmp_path, blocks, tiny_tokenizer, tiny_model, capsys):
    """With two levers in use and a check before every step, the losses, gradient norms and weights are the run's
    without the canary, bit for bit; the healthy levers stay within the tolerance, logged at every check."""
    runs = {}
    for name, on in (("off", []), ("on", ["train.canary=stop", "train.canary_every=1"])):
        AcceleratorState._reset_state(True)
        trainer = canary_run(tmp_path / name, blocks, tiny_tokenizer, tiny_model, *CHUNKED, *PER_STEP, *on)
        trainer.fit()
        rows = read_metrics(trainer.run.metrics)
        weights = {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
        runs[name] = ([(r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"], weights,
                      [r for r in rows if r["kind"] == "canary"])
        trainer.close()
    assert runs["on"][0] == runs["off"][0]
    assert all(torch.equal(runs["on"][1][k], w) for k, w in runs["off"][1].items())
    checks = runs["on"][2]
    assert [r["step"] for r in checks] == [1, 2, 3] and runs["off"][2] == []
    assert all(r["drifted"] is None and max(r["loss_drift"], r["grad_drift"]) <= r["tolerance"] for r in checks)
    assert checks[0]["levers"] == ["model.loss=chunked", "model.cast_weights=per_step"]


def test_a_run_without_a_fast_path_is_told_the_canary_checks_nothing(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                                     capsys):
    trainer = canary_run(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "train.canary=warn")
    trainer.fit()
    assert "train.canary=warn: this run takes no fast path to check" in capsys.readouterr().out
    assert not [r for r in read_metrics(trainer.run.metrics) if r["kind"] == "canary"]


def test_a_document_mask_that_lets_a_token_see_across_is_caught(tiny_tokenizer, tiny_model, blocks, monkeypatch):
    """flex_attention's document mask (made by transformers from the position ids) against sdpa's block-causal mask
    (made by the toolkit): one token that sees the document before it. CPU has no flex backward: the loss alone."""
    original = masking.find_packed_sequence_indices

    def planted(position_ids):
        documents = original(position_ids).clone()
        start = int((position_ids[0] == 0).nonzero()[1])  # the second document's first token
        documents[0, start] -= 1  # ...belongs to the first
        return documents

    cfg = load_config(PretrainConfig, None, ["model.attn_implementation=flex_attention", "train.canary=stop"])
    model = tiny_model("llama", seed=0, tokenizer=tiny_tokenizer)
    model.set_attn_implementation("flex_attention")
    train = blocks[0]
    several = [i for i in range(len(train)) if train[i]["position_ids"].count(0) > 1]  # blocks of two documents
    batch = collate(train[several[:1] + [0]], "flex_attention")
    said = []
    check = canary.Canary(cfg, model, None, "no", said.append, said.append, backward=False)
    # flex_attention's kernel uncompiled: the mask is transformers' either way, and its CPU compile takes ~30 s
    with torch.compiler.set_stance("force_eager"):
        check.check(0, batch, 0)  # healthy: within fp32's tolerance
        assert said[-1]["drifted"] is None and said[-1]["loss_drift"] <= canary.TOLERANCE["no"]
        monkeypatch.setattr(masking, "find_packed_sequence_indices", planted)
        with pytest.raises(canary.Drifted, match="model.attn_implementation=flex_attention computed a loss of .* "
                                                 "against its reference's "
                                                 r"\(model.attn_implementation=sdpa\)"):
            check.check(1, batch, 0)
    assert model.config._attn_implementation == "flex_attention"  # switched back


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_every_rank_checks_its_own_row_and_stops_together(strategy, tmp_path):
    """On 2 ranks (DDP, ZeRO-2): the check writes no gradient and leaves the strategy's next step to train; a drift
    on one rank stops both at the same check, in the same words."""
    out = tmp_path / "probe"
    proc = probe_ranks.run(probe_ranks.SUPPORT / "canary_probe.py", [out], nproc=2,
                           accelerate_config=f"{strategy}.yaml", timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [json.loads((tmp_path / f"probe.{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["untouched"] and r["stepped"] for r in ranks)
    assert all(r["first"]["drifted"] is None for r in ranks)
    assert ranks[0]["first"]["loss"] != ranks[1]["first"]["loss"]  # each rank its own row
    assert ranks[0]["raised"] == ranks[1]["raised"] and "numerics canary at step 1: model.loss=chunked" in ranks[0]["raised"]


@pytest.mark.parametrize("bug", ["steps through a skip", "never steps"])
def test_a_skip_on_the_device_that_disagrees_with_the_host_is_caught(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                                     monkeypatch, bug):
    """train.step_sync=none (fused AdamW skips on its found_inf): an optimizer that drops the flag steps through step
    2's NaN gradients, one whose flag is stuck never steps; the host's reading of the same flags says otherwise."""
    if bug == "steps through a skip":
        monkeypatch.setenv("LLM_TOOLKIT_NONFINITE", "grad@2")
    fused_step = torch.optim.AdamW.step

    def planted(self, closure=None):
        self.found_inf = None if bug == "steps through a skip" else torch.ones(())
        return fused_step(self, closure)

    monkeypatch.setattr(torch.optim.AdamW, "step", planted)
    trainer = canary_run(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "optim.fused=true",
                         "train.step_sync=none", "optim.warmup_steps=0", "train.canary=stop", "train.canary_every=1")
    assert [lv.setting for lv in trainer.canary.levers] == ["train.step_sync=none"]
    step, said = (2, "changed the weights where the host's reading of the same flags skips the step (grad)") if \
        bug == "steps through a skip" else (1, "left the weights where the host's reading of the same flags trains")
    with pytest.raises(canary.Drifted, match=rf"numerics canary at step {step}: train.step_sync=none's update on the "
                                             rf"device {re.escape(said)}"):
        trainer.fit()


def test_a_skip_on_the_device_that_agrees_with_the_host_passes(tmp_path, blocks, tiny_tokenizer, tiny_model,
                                                               monkeypatch):
    monkeypatch.setenv("LLM_TOOLKIT_NONFINITE", "grad@2")
    trainer = canary_run(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "optim.fused=true",
                         "train.step_sync=none", "optim.warmup_steps=0", "train.canary=stop", "train.canary_every=1")
    trainer.fit()
    rows = [r for r in read_metrics(trainer.run.metrics) if r["kind"] == "canary"]
    assert [(r["step"], r["verdict"], r["moved"], r["drifted"]) for r in rows] == [
        (1, None, True, None), (2, "grad", False, None), (3, None, True, None)]


def test_the_first_update_that_trains_is_checked_when_the_first_moves_nothing(tmp_path, blocks, tiny_tokenizer,
                                                                             tiny_model):
    """Warmup's first step trains at rate 0 and moves no weight: it tells nothing, and the check goes to the next step
    (it was dropped until step 101: a shorter run checked nothing)."""
    trainer = canary_run(tmp_path / "run", blocks, tiny_tokenizer, tiny_model, "optim.fused=true",
                         "train.step_sync=none", "optim.warmup_steps=2", "train.canary=stop")
    trainer.fit()
    rows = [r for r in read_metrics(trainer.run.metrics) if r["kind"] == "canary"]
    assert [(r["step"], r["moved"]) for r in rows] == [(2, True)]
    assert {"grad_norm", "reference_grad_norm", "seconds"} <= set(rows[0])  # every canary row has the same columns
