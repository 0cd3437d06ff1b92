"""RL math on plain tensors (layer 1; no Ray): the critic-free advantage estimators, the policy-loss family and its
aggregation modes, the one actor loss every backend runs, the in-reward KL controller, the LR schedule, token sampling,
DAPO's dynamic sampling (dynamic_sampling.py) and verl's rollout correction (rollout_correction.py).  It imports only
core; the trainer side (train/), the engines' sampling (rollout/) and the layers above import it."""
from fully_async.algorithms.actor_loss import ActorLossOutput, actor_loss, actor_metric_names
from fully_async.algorithms.advantages import (AdvantageInput, compute_advantages, compute_advantages_and_returns,
                                               grpo_advantages, token_level_rewards)
from fully_async.algorithms.losses import agg_loss, kl_penalty, masked_mean
from fully_async.algorithms.policy_losses import PolicyLossInput, PolicyLossOutput, policy_loss

__all__ = ["ActorLossOutput", "actor_loss", "actor_metric_names", "AdvantageInput", "compute_advantages",
           "compute_advantages_and_returns",
           "grpo_advantages", "token_level_rewards", "PolicyLossInput", "PolicyLossOutput", "agg_loss", "kl_penalty",
           "masked_mean", "policy_loss"]
from fully_async.algorithms.sampling import filter_top_k_top_p, sample_tokens  # noqa: E402

__all__ += ["filter_top_k_top_p", "sample_tokens"]
