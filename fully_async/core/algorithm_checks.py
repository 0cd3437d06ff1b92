"""The algorithm's part of the config validation (layer 0, core/config_checks.py runs it): the advantage estimator,
KL control, PF-PPO, DAPO's dynamic sampling, verl's rollout correction and the reward model, each raising
`ConfigError` naming the key and the valid values."""
from __future__ import annotations

import logging
from typing import Any

from fully_async.core.config import (ADV_ESTIMATORS, FILTER_METRICS, GROUP_ADV_ESTIMATORS, KL_TYPES, OTB_ESTIMATORS,
                                     PF_PPO_REWEIGHT_METHODS, ROLLOUT_IS_LEVELS, ConfigError)
from fully_async.core.rollout_correction_spec import is_threshold, rs_options, rs_thresholds

logger = logging.getLogger(__name__)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {list(choices)}")


def _at_least(key: str, value: Any, low: float, strict: bool = False) -> None:
    if value is None or (value <= low if strict else value < low):
        raise ConfigError(key, f"{value!r} must be {'>' if strict else '>='} {low}")


def check_sum_pi_squared(cfg: Any) -> None:
    """The optimal-token-baseline estimators read sum_v pi_v^2 of the actor's old-policy pass: verl asserts
    actor.calculate_sum_pi_squared=true for them (refused here before anything loads); the torch/fsdp2 trainer
    computes it (the megatron one does not)."""
    actor, estimator = cfg.actor_rollout_ref.actor, cfg.algorithm.adv_estimator
    if estimator in OTB_ESTIMATORS and not actor.calculate_sum_pi_squared:
        raise ConfigError("actor_rollout_ref.actor.calculate_sum_pi_squared",
                          f"false, but algorithm.adv_estimator={estimator} needs the actor's sum of squared token "
                          "probabilities: set it to true (as verl asks)")
    if actor.calculate_sum_pi_squared and actor.strategy == "megatron":
        raise ConfigError("actor_rollout_ref.actor.calculate_sum_pi_squared",
                          "true with strategy=megatron: the megatron trainer does not compute sum_pi_squared "
                          "(use strategy fsdp/fsdp2/torch)")
    if actor.calculate_sum_pi_squared and estimator not in OTB_ESTIMATORS:
        logger.warning("actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect with "
                       "algorithm.adv_estimator=%s: only %s read it (verl also logs variance-proxy metrics from it, "
                       "which are not computed here)", estimator, " and ".join(OTB_ESTIMATORS))


def check_pf_ppo(alg: Any) -> None:
    """PF-PPO: a known reweighting; verl applies it with gae only (elsewhere it is warned, as it does nothing)."""
    _choice("algorithm.pf_ppo.reweight_method", alg.pf_ppo.reweight_method, PF_PPO_REWEIGHT_METHODS)
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        logger.warning("algorithm.use_pf_ppo=true has no effect with algorithm.adv_estimator=%s: verl resamples by "
                       "reward after gae advantages only", alg.adv_estimator)


def check_algorithm(cfg: Any) -> None:
    estimator = cfg.algorithm.adv_estimator
    _choice("algorithm.adv_estimator", estimator, ADV_ESTIMATORS)
    check_sum_pi_squared(cfg)
    check_pf_ppo(cfg.algorithm)
    gamma = cfg.algorithm.gamma
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError("algorithm.gamma", f"{gamma!r} must be in [0, 1]")
    if gamma != 1.0 and estimator not in ("reinforce_plus_plus", "gae"):
        raise ConfigError("algorithm.gamma", f"{gamma!r}: only adv_estimator=gae and reinforce_plus_plus discount; "
                          f"{estimator} scores whole responses (use 1.0)")
    if cfg.algorithm.lam != 1.0 and estimator != "gae":
        logger.warning("algorithm.lam=%r has no effect: only adv_estimator=gae has a lambda (%s has none)",
                       cfg.algorithm.lam, estimator)
    check_estimator_options(cfg.algorithm)
    _choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_TYPES)
    ctrl = cfg.algorithm.kl_ctrl
    _choice("algorithm.kl_ctrl.type", ctrl.type, ("fixed", "adaptive"))
    if ctrl.type == "adaptive":
        _at_least("algorithm.kl_ctrl.horizon", ctrl.horizon, 0, strict=True)
        _at_least("algorithm.kl_ctrl.target_kl", ctrl.target_kl, 0.0, strict=True)


def check_estimator_options(alg: Any) -> None:
    """gpg's f_norm, the optimal-token-baseline estimators' handle_zero_tail and gdpo's reward keys and weights."""
    if alg.gpg_f_norm == 0 or alg.gpg_f_norm != alg.gpg_f_norm:
        raise ConfigError("algorithm.gpg_f_norm", f"{alg.gpg_f_norm!r}: the gpg advantages are divided by it; give a "
                          "non-zero number (verl's default 1.0)")
    if alg.gpg_f_norm != 1.0 and alg.adv_estimator != "gpg":
        logger.warning("algorithm.gpg_f_norm=%r has no effect: only adv_estimator=gpg reads it", alg.gpg_f_norm)
    if not alg.handle_zero_tail and alg.adv_estimator not in OTB_ESTIMATORS:
        logger.warning("algorithm.handle_zero_tail=false has no effect: only %s read it", " and ".join(OTB_ESTIMATORS))
    if alg.adv_estimator != "gdpo":
        return
    keys, weights = alg.gdpo_reward_keys, alg.gdpo_reward_weights
    if not keys:
        raise ConfigError("algorithm.gdpo_reward_keys", "is required with adv_estimator=gdpo (as verl): the keys of "
                          "the reward function's dict to normalise separately, e.g. [format_reward,accuracy_reward] "
                          "('score' is the score itself)")
    if weights is not None and len(weights) != len(keys):
        raise ConfigError("algorithm.gdpo_reward_weights", f"{list(weights)} has {len(weights)} entries for "
                          f"{len(keys)} gdpo_reward_keys {list(keys)}: give one weight per key (or null: 1 each)")


