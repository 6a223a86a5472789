"""A mixture as a user runs it: recipes/pretrain.py with data.sources (the CPython docs, and the standard library's
own source code as a second corpus that reads differently) and two stages, on 2 processes under ZeRO-3: each
source said in the first lines, its held-out loss and tokens in metrics.jsonl and tensorboard, and a resume in the
middle of the first stage, across the second, that trains the uninterrupted run's steps bit for bit."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from recipe_runner import TINY, run_recipe

pytestmark = pytest.mark.distributed


def code_corpus(folder: Path) -> Path:
    """Python source of a few standard-library modules: paragraphs of code, not prose."""
    import argparse
    import configparser
    import json.decoder
    import textwrap

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "code.txt").write_text("\n\n".join(inspect.getsource(m) for m in (argparse, configparser, json.decoder,
                                                                               textwrap)))
    return folder / "code.txt"


def mixture(code: Path) -> list[str]:
    return [*TINY, "train.max_steps=6", "eval.every=2", f"data.sources=[{{name: docs, weight: 0.6}}, "
            f"{{name: code, path: {code}, weight: 0.4}}]",
            "data.stages=[{start_step: 3, weights: {code: 0.9}}, {start_step: 5, weights: {docs: 0.9, code: 0.1}}]"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("data", ["prepared", "streamed"])
def test_a_mixture_logs_each_source_and_resumes_across_its_stage_bit_for_bit(tmp_path, data_cache, data):
    streamed = ["data.streaming=true", "data.stream_val_documents=4"] if data == "streamed" else []
    overrides = [*mixture(code_corpus(tmp_path / "code")), *streamed]
    out = tmp_path / "run"
    trackers = ["logging.trackers=[tensorboard]"] if data == "prepared" else []
    proc = run_recipe("pretrain", [*overrides, f"output_dir={out}", *trackers], nproc=2, cache=data_cache,
                      accelerate_config="zero3.yaml")
    said = proc.stdout + proc.stderr
    if data == "prepared":
        for name, weight in (("docs", "0.600"), ("code", "0.400")):  # its documents, blocks, tokens and passes
            assert re.search(rf"data: {name}: weight {weight}, \d+ train / \d+ held-out documents -> \d+ blocks of 64 "
                             r"tokens \([\d,]+ tokens\); \d+\.\d\d passes over them in train.max_steps=6", said), name
    else:
        assert "each pack their part of each source's stream by weight (docs 0.600, code 0.400)" in said
    assert "data: from step 3: weights docs 0.400, code 0.600" in said
    assert "data: from step 5: weights docs 0.900, code 0.100" in said
    trained = [r for r in rows(out) if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    for before, row in zip([{"tokens/docs": 0, "tokens/code": 0}, *trained], trained, strict=False):
        assert row["tokens/docs"] + row["tokens/code"] == row["tokens"]  # every token comes from one source
        assert row["tokens/docs"] > before["tokens/docs"] and row["tokens/code"] > before["tokens/code"]
    evals = [r for r in rows(out) if "eval_loss/docs" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for r in evals:  # two corpora that read differently, and the whole their mean weighted by held-out tokens
        low, high = sorted([r["eval_loss/docs"], r["eval_loss/code"]])
        assert high - low > 1e-3 and low < r["eval_loss"] < high
        weighted = sum(r[f"eval_loss/{s}"] * r[f"eval_tokens/{s}"] for s in ("docs", "code"))
        assert r["eval_loss"] == pytest.approx(weighted / (r["eval_tokens/docs"] + r["eval_tokens/code"]), rel=1e-12)
    assert "held-out loss" in said and "(docs " in said
    if data == "prepared":  # tensorboard has what metrics.jsonl has
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(next((out / "tensorboard").rglob("events.out.tfevents.*")).parent))
        events.Reload()
        assert {"eval_loss/docs", "eval_loss/code", "tokens/docs", "tokens/code"} <= set(events.Tags()["scalars"])
        assert [e.value for e in events.Scalars("eval_loss/code")] == pytest.approx([r["eval_loss/code"] for r in evals])

    # resumed from step 3, in the first stage, across the second: steps 4-6 as the run that was not interrupted
    resumed = tmp_path / "resumed"
    run_recipe("pretrain", [*overrides, f"output_dir={resumed}", f"resume={out / 'checkpoints' / 'step-3'}"], nproc=2,
               cache=data_cache, accelerate_config="zero3.yaml")
    keys = ("loss", "grad_norm", "tokens", "tokens/docs", "tokens/code")
    after = {r["step"]: [r[k] for k in keys] for r in rows(resumed) if "loss" in r}
    assert after == {r["step"]: [r[k] for k in keys] for r in trained if r["step"] > 3}


def test_a_fine_tune_mixes_chat_sets_by_weight(tiny_base, chatml_file, tmp_path, data_cache):
    """SFT on three chat sets as users keep them (the Python Q&A as OpenAI messages in a parquet of a local copy of a
    hub dataset, arithmetic as a ShareGPT parquet, and differences as Alpaca jsonl): each source's turns packed on
    its own, its held-out loss measured before and after, its tokens counted, and the shape of each source's records
    said."""
    import datasets
    from recipe_runner import FT_TINY

    from toolkit.data.python_chats import PYTHON_CHATS

    hub = tmp_path / "org--python-chats"  # as `huggingface-cli download --repo-type dataset` lays it out
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: psf-2.0\n---\n# Python Q&A\n")
    chats = [dict(r) for r in PYTHON_CHATS if "messages" in r]
    datasets.Dataset.from_list(chats).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    sums = tmp_path / "sums.parquet"
    datasets.Dataset.from_list([{"conversations": [
        {"from": "human", "value": f"What is {a} + {b}?"}, {"from": "gpt", "value": f"{a} + {b} = {a + b}."}]}
        for a in range(30) for b in range(0, 30, 3)]).to_parquet(str(sums))
    diffs = tmp_path / "diffs.jsonl"
    diffs.write_text("\n".join(json.dumps({"system": "You subtract.", "instruction": f"What is {a} - {b}?",
                                           "output": f"{a} - {b} = {a - b}."}) for a in range(20) for b in range(5)))
    out = tmp_path / "sft"
    proc = run_recipe("finetune", [*FT_TINY, f"model.path={tiny_base}", "data.format=chat",
                                   f"data.chat_template={chatml_file}", "data.append_stop=true", "train.max_steps=3", f"output_dir={out}",
                                   f"data.sources=[{{name: python, path: {hub}, weight: 0.5}}, {{name: sums, path: {sums}, "
                                   f"weight: 0.25}}, {{name: diffs, path: {diffs}, weight: 0.25}}]"],
                     nproc=1, cache=data_cache, config="finetune_smollm2_lora.yaml")
    said = proc.stdout + proc.stderr
    assert "data: python: weight 0.500, " in said and "data: sums: weight 0.250, " in said
    assert "data: sums: 300 records: 300 ShareGPT (conversations of from/value)" in said
    assert "data: diffs: 100 records: 100 Alpaca (instruction/input/output)" in said
    assert f"data: python: {len(chats)} records: {len(chats)} messages (role/content)" in said
    assert re.search(r"loss: python +\d+\.\d{4} +\d+\.\d{4}\nloss: sums ", said)  # the end's before/after table
    before, after = ([r for r in rows(out) if r.get("phase") == phase] for phase in ("before", "after"))
    for r in (*before, *after):
        assert {"eval_loss/python", "eval_loss/sums", "eval_loss/diffs"} <= set(r)
        assert r["eval_loss/python"] != r["eval_loss/sums"]
    assert after[0]["eval_loss/sums"] < before[0]["eval_loss/sums"]  # the arithmetic is being learnt
    last = [r for r in rows(out) if "loss" in r][-1]
    assert min(last["tokens/python"], last["tokens/sums"], last["tokens/diffs"]) > 0
    assert last["tokens/python"] + last["tokens/sums"] + last["tokens/diffs"] == last["tokens"]
