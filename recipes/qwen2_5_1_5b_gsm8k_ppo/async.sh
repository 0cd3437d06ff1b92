#!/usr/bin/env bash
# Fully async PPO with a critic (algorithm.adv_estimator=gae), Qwen2.5-1.5B-Instruct on GSM8K; 8 or 16 devices.
# Trainer: FSDP2, the actor and its critic (a value model of the actor's shape, verl's PPO keys); rollout: vLLM (tensor parallel 1).
#
#   MODEL_PATH=/models/Qwen2.5-1.5B-Instruct DATA_DIR=~/data/gsm8k N_DEVICES=8 bash recipes/qwen2_5_1_5b_gsm8k_ppo/async.sh [key=value ...]
#   DEVICE=cuda N_DEVICES=16 bash recipes/qwen2_5_1_5b_gsm8k_ppo/async.sh                       (NVIDIA GPUs)
#   ENTRY=fully_async.plan bash recipes/qwen2_5_1_5b_gsm8k_ppo/async.sh [plan.key=value ...]    (memory, split and throughput; no devices used)
#   bash recipes/qwen2_5_1_5b_gsm8k_ppo/async.sh --cfg job                                     (print the composed config)
#
# Hardware expected: N_DEVICES=8: one host with 8 devices; N_DEVICES=16: two hosts of 8 in one Ray cluster
# (`ray start --head` on one, `ray start --address=<head>:6379` on the other, then run this on the head).
#   DEVICE=npu (default): Ascend 910B 64 GB (Atlas 800T A2: 8 per host), CANN + torch_npu + vllm-ascend, >= 512 GB host RAM per host.
#   DEVICE=cuda:          NVIDIA H100 80 GB (8 per host), CUDA + vllm.
# Data: python scripts/preprocess_gsm8k.py --out_dir "$DATA_DIR".
# Rollout + trainer split per DEVICE:N_DEVICES, chosen with the planner (plan_<device>_<n>.txt here, from
# `ENTRY=fully_async.plan DEVICE=<device> N_DEVICES=<n> bash recipes/qwen2_5_1_5b_gsm8k_ppo/async.sh`): npu 8: 2+6, npu 16: 4+12
# (the planner's best 3+13 does not split evenly over two hosts), cuda 8: 2+6, cuda 16: 4+12.  The critic doubles
# the trainer's work per response (its values forward and its update), so the trainer gets more devices than GRPO's.
# The trainer computes the critic's values at train time on the staleness-bounded batch (as verl's fully-async).
# Compare with sync.sh (same knobs; mode=sync, all devices colocated) using scripts/compare_sync_async.py --from-logs.
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-1.5B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
DEVICE="${DEVICE:-npu}"
N_DEVICES="${N_DEVICES:-8}"
case "$DEVICE:$N_DEVICES" in
  npu:8) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=2 trainer.nnodes=1 trainer.n_gpus_per_node=6) ;;   # 2 rollout + 6 trainer
  npu:16) PLACE=(rollout.nnodes=2 rollout.n_gpus_per_node=2 trainer.nnodes=2 trainer.n_gpus_per_node=6) ;;   # 4 rollout + 12 trainer
  cuda:8) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=2 trainer.nnodes=1 trainer.n_gpus_per_node=6) ;;   # 2 rollout + 6 trainer
  cuda:16) PLACE=(rollout.nnodes=2 rollout.n_gpus_per_node=2 trainer.nnodes=2 trainer.n_gpus_per_node=6) ;;   # 4 rollout + 12 trainer
  *) echo "DEVICE=$DEVICE N_DEVICES=$N_DEVICES: this recipe is laid out for DEVICE=npu|cuda and N_DEVICES=8|16" >&2; exit 2 ;;
esac
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/qwen2_5_1_5b_gsm8k_ppo/async_${DEVICE}${N_DEVICES}}"

python -m "${ENTRY:-fully_async.main}" \
  mode=async \
  trainer.device="$DEVICE" \
  "${PLACE[@]}" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  data.max_prompt_length=1024 data.max_response_length=2048 \
  data.filter_overlong_prompts=true \
  data.train_batch_size=1024 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.ppo_mini_batch_size=256 \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576 \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.dtype=bfloat16 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.dtype=bfloat16 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.max_num_batched_tokens=16384 \
  trainer.total_epochs=1 \
  trainer.logger='[console,tensorboard]' \
  algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=1.0 \
  actor_rollout_ref.actor.use_kl_loss=false \
  critic.optim.lr=1e-5 critic.ppo_max_token_len_per_gpu=24576 critic.forward_max_token_len_per_gpu=24576 \
  critic.model.enable_gradient_checkpointing=true trainer.critic_warmup=0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.rollout.n=1 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  async_training.staleness_threshold=0.5 \
  async_training.trigger_parameter_sync_step=4 \
  async_training.require_batches=4 \
  async_training.partial_rollout=true \
  trainer.test_freq=2 \
  trainer.project_name=fully_async_gsm8k_ppo trainer.experiment_name=qwen2_5_1_5b_gsm8k_ppo_async_${DEVICE}${N_DEVICES} \
  "$@"
