#!/usr/bin/env bash
# Fully async GRPO (DAPO-style knobs), Qwen2.5-0.5B-Instruct on GSM8K, 2 Ascend NPUs:
# 1 NPU rolls out (vLLM-Ascend), 1 NPU trains; weights pushed every 4 trainer steps.
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct DATA_DIR=~/data/gsm8k bash recipes/qwen2_5_0_5b_gsm8k/async_npu.sh [key=value ...]
#
# Hardware expected: one host with >= 2 Ascend NPUs (e.g. Atlas 800T A2, 910B 64 GB), CANN +
# torch_npu + vllm-ascend installed (`pip install -e '.[npu,vllm]'`), ~32 GB host RAM.
# Data: python scripts/preprocess_gsm8k.py --out_dir "$DATA_DIR"   (or --local_dir for offline files)
# The synchronous baseline on the same 2 NPUs is sync_npu.sh; compare the two TensorBoard dirs with
#   python scripts/compare_sync_async.py --from-logs <async dir> <sync dir> --threshold 0.4 \
#     --allow-diff trainer.n_gpus_per_node --allow-diff trainer.test_freq --allow-diff actor_rollout_ref.rollout.gpu_memory_utilization
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/qwen2_5_0_5b_gsm8k/async_npu}"

python -m fully_async.main \
  mode=async \
  trainer.device=npu \
  trainer.nnodes=1 trainer.n_gpus_per_node=1 \
  rollout.nnodes=1 rollout.n_gpus_per_node=1 \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  data.max_prompt_length=2048 data.max_response_length=3072 \
  data.filter_overlong_prompts=true data.train_batch_size=32 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.dtype=bfloat16 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  actor_rollout_ref.rollout.max_num_batched_tokens=8192 \
  async_training.staleness_threshold=0.2 \
  async_training.trigger_parameter_sync_step=4 \
  async_training.require_batches=1 \
  async_training.partial_rollout=true \
  reward_model.reward_manager=dapo \
  reward_model.overlong_buffer.enable=true reward_model.overlong_buffer.len=512 \
  reward_model.overlong_buffer.penalty_factor=1.0 \
  trainer.total_epochs=1 \
  trainer.test_freq=5 \
  trainer.logger='[console,tensorboard]' \
  trainer.project_name=fully_async_gsm8k trainer.experiment_name=qwen2_5_0_5b_gsm8k_async \
  "$@"
