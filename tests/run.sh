#!/usr/bin/env bash
# Install, then run the whole test suite (multi-process tests included) on CPU.
# Arguments go to pytest, e.g.: bash tests/run.sh -m "not distributed" for the fast suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/install.sh --for tests --build-cpu-adam
PY=${PYTHON:-python3}
# Two workers (pytest-xdist), each taking a whole test file at a time, the files that launch processes first
# (tests/conftest.py); `-n 0` after it runs everything in this process.
LLM_TOOLKIT_TESTS_GROUPED=1 "$PY" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"
