#!/usr/bin/env bash
# Regenerates every recipe's committed planner output (recipes/<name>/plan_<device>_<n>.txt for async.sh and
# plan_sync_<device>_<n>.txt for sync.sh) with `python -m fully_async.plan`; no devices are used.
# Run after changing a recipe or the planner; tests/unit/test_recipes.py checks the files match.
#
#   bash recipes/make_plans.sh [recipe ...]
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(qwen2_5_1_5b_gsm8k qwen2_5_1_5b_gsm8k_ppo qwen2_5_7b_gsm8k qwen2_5_7b_math qwen3_4b_dapo_math qwen3_8b_dapo_math)
# the output must not depend on this machine: the model by its built-in shape name, data that is nowhere
export DATA_DIR=/nonexistent/data
for name in "${names[@]}"; do
  MODEL_PATH=$(sed -n 's|^MODEL_PATH="${MODEL_PATH:-$HOME/models/\(.*\)}"$|\1|p' "recipes/$name/async.sh")
  export MODEL_PATH
  for dev in npu cuda; do
    for n in 8 16; do
      rc=0
      ENTRY=fully_async.plan DEVICE=$dev N_DEVICES=$n bash "recipes/$name/async.sh" > "recipes/$name/plan_${dev}_${n}.txt" || rc=$?
      [ $rc = 0 ] || echo "recipes/$name/plan_${dev}_${n}.txt: exit $rc (2: a role does not fit)"
      rc=0
      ENTRY=fully_async.plan DEVICE=$dev N_DEVICES=$n bash "recipes/$name/sync.sh" > "recipes/$name/plan_sync_${dev}_${n}.txt" || rc=$?
      [ $rc = 0 ] || echo "recipes/$name/plan_sync_${dev}_${n}.txt: exit $rc (2: a role does not fit)"
    done
  done
done
