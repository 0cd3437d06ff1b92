#!/usr/bin/env bash
# Fully async GRPO on the bundled tiny arithmetic task (tiny Qwen2-shaped model, CPU only).
#
#   bash recipes/tiny_arithmetic/async.sh [key=value ...]
#
# Hardware expected: one CPU machine with >= 2 cores (the rollouter and the trainer get one core
# each); no accelerator, no download.  40 trainer steps, validation reward ~0.3 -> >= 0.8.
# Extra arguments are Hydra overrides appended to the command, e.g. trainer.total_training_steps=10.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/tiny_arithmetic/async}"
python -m fully_async.main mode=async trainer.device=cpu "$@"
