#!/usr/bin/env bash
# Fully async GRPO, Qwen2.5-7B-Instruct on GSM8K; 8 or 16 devices.
# Trainer: megatron tp=2 pp=1 + distributed optimizer; rollout: vLLM (tensor parallel 2).
#
#   MODEL_PATH=/models/Qwen2.5-7B-Instruct DATA_DIR=~/data/gsm8k N_DEVICES=8 bash recipes/qwen2_5_7b_gsm8k/async.sh [key=value ...]
#   DEVICE=cuda N_DEVICES=16 bash recipes/qwen2_5_7b_gsm8k/async.sh                       (NVIDIA GPUs)
#   ENTRY=fully_async.plan bash recipes/qwen2_5_7b_gsm8k/async.sh [plan.key=value ...]    (memory, split and throughput; no devices used)
#   bash recipes/qwen2_5_7b_gsm8k/async.sh --cfg job                                     (print the composed config)
#
# Hardware expected: N_DEVICES=8: one host with 8 devices; N_DEVICES=16: two hosts of 8 in one Ray cluster
# (`ray start --head` on one, `ray start --address=<head>:6379` on the other, then run this on the head).
#   DEVICE=npu (default): Ascend 910B 64 GB (Atlas 800T A2: 8 per host), CANN + torch_npu + vllm-ascend + megatron-core (MindSpeed on NPU), >= 512 GB host RAM per host.
#   DEVICE=cuda:          NVIDIA H100 80 GB (8 per host), CUDA + vllm + megatron-core.
# Data: python scripts/preprocess_gsm8k.py --out_dir "$DATA_DIR".
# Rollout + trainer split per DEVICE:N_DEVICES, chosen with the planner (plan_<device>_<n>.txt here, from
# `ENTRY=fully_async.plan DEVICE=<device> N_DEVICES=<n> bash recipes/qwen2_5_7b_gsm8k/async.sh`): npu 8: colocated on 8, npu 16: 6+10, cuda 8: 4+4, cuda 16: 8+8.
# Compare with sync.sh (same knobs; mode=sync, all devices colocated) using scripts/compare_sync_async.py --from-logs.
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-7B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
DEVICE="${DEVICE:-npu}"
N_DEVICES="${N_DEVICES:-8}"
ROLLOUT_TP=2 GPU_MEM=0.8
case "$DEVICE:$N_DEVICES" in
  # npu 8: colocated async (every NPU an engine and a trainer rank taking turns; the trainer offloads while its NPU
  # generates): predicted 1.16x sync; split 2+6 with TP-1 engines 1.17x (plan_npu_8.txt's pick, within the
  # simulation's error of it); split with TP-2 engines was 0.86x
  npu:8) PLACE=(async_training.placement=colocated rollout.n_gpus_per_node=0 trainer.nnodes=1 trainer.n_gpus_per_node=8
                actor_rollout_ref.actor.megatron.param_offload=true actor_rollout_ref.actor.megatron.optimizer_offload=true)
         ROLLOUT_TP=1 GPU_MEM=0.5 ;;
  npu:16) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=6 trainer.nnodes=2 trainer.n_gpus_per_node=5) ;;   # 6 rollout + 10 trainer
  cuda:8) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=4 trainer.nnodes=1 trainer.n_gpus_per_node=4) ;;   # 4 rollout + 4 trainer
  cuda:16) PLACE=(rollout.nnodes=1 rollout.n_gpus_per_node=8 trainer.nnodes=1 trainer.n_gpus_per_node=8) ;;   # 8 rollout + 8 trainer
  *) echo "DEVICE=$DEVICE N_DEVICES=$N_DEVICES: this recipe is laid out for DEVICE=npu|cuda and N_DEVICES=8|16" >&2; exit 2 ;;
esac
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/qwen2_5_7b_gsm8k/async_${DEVICE}${N_DEVICES}}"

python -m "${ENTRY:-fully_async.main}" --config-name=fully_async_ppo_megatron_trainer \
  mode=async \
  trainer.device="$DEVICE" \
  "${PLACE[@]}" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  data.max_prompt_length=1024 data.max_response_length=2048 \
  data.filter_overlong_prompts=true \
  data.train_batch_size=128 \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
  actor_rollout_ref.actor.megatron.use_distributed_optimizer=true \
  actor_rollout_ref.actor.ppo_mini_batch_size=128 \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384 \
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
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
  actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM" \
  async_training.staleness_threshold=0.5 \
  async_training.trigger_parameter_sync_step=4 \
  async_training.require_batches=1 \
  async_training.partial_rollout=true \
  trainer.test_freq=2 \
  trainer.project_name=fully_async_gsm8k trainer.experiment_name=qwen2_5_7b_gsm8k_async_${DEVICE}${N_DEVICES} \
  "$@"
