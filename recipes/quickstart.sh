#!/usr/bin/env bash
# From a fresh machine to a trained model: install, pretrain the tiny LLaMA on the CPython docs
# with 2 processes (DDP over gloo on CPU, NCCL on GPUs), then print where the model, metrics
# and loss plot are and generate a sample. Run it again and it resumes (resume=auto).
# Extra arguments are config overrides, e.g.: bash recipes/quickstart.sh train.max_steps=400
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/install.sh --for quickstart  # once: a second run finds it installed
# launch.sh: accelerate launch with the recipe's exit code and one line for a user error
bash recipes/launch.sh --config_file accelerate_configs/ddp.yaml --num_processes 2 \
  recipes/pretrain.py --config recipes/configs/pretrain_tiny.yaml resume=auto "$@"
