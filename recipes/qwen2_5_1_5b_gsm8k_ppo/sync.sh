#!/usr/bin/env bash
# Synchronous (colocated) baseline: PPO with a critic (algorithm.adv_estimator=gae), Qwen2.5-1.5B-Instruct on GSM8K; 8 or 16 devices.
# Trainer: FSDP2, the actor and its critic (a value model of the actor's shape, verl's PPO keys); rollout: vLLM, one engine per trainer rank, asleep while training.
#
#   MODEL_PATH=/models/Qwen2.5-1.5B-Instruct DATA_DIR=~/data/gsm8k N_DEVICES=8 bash recipes/qwen2_5_1_5b_gsm8k_ppo/sync.sh [key=value ...]
#   DEVICE=cuda N_DEVICES=16 bash recipes/qwen2_5_1_5b_gsm8k_ppo/sync.sh                       (NVIDIA GPUs)
#   ENTRY=fully_async.plan bash recipes/qwen2_5_1_5b_gsm8k_ppo/sync.sh [plan.key=value ...]    (memory, split and throughput; no devices used)
#   bash recipes/qwen2_5_1_5b_gsm8k_ppo/sync.sh --cfg job                                     (print the composed config)
#
# Hardware expected: N_DEVICES=8: one host with 8 devices; N_DEVICES=16: two hosts of 8 in one Ray cluster
# (`ray start --head` on one, `ray start --address=<head>:6379` on the other, then run this on the head).
#   DEVICE=npu (default): Ascend 910B 64 GB (Atlas 800T A2: 8 per host), CANN + torch_npu + vllm-ascend, >= 512 GB host RAM per host.
#   DEVICE=cuda:          NVIDIA H100 80 GB (8 per host), CUDA + vllm.
# Data: python scripts/preprocess_gsm8k.py --out_dir "$DATA_DIR".
# Same knobs as async.sh except mode=sync (all N_DEVICES train and generate, one weight push per step),
# no rollout tensor parallelism (one engine per rank), a smaller vLLM memory share, free_cache_engine=true and the
# trainer offloaded to host memory while the engines generate (plan_sync_*.txt: the memory table shows why).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-1.5B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
DEVICE="${DEVICE:-npu}"
N_DEVICES="${N_DEVICES:-8}"
case "$DEVICE:$N_DEVICES" in
  npu:8|npu:16|cuda:8|cuda:16) ;;
  *) echo "DEVICE=$DEVICE N_DEVICES=$N_DEVICES: this recipe is laid out for DEVICE=npu|cuda and N_DEVICES=8|16" >&2; exit 2 ;;
esac
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/qwen2_5_1_5b_gsm8k_ppo/sync_${DEVICE}${N_DEVICES}}"

python -m "${ENTRY:-fully_async.main}" \
  mode=sync \
  trainer.device="$DEVICE" \
  trainer.nnodes=$((N_DEVICES / 8)) trainer.n_gpus_per_node=8 \
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
  actor_rollout_ref.rollout.gpu_memory_utilization=0.45 \
  actor_rollout_ref.rollout.free_cache_engine=true \
  actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
  trainer.test_freq=10 \
  trainer.project_name=fully_async_gsm8k_ppo trainer.experiment_name=qwen2_5_1_5b_gsm8k_ppo_sync_${DEVICE}${N_DEVICES} \
  "$@"
