"""A budgeted fine-tune as a user runs it (forgetting.*): the tiny base fine-tuned on Python source while the CPython
docs it was pretrained on are the general text it must not forget. Replay raises the docs' share when their loss
nears the budget, the best step within it is kept through rotation and becomes adapter/ and final/, the end table
says so, and a resume under another strategy continues the controller: the same shares, the same blocks."""

from __future__ import annotations

import json
import re

import pytest
import torch
from recipe_runner import FT_TINY, run_recipe
from safetensors.torch import load_file
from test_mixture_training import code_corpus

from toolkit.training.metrics import read_metrics

pytestmark = pytest.mark.distributed

CONFIG = "finetune_smollm2_lora.yaml"


def budgeted(tiny_base, code, out) -> list[str]:
    # a budget of 0.2 % that the docs' loss crosses by step 6 on this base: every lever acts within 12 steps
    return [*FT_TINY, f"model.path={tiny_base}", "train.max_steps=12", "eval.every=2", "checkpoint.keep_last=1",
            f"data.sources=[{{name: code, path: {code}, weight: 0.8}}, {{name: docs, weight: 0.2}}]",
            "forgetting.general=docs", "forgetting.budget=0.002", "forgetting.patience=0", f"output_dir={out}"]


def best_eval(out, best: dict) -> float:
    return next(r["eval_loss"] for r in rows(out, "eval") if r["step"] == best["step"])


def rows(out, kind: str) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == kind]


@pytest.fixture(scope="module")
def budgeted_run(tiny_base, data_cache, tmp_path_factory):
    work = tmp_path_factory.mktemp("forgetting")
    code, out = code_corpus(work / "code"), work / "run"
    proc = run_recipe("finetune", [*budgeted(tiny_base, code, out), "logging.trackers=[tensorboard]"], nproc=1,
                      cache=data_cache, config=CONFIG)
    return code, out, proc.stdout + proc.stderr


