#!/usr/bin/env bash
# Launch a recipe on N nodes with SLURM: one `accelerate launch` per node, rank and rendezvous
# address taken from SLURM. Adjust the #SBATCH lines to your cluster, then:
#   sbatch --nodes=2 recipes/slurm_launch.sh recipes/pretrain.py --config recipes/configs/pretrain_llama_1b.yaml
# Any accelerate config works (ACCELERATE_CONFIG=accelerate_configs/fsdp.yaml sbatch ...).
#SBATCH --job-name=llm-toolkit
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --output=slurm-%j.out
set -euo pipefail

CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/multinode_zero3.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${SLURM_NNODES:?run this through sbatch or srun}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MAIN_PORT:-29500}

# srun starts one task per node; each computes its own machine_rank from SLURM_NODEID.
# recipes/launch.sh is `accelerate launch` that exits with the recipe's code (2 bad input, 3 stopped
# after a checkpoint: requeue and it resumes) and passes SIGTERM/SIGUSR1 on to the ranks.
srun --kill-on-bad-exit=1 bash -c "
  exec bash recipes/launch.sh --config_file $CONFIG \
    --num_machines $NNODES --num_processes $((NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID --main_process_ip $MAIN_IP --main_process_port $PORT \
    $* resume=auto
"
