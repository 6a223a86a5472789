#!/usr/bin/env bash
# From a fresh machine to a trained model: install, pretrain the tiny LLaMA on the CPython docs
# with 2 processes (DDP over gloo on CPU, NCCL on GPUs), then print where the model, metrics
# and loss plot are and generate a sample. Run it again and it resumes (resume=auto).
# Run from any folder: the run goes to runs/tiny under the folder you run it from, and the paths it
# prints are from there (the checkout's files are named by where this script is).
# Extra arguments are config overrides, e.g.: bash recipes/quickstart.sh train.max_steps=400
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/recipes/install.sh" --for quickstart  # once: a second run finds it installed
# launch.sh: accelerate launch with the recipe's exit code and one line for a user error
bash "$root/recipes/launch.sh" --config_file "$root/accelerate_configs/ddp.yaml" --num_processes 2 \
  "$root/recipes/pretrain.py" --config "$root/recipes/configs/pretrain_tiny.yaml" resume=auto "$@"
