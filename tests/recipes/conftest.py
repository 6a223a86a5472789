"""Fixtures shared by the recipe tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_runner import CHATML, MATRIX_RUN, TINY, run_recipe


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/packing cache for the session: later runs read it, as a user's second run does."""
    return tmp_path_factory.mktemp("toolkit-cache")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, data_cache) -> Path:
    """A pretrained tiny LLaMA: the final/ folder of a short pretraining run (the fine-tunes' base)."""
    out = tmp_path_factory.mktemp("tiny-base") / "run"
    run_recipe("pretrain", [*TINY, "train.max_steps=4", "checkpoint.every=0", f"output_dir={out}"], nproc=1, cache=data_cache)
    return out / "final"


@pytest.fixture(scope="session")
def chatml_file(tmp_path_factory) -> Path:
    """A ChatML template for tokenizers that have none (the tiny model's BPE)."""
    path = tmp_path_factory.mktemp("templates") / "chatml.jinja"
    path.write_text(CHATML)
    return path


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, data_cache) -> Path:
    """6 steps of TINY on one process (checkpoints and evaluations at 3 and 6): what every 2-process
    pretraining run of the same 6 steps must equal, whatever its strategy or model-parallel layout."""
    out = tmp_path_factory.mktemp("one-process") / "run"
    run_recipe("pretrain", [*TINY, "train.max_steps=6", f"output_dir={out}"], nproc=1, cache=data_cache)
    return out


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory, data_cache):
    """strategy_runs(strategy) -> (run folder, what it printed): MATRIX_RUN on 2 processes under
    accelerate_configs/{strategy}.yaml, launched once for the whole session, on first use.

    Many tests read one run (each launch costs ~8 s of imports and start-up for a second of training);
    none may change it: a test that resumes or damages a run works on a copy."""
    done = {}

    def get(strategy: str) -> tuple[Path, str]:
        if strategy not in done:
            out = tmp_path_factory.mktemp(f"matrix-{strategy}") / "run"
            proc = run_recipe("pretrain", [*MATRIX_RUN, f"output_dir={out}"], nproc=2, cache=data_cache,
                              accelerate_config=f"{strategy}.yaml")
            done[strategy] = (out, proc.stdout + proc.stderr)
        return done[strategy]

    return get
