#!/usr/bin/env bash
# Synchronous (colocated) GRPO on the bundled tiny arithmetic task: the baseline of async.sh.
#
#   bash recipes/tiny_arithmetic/sync.sh [key=value ...]
#
# Hardware expected: one CPU machine with >= 2 cores (the one colocated worker gets both); no
# accelerator, no download.  Same config as async.sh except mode=sync (data.train_batch_size=16
# prompts per step = async's ppo_mini_batch_size x require_batches).
set -euo pipefail
cd "$(dirname "$0")/../.."
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/tiny_arithmetic/sync}"
python -m fully_async.main mode=sync trainer.device=cpu "$@"
