#!/usr/bin/env bash
# `accelerate launch` that exits with the recipe's code (0 done, 2 bad input, 3 stopped by a signal
# after a checkpoint: resume=auto continues, 4 a collective failed; toolkit/training/entry.py) and
# shows a user error as its one line, where accelerate launch exits 1 after torchrun's report.
# Same arguments:
#   bash recipes/launch.sh --config_file accelerate_configs/zero3.yaml --num_processes 2 \
#       recipes/pretrain.py --config recipes/configs/pretrain_tiny.yaml
# SIGTERM/SIGUSR1/SIGINT (Ctrl-C) sent to it reach the ranks, which save a checkpoint and exit with 3
# (a second Ctrl-C ends them at once); the ranks die with it when it is killed.
# How and why: toolkit/launch/launcher.py.
set -euo pipefail
# exec: the launcher itself receives the signals (bash would hold them until its child exits)
exec "${PYTHON:-python3}" -m toolkit.launch.launcher "$@"