def test_replay_selection_and_the_end_table_hold_the_budget(budgeted_run):
    _, out, said = budgeted_run
    judged = rows(out, "budget")
    assert [r["step"] for r in judged] == [0, 2, 4, 6, 8, 10, 12]
    base, limit = judged[0]["general_base"], judged[0]["general_limit"]
    assert limit == pytest.approx(base * 1.002) and all(r["general_limit"] == limit for r in judged)
    # the share moves up after an evaluation over the budget (or near it), and down with room, by next_share
    shares = [r["share"] for r in judged]
    assert shares[0] == 0.2 and len(set(shares)) >= 3
    over = [r for r in judged if not r["within"]]
    assert over, "the budget is crossed at least once: the run is held, not only reported"
    for before, after in zip(judged[:-2], judged[1:-1], strict=True):  # the last ("after") decides nothing
        change = after["general_change"] / 0.002
        assert (after["share"] > before["share"]) == (change > 0.5 and before["share"] < 0.9), after
    # the steps after a decision draw the docs by the new share (blocks of 128 tokens, 8 a step)
    train = {r["step"]: r for r in rows(out, "train")}  # tokens/<name>: trained so far
    for r in judged[1:-1]:
        step, before = train[r["step"] + 1], train[r["step"]]
        docs = (step["tokens/docs"] - before["tokens/docs"]) / (step["tokens"] - before["tokens"])
        assert abs(docs - r["share"]) <= 1 / 8, (r, step)
    # the kept step: the best domain loss among the evaluations within the budget
    within = [r for r in judged[1:] if r["within"]]
    best = min(within, key=lambda r: r["domain_loss"])
    assert judged[-1]["best_step"] == best["step"] != 12
    kept = out / "checkpoints" / f"step-{best['step']}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted({kept.name, "step-12"})  # keep_last=1
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    saved = {k.replace(".default", ""): v for k, v in load_file(kept / "model.safetensors").items() if "lora_" in k}
    assert adapter.keys() == saved.keys() and all(torch.equal(adapter[k], saved[k]) for k in adapter)
    last = {k.replace(".default", ""): v for k, v in load_file(out / "checkpoints" / "step-12" / "model.safetensors").items()
            if "lora_" in k}
    assert not all(torch.equal(adapter[k], last[k]) for k in adapter)
    assert f"forgetting.select: the result is step {best['step']}'s" in said
    summary = json.loads((out / "final" / "training_summary.json").read_text())  # what the cards say: the kept step
    assert (summary["step"], summary["trained_steps"]) == (best["step"], 12)
    assert summary["tokens"] == train[best["step"]]["tokens"] and summary["eval_loss"] == pytest.approx(best_eval(out, best))
    assert f"the weights of its step {best['step']} of 12" in (out / "adapter" / "README.md").read_text()
    assert re.search(rf"kept +step {best['step']} of 12\n", said)
    assert re.search(r"general change \(budget \+0\.2%\) +[+-]\d+\.\d\d%( over)?\n", said)
    assert re.search(rf"domain loss +{judged[0]['domain_loss']:.4f} +{best['domain_loss']:.4f}\n", said)
    assert re.search(rf"loss: docs +\d\.\d{{4}} +{best['general_loss']:.4f}\n", said)  # the kept step's, not the last
    # the evaluations every 2 steps: each with its bar, their time summed in the summary's last line
    assert len(re.findall(r"(?:^|\r)evaluations during training: +0%\|", said, re.M)) == 5
    assert re.search(r"\ntime        : \d+:\d\d \(.*, training \d+:\d\d, evaluations during training \d+:\d\d, ", said)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the trackers: the same numbers as metrics.jsonl
    events = EventAccumulator(str(next((out / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.value for e in events.Scalars("general_change")] == pytest.approx([r["general_change"] for r in judged])
    assert [e.value for e in events.Scalars("share")] == pytest.approx(shares)


def test_a_resume_under_another_strategy_continues_the_controller(budgeted_run, tiny_base, data_cache, tmp_path):
    """The kept checkpoint resumed under ZeRO-3 on 2 processes, into a folder of its own: replay's decisions so far
    draw the same blocks of each source, the evaluations judge alike, and the kept step is found beside the checkpoint
    it resumed from."""
    code, out, _ = budgeted_run
    kept = rows(out, "budget")[-1]["best_step"]
    resumed = tmp_path / "resumed"
    proc = run_recipe("finetune", [*budgeted(tiny_base, code, resumed), f"resume={out / 'checkpoints' / f'step-{kept}'}"],
                      nproc=2, cache=data_cache, config=CONFIG, accelerate_config="zero3.yaml")
    keys = ("tokens", "tokens/code", "tokens/docs")
    one = {r["step"]: r for r in rows(out, "train") if r["step"] > kept}
    two = {r["step"]: r for r in rows(resumed, "train")}
    assert sorted(two) == sorted(one) == list(range(kept + 1, 13))
    for step, r in two.items():  # the same blocks of each source; the numbers of another strategy's sums
        assert [r[k] for k in keys] == [one[step][k] for k in keys], step
        assert r["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step
    for a, b in zip([r for r in rows(out, "budget") if r["step"] > kept], rows(resumed, "budget"), strict=True):
        assert (a["step"], a["share"], a["within"], a["best_step"]) == (b["step"], b["share"], b["within"], b["best_step"])
        assert b["general_loss"] == pytest.approx(a["general_loss"], rel=1e-4)
    assert f"forgetting.select: the result is step {kept}'s ({out / 'checkpoints' / f'step-{kept}'})" in proc.stdout
    ref = load_file(out / "adapter" / "adapter_model.safetensors")
    got = load_file(resumed / "adapter" / "adapter_model.safetensors")
    assert all(torch.allclose(got[k], ref[k], rtol=0, atol=1e-6) for k in ref)  # the same weights, gathered by ZeRO-3
