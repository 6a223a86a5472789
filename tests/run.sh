#!/usr/bin/env bash
# Install, then run the whole test suite (multi-process tests included) on CPU.
# Arguments go to pytest, e.g.: bash tests/run.sh -m "not distributed" for the fast suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/install.sh
PY=${PYTHON:-python3}
"$PY" -m pytest "$@"
