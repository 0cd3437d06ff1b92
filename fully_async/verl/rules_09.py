"""verl 0.9.1's config keys that b178a3cd's configs did not have (layer 1): one rule each, as in rules.py (mapped,
warned, refused), read after that table; docs/verl_config_keys.tsv lists every key of both versions.  The V1
trainer's keys (`trainer.v1.*`, `model_engine`) set several of ours at once and are translated by verl/v1.py
instead (v1.classify_v1 says what each becomes, for the docs).
"""
from __future__ import annotations

from fully_async.verl.rules import (CRITIC_FOLLOWS, MOE, ONE, REF_FOLLOWS, RM_SERVED, Rule, _is, _map, _refuse, _warn,
                                    _warn_if)

ENGINE = ("verl 0.9's {name} engine is not implemented here; the trainer runs on actor_rollout_ref.actor.strategy "
          "(fsdp|fsdp2|torch|megatron) with its own keys (actor_rollout_ref.actor.fsdp_config.*, .megatron.*)")
OPD = ("on-policy distillation (a teacher model's log-probs in the loss) is not implemented; train with a reward "
       "(custom_reward_function.path) instead")
QAT = ("quantization-aware training (verl's fake-quantized weights) is not implemented; the actor trains in "
       "actor_rollout_ref.actor.dtype and the rollout may quantize with actor_rollout_ref.rollout.quantization")
CHUNKED = ("the log-prob/entropy is always computed in chunks (train/backends/token_stats.py), sized in elements "
           "by the device, not in tokens")
PAD = ("verl pads each packed micro-batch to a fixed token count (fewer kernel shapes); here a micro-batch keeps its "
       "own length: the numbers do not depend on it")
MUON = "read only with actor_rollout_ref.actor.optim.optimizer=muon (refused: the optimizer is torch's AdamW)"
PRECISION = "read only with use_precision_aware_optimizer=true (refused)"
SKIP = "rollout skipping (replaying dumped rollouts) is not implemented"
DYNAMIC = ("dynamic resource scheduling (devices moved between rollouter and trainer at run time) is not "
           "implemented; async_training.placement=elastic lends the trainer's devices to generation while it waits")

