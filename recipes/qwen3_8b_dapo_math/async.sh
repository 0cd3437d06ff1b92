#!/usr/bin/env bash
# Fully async DAPO-style GRPO, Qwen3-8B on DAPO-Math-17k (AIME 2024 validation); 8 or 16 devices.
# DAPO's dynamic sampling is on, as in verl's DAPO recipe: groups whose 16 responses all agree on acc are dropped
# and more prompts generated in their place (algorithm.filter_groups, at most 10 batches of prompts per step).
# Trainer: megatron tp=4 pp=1 + distributed optimizer; rollout: vLLM (tensor parallel 2).
#
#   MODEL_PATH=/models/Qwen3-8B DATA_DIR=~/data/dapo N_DEVICES=8 bash recipes/qwen3_8b_dapo_math/async.sh [key=value ...]
#   DEVICE=cuda N_DEVICES=16 bash recipes/qwen3_8b_dapo_math/async.sh                       (NVIDIA GPUs)
#   ENTRY=fully_async.plan bash recipes/qwen3_8b_dapo_math/async.sh [plan.key=value ...]    (memory, split and throughput; no devices used)
#   bash recipes/qwen3_8b_dapo_math/async.sh --cfg job                                     (print the composed config)
#
# Hardware expected: N_DEVICES=8: one host with 8 devices; N_DEVICES=16: two hosts of 8 in one Ray cluster
# (`ray start --head` on one, `ray start --address=<head>:6379` on the other, then run this on the head).
#   DEVICE=npu (default): Ascend 910B 64 GB (Atlas 800T A2: 8 per host), CANN + torch_npu + vllm-ascend + megatron-core (MindSpeed on NPU), >= 512 GB host RAM per host.
#   DEVICE=cuda:          NVIDIA H100 80 GB (8 per host), CUDA + vllm + megatron-core.
# Data: verl's recipe/dapo/prepare_dapo_data.sh (dapo-math-17k.parquet: data_source math_dapo; aime-2024.parquet: aime) into $DATA_DIR.
# Rollout + trainer split per DEVICE:N_DEVICES, chosen with the planner (plan_<device>_<n>.txt here, from
# `ENTRY=fully_async.plan DEVICE=<device> N_DEVICES=<n> bash recipes/qwen3_8b_dapo_math/async.sh`): npu 8: colocated on 8, npu 16: 12+4, cuda 8: 4+4, cuda 16: 12+4.
# Compare with sync.sh (same knobs; mode=sync, all devices colocated) using scripts/compare_sync_async.py --from-logs.
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-8B}"
DATA_DIR="${DATA_DIR:-$HOME/data/dapo}"
DEVICE="${DEVICE:-npu}"
N_DEVICES="${N_DEVICES:-8}"
ROLLOUT_TP=2 GPU_MEM=0.8
case "$DEVICE:$N_DEVICES" in
  # npu 8: colocated async (every NPU an engine and a trainer rank taking turns; the trainer offloads while its NPU
  # generates): the planner's pick among the placements the run takes here; split with TP-2 engines was 0.93x sync
  npu:8) PLACE=(async_training.placement=colocated rollout.n_gpus_per_node=0 trainer.nnodes=1 trainer.n_gpus_per_node=8
                actor_rollout_ref.actor.megatron.param_offload=true actor_rollout_ref.actor.megatron.optimizer_offload=true)
         ROLLOUT_TP=1 GPU_MEM=0.5 ;;
  npu:16) PLACE=(rollout.nnodes=2 rollout.n_gpus_per_node=6 trainer.nnodes=1 trainer.n_gpus_per_node=4) ;;   # 12 rollout + 4 trainer
  cuda:8) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=4 trainer.nnodes=1 trainer.n_gpus_per_node=4) ;;   # 4 rollout + 4 trainer
  cuda:16) PLACE=(rollout.nnodes=2 rollout.n_gpus_per_node=6 trainer.nnodes=1 trainer.n_gpus_per_node=4) ;;   # 12 rollout + 4 trainer
  *) echo "DEVICE=$DEVICE N_DEVICES=$N_DEVICES: this recipe is laid out for DEVICE=npu|cuda and N_DEVICES=8|16" >&2; exit 2 ;;
esac
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/qwen3_8b_dapo_math/async_${DEVICE}${N_DEVICES}}"

python -m "${ENTRY:-fully_async.main}" --config-name=fully_async_ppo_megatron_trainer \
  mode=async \
  trainer.device="$DEVICE" \
  "${PLACE[@]}" \
  data.train_files="$DATA_DIR/dapo-math-17k.parquet" data.val_files="$DATA_DIR/aime-2024.parquet" \
  data.max_prompt_length=2048 data.max_response_length=8192 \
  data.filter_overlong_prompts=true \
  data.train_batch_size=32 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
  actor_rollout_ref.actor.megatron.use_distributed_optimizer=true \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20480 \
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
  actor_rollout_ref.actor.use_kl_loss=false algorithm.use_kl_in_reward=false \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
  reward_model.reward_manager=dapo \
  reward_model.overlong_buffer.enable=true reward_model.overlong_buffer.len=2048 reward_model.overlong_buffer.penalty_factor=1.0 \
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10 \
  actor_rollout_ref.rollout.n=16 \
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
  actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM" \
  async_training.staleness_threshold=0.5 \
  async_training.trigger_parameter_sync_step=4 \
  async_training.require_batches=1 \
  async_training.partial_rollout=true \
  trainer.test_freq=2 \
  trainer.project_name=fully_async_dapo trainer.experiment_name=qwen3_8b_dapo_math_async_${DEVICE}${N_DEVICES} \
  "$@"
