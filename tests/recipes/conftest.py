"""Fixtures shared by the recipe tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_runner import CHATML, TINY, run_recipe


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
    """model_parallel.RUN on one process: what the context- and tensor-parallel runs must equal."""
    from model_parallel import RUN

    out = tmp_path_factory.mktemp("model-parallel") / "one"
    run_recipe("pretrain", [*RUN, f"output_dir={out}"], nproc=1, cache=data_cache)
    return out
