#!/usr/bin/env bash
# Ported from verl (github.com/volcengine/verl @ b178a3cd, 2026-01-29):
#   examples/grpo_trainer/run_qwen2_5_7b_grpo_npu.sh  (synchronous GRPO on GSM8K, Ascend NPU)
# Changed, and nothing else:
#   * module: `python3 -m verl.trainer.main_ppo` -> `python3 -m fully_async.main --config-name=ppo_trainer`
#     (our synchronous, colocated loop);
#   * paths: the model is a local folder, MODEL_PATH (default $HOME/models/Qwen2.5-7B-Instruct), instead of the
#     hub id Qwen/Qwen2.5-7B-Instruct (this package never downloads weights);
#   * `trainer.device=npu` added.
# Every other key is verl's: docs/verl_compat.md says what each one does here.  Extra overrides are appended
# ($@), e.g.  bash recipes/verl_ported/grpo_gsm8k_sync_npu.sh --cfg job
set -x

python3 -m fully_async.main --config-name=ppo_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=${MODEL_PATH:-$HOME/models/Qwen2.5-7B-Instruct} \
    actor_rollout_ref.actor.optim.lr=5e-8 \
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.enable_chunked_prefill=False \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=console \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_5_7b_function_rm' \
    trainer.n_gpus_per_node=16 \
    trainer.nnodes=1 \
    trainer.device=npu \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=5 $@