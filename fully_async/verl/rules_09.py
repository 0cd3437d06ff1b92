"""verl 0.9's config keys that its example scripts use and b178a3cd's did not (layer 1): one rule each, as in
rules.py (mapped, warned, refused), read after that table.  The V1 trainer's keys (`trainer.v1.*`, `model_engine`)
set several of ours at once and are translated by verl/v1.py instead.
"""
from __future__ import annotations

from fully_async.verl.rules import CRITIC_FOLLOWS, MOE, ONE, RM_SERVED, Rule, _is, _map, _refuse, _warn, _warn_if

ENGINE = ("verl 0.9's {name} engine is not implemented here; the trainer runs on actor_rollout_ref.actor.strategy "
          "(fsdp|fsdp2|torch|megatron) with its own keys (actor_rollout_ref.actor.fsdp_config.*, .megatron.*)")
OPD = ("on-policy distillation (a teacher model's log-probs in the loss) is not implemented; train with a reward "
       "(custom_reward_function.path) instead")
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
]
