"""Shared fixtures for the test suite.

Fixtures prefixed `tiny_` (tokenizer, documents, models) were added for tests/toolkit; they are
small enough that every test file runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import installed
import pytest
import torch

TINY_VOCAB = 300

if os.environ.get("PYTEST_XDIST_WORKER"):
    # tests/run.sh runs two workers on a 2-core machine: one thread each, not two fighting for both cores
    torch.set_num_threads(1)


# The multi-process tests run in two lanes, one per pytest-xdist worker (tests/run.sh), side by side: a launch
# spends much of its time waiting (gloo, a checkpoint's barrier, a timeout being tested), which the other lane
# fills. This lane holds the tests that read the session's shared runs (tests/recipes/conftest.py, shared
# within a worker only) and every SmolLM2 launch: two of those at once were killed for memory.
SHARED_RUNS_LANE = {
    "tests/recipes/test_export.py", "tests/recipes/test_pretrain.py", "tests/recipes/test_shipped.py",
    "tests/recipes/test_strategies.py", "tests/recipes/test_finetune_strategies.py",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` each lane is one unit of work: its launches run one after another on one
    worker, and the one-process tests fill both workers once a lane is done."""
    for item in items:
        if item.get_closest_marker("distributed"):
            shared = item.nodeid.split("::")[0] in SHARED_RUNS_LANE
            item.add_marker(pytest.mark.xdist_group("shared-runs" if shared else "launches"))


def pytest_runtest_setup(item):
    # xdist marks a grouped test by its node id; a multi-process test without the mark could run beside two
    # others, or beside a SmolLM2 launch
    grouped = os.environ.get("LLM_TOOLKIT_TESTS_GROUPED") and os.environ.get("PYTEST_XDIST_WORKER")  # tests/run.sh
    if grouped and item.get_closest_marker("distributed") and not item.nodeid.endswith(("@shared-runs", "@launches")):
        pytest.fail("pytest-xdist did not keep the multi-process tests in their lanes (pytest 9.2 with xdist 3.8 "
                    "ignores groups): pip install 'pytest<9.2', or run with -n 0", pytrace=False)

# Sizes per model_type for `tiny_model`: hidden 64, 4 heads, fp32.
_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_SIZES = {
    "llama": _DECODER,
    "qwen2": _DECODER,
    "qwen3_moe": {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1},
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
}


@pytest.fixture(scope="session")
def tiny_texts() -> list[str]:
    """The CPython docs shipped in `pydoc_data` (the recipe's embedded default corpus)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_texts):
    """A byte-level BPE of TINY_VOCAB tokens trained with the toolkit on the pydoc texts."""
    from toolkit.data.tokenizer import train_bpe

    return train_bpe(datasets.Dataset.from_dict({"text": tiny_texts}), TINY_VOCAB)


def build_tiny_model(model_type: str = "llama", seed: int = 0, attn: str = "sdpa", tokenizer=None, **sizes):
    """A randomly initialised fp32 causal LM configured as the recipe does (use_cache off, EOS/PAD ids).

    Built with transformers directly rather than toolkit.models.scratch so that these fixtures do not
    follow signature changes there.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    eos, pad = (tokenizer.eos_token_id, tokenizer.pad_token_id) if tokenizer is not None else (0, 1)
    vocab = len(tokenizer) if tokenizer is not None else TINY_VOCAB
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **{**TINY_SIZES[model_type], **sizes})
    config.eos_token_id = config.bos_token_id = eos
    config.pad_token_id = pad
    config.use_cache = False
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF as the recipes find it; the test fails (never skips) without it."""
    return installed.smollm2_gguf()


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: `tiny_model("llama", seed=0, tokenizer=tok, num_hidden_layers=4, ...)`.

    A fixture rather than an import: `from conftest import ...` is ambiguous once
    tests/recipes/conftest.py is loaded too.
    """
    return build_tiny_model
