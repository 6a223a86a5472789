"""Fixtures shared by the recipe tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/packing cache for the session: later runs read it, as a user's second run does."""
    return tmp_path_factory.mktemp("toolkit-cache")
