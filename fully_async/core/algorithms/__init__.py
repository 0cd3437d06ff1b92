"""Pure RL math (layer 0): advantages and losses on plain tensors, unit-tested by hand."""
from fully_async.core.algorithms.actor_loss import ActorLossOutput, actor_loss, actor_metric_names
from fully_async.core.algorithms.advantages import grpo_advantages
from fully_async.core.algorithms.losses import (PolicyLossInput, PolicyLossOutput, agg_loss, kl_penalty, masked_mean,
                                           policy_loss)

__all__ = ["ActorLossOutput", "actor_loss", "actor_metric_names", "grpo_advantages", "PolicyLossInput",
           "PolicyLossOutput", "agg_loss", "kl_penalty", "masked_mean", "policy_loss"]
from fully_async.core.algorithms.sampling import filter_top_k_top_p, sample_tokens  # noqa: E402

__all__ += ["filter_top_k_top_p", "sample_tokens"]