def check_grpo_group(cfg: Any) -> None:
    n, estimator = cfg.actor_rollout_ref.rollout.n, cfg.algorithm.adv_estimator
    if estimator in GROUP_ADV_ESTIMATORS and n < 2:
        raise ConfigError("actor_rollout_ref.rollout.n",
                          f"algorithm.adv_estimator={estimator} compares a response with the other responses to its "
                          f"prompt, so it needs n >= 2 responses per prompt (got {n}); with n=1 use "
                          "reinforce_plus_plus")


def check_filter_groups(cfg: Any) -> None:
    """DAPO's dynamic sampling: a metric to compare, and one this run can compute before training."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    if fg.metric is None:
        raise ConfigError("algorithm.filter_groups.metric", f"is required with filter_groups.enable=true: one of "
                          f"{', '.join(FILTER_METRICS)}")
    _choice("algorithm.filter_groups.metric", fg.metric, FILTER_METRICS)
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric", "seq_final_reward with algorithm.use_kl_in_reward: the "
                          "in-reward KL penalty is applied by the trainer after groups are filtered; use seq_reward")


def check_rollout_correction(cfg: Any) -> None:
    """verl's rollout correction: valid levels and thresholds, and the combinations of it with decoupled PPO."""
    rc, at = cfg.algorithm.rollout_correction, cfg.async_training
    key = "algorithm.rollout_correction"
    if rc.rollout_is is not None:
        _choice(f"{key}.rollout_is", rc.rollout_is, ROLLOUT_IS_LEVELS)
        try:
            is_threshold(rc.rollout_is_threshold)
        except ValueError as exc:
            raise ConfigError(f"{key}.rollout_is_threshold", str(exc)) from None
    if rc.rollout_rs is not None:
        try:
            rs_thresholds(rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(f"{key}.rollout_rs", str(exc)) from None
    _choice(f"{key}.loss_type", rc.loss_type, ("ppo_clip", "reinforce"))
    if rc.loss_type == "reinforce" and not rc.bypass_mode:
        logger.warning("%s.loss_type=reinforce has no effect with bypass_mode=false: verl reads it in bypass mode "
                       "only (the decoupled mode keeps the clipped surrogate)", key)
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.loss_type == "reinforce" and rc.bypass_mode and loss_mode != "vanilla":
        raise ConfigError(f"{key}.loss_type", "reinforce replaces the policy loss in bypass mode (as verl's "
                          "bypass_mode loss): set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    if rc.rollout_is is None and rc.rollout_rs is None:
        return
    if not at.use_rollout_log_probs:
        raise ConfigError(key, "needs async_training.use_rollout_log_probs=true (the behaviour log-probs)")
    if rc.bypass_mode and at.decoupled_ppo:
        raise ConfigError(f"{key}.bypass_mode", "bypass mode takes the behaviour log-probs as the old policy, "
                          "async_training.decoupled_ppo recomputes it: choose one")
    if rc.rollout_is is not None and at.decoupled_ppo:
        logger.warning("%s.rollout_is=%s with async_training.decoupled_ppo (verl: compute_prox_log_prob): the "
                       "recomputed old policy is decoupled PPO's proximal one, and rollout correction's weights "
                       "(truncated at rollout_is_threshold=%s) replace decoupled PPO's own (behav_imp_weight_cap=%s "
                       "is not used), as verl", key, rc.rollout_is, rc.rollout_is_threshold, at.behav_imp_weight_cap)


def check_reward_model(cfg: Any) -> None:
    """reward_model.enable: a model path (the trainer's backend, torch / fsdp2 / megatron, scores the responses).
    In async mode the trainer scores each batch in its own turn, after the queue: what needs scores before the queue
    (DAPO's dynamic sampling, remax's baseline taken out of the group) is refused there."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    if not rm.model.path:
        raise ConfigError("reward_model.model.path", "is required with reward_model.enable=true: the Hugging Face "
                          "folder of the reward model (a ...ForSequenceClassification with one label)")
    if cfg.mode == "async" and cfg.algorithm.filter_groups.enable:
        raise ConfigError("algorithm.filter_groups.enable", "true with reward_model.enable in mode=async: dynamic "
                          "sampling filters groups by their scores before the queue, and the reward model scores "
                          "them in the trainer, after it; use mode=sync or filter_groups.enable=false")
    if cfg.mode == "async" and cfg.algorithm.adv_estimator == "remax":
        raise ConfigError("algorithm.adv_estimator", "remax with reward_model.enable in mode=async: the greedy "
                          "baseline leaves its group in the rollouter, before the trainer's reward model could score "
                          "it; use mode=sync")
    if rm.micro_batch_size_per_gpu is not None:
        _at_least("reward_model.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu, 1)
    if rm.max_length is not None:
        _at_least("reward_model.max_length", rm.max_length, 1)
    if cfg.custom_reward_function.path:
        logger.warning("custom_reward_function.path=%s is not used: with reward_model.enable=true the reward model's "
                       "scores are the rewards (as verl's reward managers return rm_scores)",
                       cfg.custom_reward_function.path)
