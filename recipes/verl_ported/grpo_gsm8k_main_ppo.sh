#!/usr/bin/env bash
# Ported from verl's GRPO example (github.com/volcengine/verl @ b178a3cd, docs/algo/grpo.md):
#   examples/grpo_trainer/run_qwen2-7b.sh  (verl.trainer.main_ppo, GRPO on GSM8K with a rule reward)
# Changed, and nothing else (docs/porting.md):
#   * module: `python3 -m verl.trainer.main_ppo` -> `python3 -m fully_async.main --config-name=ppo_trainer`
#     (our synchronous, colocated loop, as main_ppo runs);
#   * paths: the model is a local folder, MODEL_PATH (default $HOME/models/Qwen2-7B-Instruct), instead of the hub id
#     Qwen/Qwen2-7B-Instruct (this package never downloads weights);
#   * `trainer.device=${DEVICE:-cuda}` added (verl leaves it to the machine).
# Every other key is verl's: docs/verl_compat.md says what each one does here.  Extra overrides are appended ($@):
#   bash recipes/verl_ported/grpo_gsm8k_main_ppo.sh --cfg job          # the start's checks, then the config
# On a 2-core CPU, shrunk to the bundled tiny model and task (2 steps, about a minute; docs/porting.md):
#   A=$(python -c "from fully_async.core.config import asset_path as a; print(a('tiny_arithmetic'))")
#   DEVICE=cpu MODEL_PATH=$A/model bash recipes/verl_ported/grpo_gsm8k_main_ppo.sh \
#     data.train_files=$A/data/train.parquet data.val_files=$A/data/val.parquet data.train_batch_size=8 \
#     data.max_prompt_length=16 data.max_response_length=8 actor_rollout_ref.rollout.n=4 \
#     actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.rollout.name=hf \
#     actor_rollout_ref.rollout.tensor_model_parallel_size=1 trainer.n_gpus_per_node=1 trainer.logger=console \
#     trainer.total_training_steps=2 trainer.save_freq=-1
set -x

python3 -m fully_async.main --config-name=ppo_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=${MODEL_PATH:-$HOME/models/Qwen2-7B-Instruct} \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.device=${DEVICE:-cuda} \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
