"""Shared fixtures for the test suite.

Fixtures prefixed `tiny_` (tokenizer, documents, models) were added for tests/toolkit; they are
small enough that every test file runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

# the tests' helpers (tests/support/), imported by name from every test file and from the probes' ranks
sys.path.insert(0, str(Path(__file__).parent / "support"))

import cost  # noqa: E402
import datasets  # noqa: E402
import installed  # noqa: E402
import probe_ranks  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from recipe_runner import CHATML, MATRIX_RUN, TINY, run_recipe  # noqa: E402

TINY_VOCAB = 300

if os.environ.get("PYTEST_XDIST_WORKER"):
    # tests/run.sh runs two workers on a 2-core machine: one thread each, not two fighting for both cores
    torch.set_num_threads(1)


# tests/run.sh runs two pytest-xdist workers with `--dist loadgroup`: each group below is one unit of work,
# given whole to whichever worker is free. A test file is a group (its module fixtures are built once), and
# files that read one session fixture's runs share a group: a worker shares a session fixture only with
# itself. "shared-runs" is `strategy_runs` below (and the sharding probes of tests/toolkit/strategy).
SHARED_RUNS = {
    "tests/recipes/test_export.py", "tests/recipes/test_pretrain.py", "tests/recipes/test_strategies.py",
    "tests/toolkit/planner/test_state.py", "tests/toolkit/strategy/test_sharding.py",
}
# The longest groups, handed out first: the suite cannot end before its longest group does, so these start at
# once, one on each worker. test_shipped.py also holds the only SmolLM2 launches, one after the other (two at
# once were killed for memory).
LONGEST = ["shared-runs", "tests/recipes/test_shipped.py"]
# The longest one-process files (30-55 s each): first among the files that start no process, so that the fast
# suite (where every file is one) ends on short files on both workers, not on one of these on one worker.
LONGEST_ONE_PROCESS = ["tests/toolkit/export/test_gguf.py", "tests/recipes/test_finetune.py",
                       "tests/toolkit/data/test_packing.py", "tests/toolkit/export/test_quantize.py"]


def _group(item) -> str:
    path = item.nodeid.split("::")[0]
    return "shared-runs" if path in SHARED_RUNS else path


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items):
    """Groups, and the order they are handed out in (run.sh keeps it: --no-loadscope-reorder): the longest
    groups, then the groups that start processes, the most runs first, so that the one-process files fill both
    workers at the end instead of one worker finishing a long group alone (the longest one-process files first
    among those). Within a group, the tests that need DeepSpeed's CPU Adam go last: recipes/install.sh builds it
    in the background at the lowest priority (~3 CPU-minutes), so the later they come, the more of it is done."""
    for item in items:  # before xdist's own hook, which reads the groups
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    yield
    # after `-m` has deselected: the fast suite's order counts only its own tests
    runs = collections.Counter(_group(item) for item in items if item.get_closest_marker("distributed"))
    first = {group: i for i, group in enumerate(LONGEST)}
    one_process = {group: i for i, group in enumerate(LONGEST_ONE_PROCESS)}
    items.sort(key=lambda item: (first.get(_group(item), len(first)), -runs[_group(item)],
                                 one_process.get(_group(item), len(one_process)),
                                 item.get_closest_marker("cpu_adam") is not None))


def pytest_configure(config):
    config.pluginmanager.register(cost, "cost")  # what each test costs, against tests/README.md's budget


def pytest_runtest_setup(item):
    # xdist appends "@group" to a grouped test's node id; a multi-process test without it could run beside a
    # SmolLM2 launch, or with a fixture of its file built a second time on the other worker
    grouped = os.environ.get("LLM_TOOLKIT_TESTS_GROUPED") and os.environ.get("PYTEST_XDIST_WORKER")  # tests/run.sh
    if grouped and item.get_closest_marker("distributed") and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):
        pytest.fail("pytest-xdist did not keep the tests in their groups (pytest 9.2 with xdist 3.8 ignores "
                    "them): pip install 'pytest<9.2', or run with -n 0", pytrace=False)

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
    # Gemma 2's logit caps brought within reach of a tiny model's logits, so that they bend them
    "gemma2": {**_DECODER, "head_dim": 16, "final_logit_softcapping": 1.0, "attn_logit_softcapping": 2.0,
               "query_pre_attn_scalar": 16},
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
def at_once():
    """at_once(fn): fn() called by two threads released together; (what each returned, what each raised)."""
    import threading

    def run(fn):
        start, got, failed = threading.Barrier(2), [], []

        def one():
            start.wait()
            try:
                got.append(fn())
            except Exception as exc:  # noqa: BLE001 - the test reports it
                failed.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return got, failed

    return run


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: `tiny_model("llama", seed=0, tokenizer=tok, num_hidden_layers=4, ...)`.

    A fixture rather than an import: `from conftest import ...` is ambiguous once
    tests/toolkit/strategy/conftest.py is loaded too.
    """
    return build_tiny_model


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """A small Hugging Face folder (a tiny LLaMA and the tiny BPE, no chat template): what a command's refusals and
    reads need, without a training run. Read only."""
    folder = tmp_path_factory.mktemp("model-folder") / "model"
    tiny_model(tokenizer=tiny_tokenizer).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


# --- runs of the recipes, shared by the tests that read them (tests/recipes, and the sharding tests) ---


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """The toolkit's cache (tokenizers, packed data, dequantised SmolLM2) for the whole run, both workers: later
    runs read it, as a user's second run does. Also the default of every test that names no cache of its own, so
    that SmolLM2 is dequantised once a run (~12 CPU-s each time) and nothing is written to the home folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-xdist gives each worker a folder inside the run's
    cache = root / "toolkit-cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_TOOLKIT_CACHE", str(cache))
        yield cache


@pytest.fixture
def recipe_in_process(data_cache, monkeypatch):
    """A recipe's main() run in this process: the run's cache, and Accelerate's state reset after it, as the next
    process of a user's would start without it."""
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(data_cache))
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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
def chat_tokenizer(tiny_tokenizer):
    """The tiny BPE with ChatML's turn markers as special tokens and ChatML as its template (a chat model's shape)."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


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


# --- what each rank held: the strategy matrix's runs at 2 processes, the sharding probe's launches otherwise
# (tests/toolkit/strategy/test_sharding.py and tests/toolkit/planner/test_state.py read the same runs)


SHARDING_PROBE = probe_ranks.SUPPORT / "sharding_probe.py"


@pytest.fixture(scope="session")
def sharding_probe(tmp_path_factory) -> Callable[[str, int], dict]:
    """probe(strategy, nproc, model_type="llama") -> {"strategy", "world_size", "n_params", "ranks": [held_bytes of
    each rank]}; model_type "qwen3_moe" probes a mixture of experts of the same sizes."""
    folder = tmp_path_factory.mktemp("sharding")
    results: dict[tuple[str, int, str], dict] = {}

    def probe(strategy: str, nproc: int, model_type: str = "llama") -> dict:
        if (strategy, nproc, model_type) not in results:
            out = folder / f"{strategy}-{nproc}-{model_type}.json"
            proc = probe_ranks.run(SHARDING_PROBE, [out, model_type], nproc, accelerate_config=f"{strategy}.yaml", timeout=600)
            if proc.returncode != 0 or not out.is_file():
                pytest.fail(f"{SHARDING_PROBE.name} under {strategy} on {nproc} ranks exited {proc.returncode}\n{proc.stdout[-8000:]}")
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
