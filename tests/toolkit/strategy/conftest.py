"""Fixtures shared by the strategy tests: what each rank held, from the strategy matrix's runs at 2 processes
and from the sharding probe's launches otherwise, launched once per (strategy, process count) for the whole
session (test_sharding.py and test_memory.py read the same runs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import probe_ranks
import pytest

PROBE = Path(__file__).with_name("sharding_probe.py")


@pytest.fixture(scope="session")
def sharding_probe(tmp_path_factory) -> Callable[[str, int], dict]:
    """probe(strategy, nproc, model_type="llama") -> {"strategy", "world_size", "n_params", "ranks": [held_bytes of
    each rank]}; model_type "qwen3_moe" probes a mixture of experts of the same sizes."""
    folder = tmp_path_factory.mktemp("sharding")
    results: dict[tuple[str, int, str], dict] = {}

    def probe(strategy: str, nproc: int, model_type: str = "llama") -> dict:
        if (strategy, nproc, model_type) not in results:
            out = folder / f"{strategy}-{nproc}-{model_type}.json"
            proc = probe_ranks.run(PROBE, [out, model_type], nproc, accelerate_config=f"{strategy}.yaml", timeout=600)
            if proc.returncode != 0 or not out.is_file():
                pytest.fail(f"{PROBE.name} under {strategy} on {nproc} ranks exited {proc.returncode}\n{proc.stdout[-8000:]}")
            results[strategy, nproc, model_type] = json.loads(out.read_text())
        return results[strategy, nproc, model_type]

    return probe


@pytest.fixture(scope="session")
def matrix_sharding(strategy_runs) -> Callable[[str], dict]:
    """matrix_sharding(strategy) -> the sharding probe's result at 2 ranks, read from the strategy matrix's run
    (conftest.strategy_runs: the recipe, 2 micro-batches per step): the bytes each rank held after its first
    step, which the trainer logs (toolkit.strategy.sharding.held_bytes), and under "model" the model it
    trained, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.training.metrics import read_metrics

    def get(strategy: str) -> dict:
        out, _ = strategy_runs(strategy)
        held = next(r["held_bytes"] for r in read_metrics(out / "metrics.jsonl") if "held_bytes" in r)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out / "final"))
        return {"strategy": strategy, "world_size": len(held), "n_params": sum(p.numel() for p in model.parameters()),
                "ranks": held, "model": model}

    return get