RULES_09: list[Rule] = [
    # ---------------------------------------------------------------- engines other than fsdp / megatron
    _refuse("actor_rollout_ref.actor.engine.**", ENGINE.format(name="megatron-lite (actor.engine.*)") +
            "; its tp/pp/ep are actor_rollout_ref.actor.megatron.{tensor,pipeline,expert}_model_parallel_size"),
    _refuse("actor_rollout_ref.actor.fsdp_config.turbo_config.**", ENGINE.format(name="FSDP-turbo")),
    _refuse("actor_rollout_ref.*.veomni.**", ENGINE.format(name="VeOmni")),
    _warn_if("actor_rollout_ref.actor.megatron.use_megatron_fsdp", _is(False), "false", "megatron's own "
             "distributed optimizer", "Megatron-FSDP is not implemented; use strategy=fsdp2 or megatron without it"),
    _warn("actor_rollout_ref.actor.megatron.router_replay.**", MOE),
    _warn_if("actor_rollout_ref.rollout.moe_tensor_parallel_size", *ONE, MOE, "use 1"),
    _map("actor_rollout_ref.actor.policy_loss.tau_*", "actor_rollout_ref.actor.tau_{0}", "verl 0.9's place of the "
         "SAPO gate temperatures (actor.tau_pos / tau_neg before)"),
    # ---------------------------------------------------------------- rollout pool of the V1 separate_async trainer
    _map("actor_rollout_ref.rollout.n_gpus_per_node", "rollout.n_gpus_per_node", "verl 0.9's standalone rollout "
         "pool (V1 separate_async): the rollout devices per node, verl's fully-async rollout.n_gpus_per_node"),
    _map("actor_rollout_ref.rollout.nnodes", "rollout.nnodes", "verl 0.9's standalone rollout pool's nodes"),
    _refuse("actor_rollout_ref.rollout.single_turn_response_length", "not a key of verl 0.9.1's rollout config "
            "either (verl's own script is wrong; later verl removed the override): use data.max_response_length"),
    _warn("actor_rollout_ref.rollout.standalone_gpu_memory_utilization", "engines on their own devices use "
          "actor_rollout_ref.rollout.gpu_memory_utilization"),
    # ---------------------------------------------------------------- verl 0.9's fully-async dynamic scheduling
    _warn_if("async_training.use_dynamic_resource_scheduling", _is(False), "false", "a fixed split",
             DYNAMIC),
    _warn("async_training.dynamic_schedule_*", "read only with use_dynamic_resource_scheduling=true (refused)"),
    # ---------------------------------------------------------------- critic, reward, distillation
    _warn("critic.fsdp.**", CRITIC_FOLLOWS),
    _map("reward.custom_reward_function.*", "custom_reward_function.{0}", "verl 0.9's place of "
         "custom_reward_function"),
    _map("reward.reward_model.enable", "reward_model.enable", "verl 0.9's place of reward_model.enable"),
    _map("reward.reward_model.model_path", "reward_model.model.path", "verl 0.9's place of reward_model.model.path"),
    _warn("reward.reward_model.enable_resource_pool", RM_SERVED + ", on the trainer's devices"),
    _warn("reward.reward_model.rollout.**", RM_SERVED),
    _warn("reward.num_workers", "rewards are scored in the rollouter as each group finishes"),
    _warn_if("distillation.enabled", _is(False), "false", "no distillation", OPD),
    _warn("distillation.**", "read only with distillation.enabled=true (refused)"),
    _warn("trainer.worker_env.**", "set environment variables in the launching shell: the Ray actors inherit it"),
    # ---------------------------------------------------------------- verl 0.9.1's other new keys
    _warn_if("actor_rollout_ref.actor.qat.enable", _is(False), "false", "no quantization-aware training", QAT),
    _warn_if("actor_rollout_ref.actor.*.qat.enable", _is(False), "false", "no quantization-aware training", QAT),
    _warn("actor_rollout_ref.actor.qat.*", "read only with qat.enable=true (refused)"),
    _warn("actor_rollout_ref.actor.*.qat.*", "read only with qat.enable=true (refused)"),
    _warn("actor_rollout_ref.rollout.qat", "verl's rollout view of the actor's qat section: " + QAT),
    _warn("actor_rollout_ref.actor.entropy_from_logits_chunk_size", CHUNKED),
    _warn("actor_rollout_ref.actor.megatron.entropy_from_logits_*", CHUNKED),
    _warn("actor_rollout_ref.actor.pad_to_length", PAD),
    _warn("actor_rollout_ref.actor.megatron.pad_to_length*", PAD),
    _warn("actor_rollout_ref.actor.megatron.pad_bshd_to_minibatch_max", "strategy=megatron pads each micro-batch's "
          "rows to that micro-batch's longest (the numbers do not depend on it)"),
    _warn("actor_rollout_ref.ref.pad_to_length", REF_FOLLOWS),
    _warn("actor_rollout_ref.actor.megatron.*_fully_reshardable*", "megatron dist checkpoints are not used: a "
          "checkpoint holds each rank's model and optimizer shards"),
    _warn_if("actor_rollout_ref.actor.megatron.dynamic_context_parallel", _is(False), "false", "no context "
             "parallelism", "context parallelism is not implemented (actor_rollout_ref.actor.megatron."
             "context_parallel_size must be 1)"),
    _warn("actor_rollout_ref.actor.megatron.max_seqlen_per_dp_cp_rank", "read only with dynamic_context_parallel="
          "true (refused)"),
    _warn_if("actor_rollout_ref.actor.optim.use_precision_aware_optimizer", _is(False), "false", "float32 Adam "
             "states", "megatron-core's precision-aware optimizer (lower-precision Adam states) is not implemented"),
    _warn("actor_rollout_ref.actor.optim.exp_avg*_dtype", PRECISION),
    _warn("actor_rollout_ref.actor.optim.main_grads_dtype", PRECISION),
    _warn_if("actor_rollout_ref.actor.optim.use_layer_wise_distributed_optimizer", _is(False), "false",
             "megatron's distributed optimizer (actor_rollout_ref.actor.megatron.use_distributed_optimizer)",
             "the layer-wise distributed optimizer is not implemented"),
    _warn("actor_rollout_ref.actor.optim.muon_*", MUON),
    _warn("actor_rollout_ref.actor.optim.zero_indexed_step", "the schedule counts optimizer steps from 1 whatever "
          "the value (algorithms/lr_schedule.py: verl's zero_indexed_step=false, so the first warm-up step's lr is "
          "not 0)"),
    _warn_if("actor_rollout_ref.rollout.disaggregation.enabled", _is(False), "false", "each engine replica "
             "prefills and decodes", "prefill/decode disaggregation is not implemented"),
    _warn("actor_rollout_ref.rollout.disaggregation.*", "read only with disaggregation.enabled=true (refused)"),
    _warn_if("actor_rollout_ref.rollout.full_determinism", _is(False), "false", "vLLM's default scheduling",
             "a batch-invariant (deterministic) engine mode is not implemented"),
    _warn("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", MOE),
    _warn_if("actor_rollout_ref.rollout.multi_turn.function_tool_path", _is(None), "null", "no @function_tool "
             "tools", "Python @function_tool tools are not implemented: give the tools in verl's tool YAML "
             "(actor_rollout_ref.rollout.multi_turn.tool_config_path)"),
    _warn_if("data.function_tool_path", _is(None), "null", "verl counts the @function_tool schemas in the prompt "
             "length; none here", "Python @function_tool tools are not implemented (multi_turn.tool_config_path)"),
    _warn_if("actor_rollout_ref.rollout.router_config_path", _is(None), "null", "the rollouter's own request "
             "routing", "external request routers are not implemented: the rollouter places requests on the "
             "engine replicas itself"),
    _warn("actor_rollout_ref.rollout.seed", "trainer.seed seeds the trainer and the engines"),
    _warn("algorithm.filter_groups.max_inflight_gen_batches", "dynamic sampling's further rounds draw only the "
          "groups still missing (mode=sync) or are admitted under the staleness bound (async)"),
    _warn("async_training.concurrent_samples_per_replica", "an engine replica decodes up to "
          "actor_rollout_ref.rollout.max_num_seqs sequences at once"),
    _warn_if("critic.loss_scale_factor", _is(None), "null", "the value loss's seq-mean-token-sum-norm constant is "
             "data.max_response_length (verl's when null; verl's default follows the actor's loss_scale_factor)",
             "a value-loss constant other than data.max_response_length is not implemented"),
    _warn("critic.model.use_fused_kernels", CRITIC_FOLLOWS),
    _warn("critic.model.fused_kernel_options.**", CRITIC_FOLLOWS),
    _warn_if("critic.model.use_liger", _is(False), "false", "no Liger kernels", "Liger kernels are not implemented"),
    _warn("critic.model.custom_chat_template", "the actor's tokenizer prepares every batch the critic sees"),
    _warn_if("critic.model.hf_config_path", _is(None), "null", "the config is critic.model.path's",
             "put the config in critic.model.path"),
    _warn("critic.model.exclude_modules", "LoRA is not implemented (lora_rank=0)"),
    _warn_if("critic.model.mtp.enable", _is(False), "false", "no multi-token prediction",
             "multi-token prediction is not implemented"),
    _warn("critic.model.mtp.**", "multi-token prediction is not implemented (mtp.enable=false)"),
    _warn("data.audio_key", "text-only data"),
    _warn("data.mm_processor_kwargs", "text-only data"),
    _warn("reward.reward_model.n_gpus_per_node", RM_SERVED + ", on the trainer's devices"),
    _warn("reward.reward_model.nnodes", RM_SERVED + ", on the trainer's devices"),
    _map("reward.sandbox_fusion.*", "reward_model.sandbox_fusion.{0}", "verl 0.9's place of "
         "reward_model.sandbox_fusion"),
    _map("sandbox_fusion.*", "reward_model.sandbox_fusion.{0}", "verl 0.9's legacy spelling (null: unset)",
         null_unset=True),
    _warn_if("skip.*.enable", _is(False), "false", "every step generates", SKIP),
    _warn("skip.**", "read only with skip.*.enable=true (refused)"),
    _warn_if("trainer.checkpoint_callback_class", _is(None), "null", "no checkpoint callback",
             "checkpoint callbacks are not implemented: a checkpoint is a global_step_<v> folder under "
             "trainer.default_local_dir"),
    _warn("transfer_queue.**", "read only with transfer_queue.enable=true: groups move through the "
          "staleness-bounded queue here"),
]
